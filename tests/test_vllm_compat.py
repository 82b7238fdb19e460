"""The launch-time guard between enginelink's vLLM codec and the installed vLLM release.

``compare`` is pure and driven here with layouts that drift the ways a vLLM
release can; the CLI test shows the promised refusal end to end, with a fake
release's layout (the ``ENGINELINK_VLLM_LAYOUT_FILE`` test hook), so it needs
no vLLM installation.
"""

from __future__ import annotations

import copy
import os
import json
import subprocess

import pytest

from enginelink.runtime.engine import vllm_compat
from enginelink.wire.vllm import LAYOUT
from tests.harness import VENV_BIN, free_port


def release(version: str = "0.32.0", **changes) -> dict:
    layout = copy.deepcopy(dict(LAYOUT))
    layout["version"] = version
    layout.update(changes)
    return layout


def test_the_codec_matches_its_own_release():
    assert vllm_compat.compare(LAYOUT, release()) == []
    assert vllm_compat.check(release(), "/venv/bin/python") is None


def test_a_moved_request_field_is_named_with_the_release():
    request = list(LAYOUT["request"])
    request[9], request[10] = request[10], request[9]
    problems = vllm_compat.compare(LAYOUT, release("0.33.0", request=request))
    assert problems == [
        "EngineCoreRequest field 9 is 'prompt_is_token_ids' in vLLM 0.33.0, 'prompt_embeds' in enginelink's codec",
        "EngineCoreRequest field 10 is 'prompt_embeds' in vLLM 0.33.0, 'prompt_is_token_ids' in enginelink's codec",
    ]


def test_a_shorter_or_stricter_request_is_refused():
    shorter = release("0.31.0", request=LAYOUT["request"][:21])
    assert vllm_compat.compare(LAYOUT, shorter) == [
        "EngineCoreRequest has 21 fields in vLLM 0.31.0; enginelink sends 22 (field 21 'kv_hints' does not exist there)"
    ]
    stricter = release("0.34.0", request=LAYOUT["request"] + ["new_required"], request_required=23)
    assert vllm_compat.compare(LAYOUT, stricter) == [
        "EngineCoreRequest needs 23 fields in vLLM 0.34.0; enginelink sends 22"
    ]


def test_appended_fields_are_compatible():
    newer = release(
        "0.32.1",
        request=LAYOUT["request"] + ["later_field"],
        outputs=LAYOUT["outputs"] + ["later_field"],
        output=LAYOUT["output"] + ["later_field"],
        sampling_keys=LAYOUT["sampling_keys"] + ["later_key"],
    )
    assert vllm_compat.compare(LAYOUT, newer) == []
    warning = vllm_compat.check(newer, "/venv/bin/python")
    assert warning and "0.32.1" in warning and "not a release enginelink was tested with" in warning


def test_output_fields_sampling_keys_and_finish_reasons_are_checked():
    output = list(LAYOUT["output"])
    output[5], output[6] = output[6], output[5]
    sampling = [k for k in LAYOUT["sampling_keys"] if k != "_eos_token_id"]
    reasons = {**LAYOUT["finish_reasons"], "ABORT": 7, "TIMEOUT": 5}
    problems = vllm_compat.compare(LAYOUT, release("0.40.0", output=output, sampling_keys=sampling,
                                                   finish_reasons=reasons))
    assert "EngineCoreOutput field 5 is 'stop_reason' in vLLM 0.40.0, 'finish_reason' in enginelink's codec" in problems
    assert "SamplingParams has no key '_eos_token_id' in vLLM 0.40.0; enginelink sends it" in problems
    assert "FinishReason ABORT is 7 in vLLM 0.40.0, 2 in enginelink's codec" in problems
    assert "FinishReason TIMEOUT is 5 in vLLM 0.40.0, unknown in enginelink's codec" in problems


def test_check_raises_incompatible_naming_release_field_and_supported():
    request = list(LAYOUT["request"])
    request[3] = "sampling"
    with pytest.raises(vllm_compat.Incompatible) as refused:
        vllm_compat.check(release("0.33.0", request=request), "/opt/vllm/bin/python")
    message = str(refused.value)
    assert "the vLLM at /opt/vllm/bin/python is vLLM 0.33.0" in message
    assert "EngineCoreRequest field 3 is 'sampling' in vLLM 0.33.0, 'sampling_params'" in message
    assert "Supported vLLM releases: 0.32.0." in message


def test_ready_response_version_must_be_the_checked_release():
    assert vllm_compat.check_ready({"vllm_version": "0.32.0"}, "0.32.0") is None
    problem = vllm_compat.check_ready({"vllm_version": "0.33.0"}, "0.32.0")
    assert problem and "says vLLM 0.33.0" in problem and "verified vLLM 0.32.0" in problem
    assert "(none)" in vllm_compat.check_ready({}, "0.32.0")


@pytest.mark.process
def test_serve_refuses_a_fake_release_before_any_engine_starts(tmp_path, test_model_dir):
    request = list(LAYOUT["request"])
    request[9], request[10] = request[10], request[9]
    fake = tmp_path / "vllm-0.33.0-layout.json"
    fake.write_text(json.dumps(release("0.33.0", request=request)))
    done = subprocess.run(
        [str(VENV_BIN / "enginelink"), "serve", "--engine", "vllm", "--model", str(test_model_dir),
         "--port", str(free_port()), "--journal", str(tmp_path / "journal.sqlite")],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "ENGINELINK_VLLM_LAYOUT_FILE": str(fake),
             "ENGINELINK_VLLM_PYTHON": str(tmp_path / "no-such-python")},
    )
    assert done.returncode == 2, done.stderr
    assert "vLLM 0.33.0" in done.stderr
    assert "EngineCoreRequest field 9 is 'prompt_is_token_ids' in vLLM 0.33.0, 'prompt_embeds'" in done.stderr
    assert "Supported vLLM releases: 0.32.0" in done.stderr
    assert not (tmp_path / "journal.sqlite").exists(), "refused before the servicer started"
