"""The launch-time guard between enginelink's vLLM codec and the installed vLLM release.

Every release from 0.28.0 to 0.34.0 is accepted as its layout file says; an
installed build whose structs are not its release's is refused naming the
field; a release outside the window is refused before anything starts (one
line naming the release and the window, exit 2), unless
``--allow-untested-vllm`` / ``ENGINELINK_ALLOW_UNTESTED_VLLM=1`` is given and
its layout is one the codec can speak. The CLI tests use a fake release's
layout (the ``ENGINELINK_VLLM_LAYOUT_FILE`` test hook) or a fake vLLM package
(the version read without importing vLLM), so they need no vLLM installation.
"""

from __future__ import annotations

import copy
import json
import os
import stat
import subprocess
import sys

import pytest

from enginelink.runtime.contracts.vllm import compat as vllm_compat
from enginelink.wire import vllm, vllm_layout
from tests.harness import VENV_BIN, free_port
from tests.test_operator import refused_with_one_line

WINDOW = "0.28.0 to 0.34.0"


def layout(version: str = "0.32.0", like: str = "0.32.0") -> dict:
    """An installed release's layout: ``like``'s, saying it is ``version``."""
    out = copy.deepcopy(vllm_layout.load(like))
    out["release"] = version
    return out


def move(out: dict, struct: str, a: int, b: int) -> dict:
    fields = out["structs"][struct]["fields"]
    fields[a], fields[b] = fields[b], fields[a]
    return out


@pytest.mark.parametrize("release", vllm_layout.WINDOW)
def test_every_release_of_the_window_is_accepted_as_its_layout_file_says(release):
    checked = vllm_compat.check(layout(release, release), "/venv/bin/python")
    assert checked.version == release and checked.warning is None
    assert checked.release.release == release


def test_a_build_whose_structs_are_not_its_releases_is_refused_naming_the_field():
    with pytest.raises(vllm_compat.Incompatible) as refused:
        vllm_compat.check(move(layout("0.32.0"), "EngineCoreRequest", 9, 10), "/opt/vllm/bin/python")
    message = str(refused.value)
    assert "the vLLM at /opt/vllm/bin/python says it is vLLM 0.32.0" in message
    assert "EngineCoreRequest field 9 is 'prompt_is_token_ids' in the installed vLLM 0.32.0, 'prompt_embeds'" in message


@pytest.mark.parametrize("version", ["0.27.1", "0.35.0", "1.0.0"])
def test_a_release_outside_the_window_is_refused_naming_it_and_the_window(version):
    with pytest.raises(vllm_compat.Incompatible) as refused:
        vllm_compat.check(layout(version), "/venv/bin/python")
    assert str(refused.value) == (
        f"vLLM {version} at /venv/bin/python is outside the vLLM releases enginelink supports ({WINDOW}); run a "
        "release of the window, or allow an untested one with --allow-untested-vllm "
        "(ENGINELINK_ALLOW_UNTESTED_VLLM=1), which then checks its wire layout first")


def test_an_allowed_untested_release_runs_when_the_codec_speaks_its_layout():
    newer = layout("0.35.0", like="0.34.0")
    newer["structs"]["EngineCoreOutput"]["fields"].append({"name": "later", "required": False, "default": None})
    checked = vllm_compat.check(newer, "/venv/bin/python", allow_untested=True)
    assert checked.version == "0.35.0" and checked.release.prompt_ids_array
    assert "not a release enginelink was tested with (0.28.0 to 0.34.0)" in checked.warning
    # ... and is refused, naming the field, when it cannot.
    with pytest.raises(vllm_compat.Incompatible) as refused:
        vllm_compat.check(move(layout("0.35.0"), "EngineCoreOutput", 5, 6), "/venv/bin/python", allow_untested=True)
    assert "EngineCoreOutput field 5 is 'stop_reason' in vLLM 0.35.0, 'finish_reason' in enginelink's codec" in str(
        refused.value)


def test_the_allow_variable_takes_yes_or_no():
    assert vllm_compat.allow_untested_from_env({}) is False
    assert vllm_compat.allow_untested_from_env({"ENGINELINK_ALLOW_UNTESTED_VLLM": "1"}) is True
    assert vllm_compat.allow_untested_from_env({"ENGINELINK_ALLOW_UNTESTED_VLLM": "0"}) is False
    with pytest.raises(vllm_compat.Incompatible, match="expected 1 or 0"):
        vllm_compat.allow_untested_from_env({"ENGINELINK_ALLOW_UNTESTED_VLLM": "maybe"})


def test_ready_response_version_must_be_the_checked_release():
    assert vllm_compat.check_ready({"vllm_version": "0.28.0"}, "0.28.0") is None
    assert vllm_compat.check_ready({"vllm_version": "0.32.0+cpu"}, "0.32.0") is None
    problem = vllm_compat.check_ready({"vllm_version": "0.33.0"}, "0.32.0")
    assert problem and "says vLLM 0.33.0" in problem and "verified vLLM 0.32.0" in problem
    assert "(none)" in vllm_compat.check_ready({}, "0.32.0")
    # The handshake machine reads the release the same way: a local build label is not another release.
    assert vllm.VllmHandshake.version(vllm.ReadyResponse(vllm_version="0.33.0+cu129")) == "0.33.0"


# -- the CLI: refused before anything starts -------------------------------------------------------


def serve(tmp_path, model_dir, *flags: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(VENV_BIN / "enginelink"), "serve", "--engine", "vllm", "--model", str(model_dir),
         "--port", str(free_port()), "--journal", str(tmp_path / "journal.sqlite"), *flags],
        capture_output=True, text=True, timeout=60, env={**os.environ, **env})


def fake_vllm_python(tmp_path, version: str) -> str:
    """An interpreter whose vLLM says ``version`` and cannot be imported (the check must not import it)."""
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("raise SystemExit('vllm was imported')\n")
    (site / "vllm" / "_version.py").write_text(f"__version__ = version = '{version}'\n")
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return str(python)


@pytest.mark.process
def test_serve_refuses_a_release_outside_the_window_before_importing_it(tmp_path, test_model_dir):
    python = fake_vllm_python(tmp_path, "0.27.1")
    done = serve(tmp_path, test_model_dir, env={"ENGINELINK_VLLM_PYTHON": python})
    line = refused_with_one_line(done)
    assert line == (f"enginelink serve: vLLM 0.27.1 at {python} is outside the vLLM releases enginelink supports "
                    f"({WINDOW}); run a release of the window, or allow an untested one with --allow-untested-vllm "
                    "(ENGINELINK_ALLOW_UNTESTED_VLLM=1), which then checks its wire layout first")
    assert not (tmp_path / "journal.sqlite").exists(), "refused before the servicer started"


@pytest.mark.parametrize("allow", [["--allow-untested-vllm"], []], ids=["flag", "variable"])
@pytest.mark.process
def test_serve_with_untested_allowed_checks_the_layout_first(tmp_path, test_model_dir, allow):
    fake = tmp_path / "vllm-0.35.0-layout.json"
    fake.write_text(json.dumps(move(layout("0.35.0"), "EngineCoreOutputs", 2, 3)))
    env = {"ENGINELINK_VLLM_LAYOUT_FILE": str(fake), "ENGINELINK_VLLM_PYTHON": str(tmp_path / "no-such-python")}
    if not allow:
        env["ENGINELINK_ALLOW_UNTESTED_VLLM"] = "1"
    line = refused_with_one_line(serve(tmp_path, test_model_dir, *allow, env=env))
    assert "vLLM 0.35.0 at" in line and "outside the releases enginelink supports (0.28.0 to 0.34.0)" in line
    assert "EngineCoreOutputs field 2 is 'timestamp' in vLLM 0.35.0, 'scheduler_stats' in enginelink's codec" in line
    assert not (tmp_path / "journal.sqlite").exists(), "refused before the servicer started"


@pytest.mark.process
def test_serve_refuses_a_relabelled_build_of_a_supported_release(tmp_path, test_model_dir):
    fake = tmp_path / "vllm-0.30.0-layout.json"
    fake.write_text(json.dumps(move(layout("0.30.0", like="0.30.0"), "EngineCoreRequest", 9, 10)))
    done = serve(tmp_path, test_model_dir, env={"ENGINELINK_VLLM_LAYOUT_FILE": str(fake),
                                                "ENGINELINK_VLLM_PYTHON": str(tmp_path / "no-such-python")})
    line = refused_with_one_line(done)
    assert "says it is vLLM 0.30.0, but its engine structs are not vLLM 0.30.0's" in line
    assert "EngineCoreRequest field 9 is 'prompt_is_token_ids' in the installed vLLM 0.30.0" in line
