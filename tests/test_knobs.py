"""The one registry of variable names (``tools/knobs.py``) against the code, the reference, and its table.

- every ``SMG_*`` / ``ENGINELINK_*`` name written in enginelink's code, tools
  and tests is registered (a name the code reads but the registry lacks would
  be warned about as a typo at start-up), and every enginelink name
  registered is read somewhere;
- every ``SMG_*`` name in the reference package's source is registered
  (when its source is here: the bench-refs venv, ``tools/setup-bench-refs``);
- each row's test exists;
- ``docs/compatibility.md`` is what ``tools/compat_table.py`` generates now.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from enginelink.tools import bench_refs, compat_table, knobs

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"\b(?:SMG|ENGINELINK)_[A-Z0-9_]*[A-Z0-9]\b")
# Written in the code as the start of a name built there (f"ENGINELINK_SKIP_{engine}", ...), or the
# reference's own constant, not a variable.
FRAGMENTS = {"ENGINELINK_MAX", "ENGINELINK_VLLM", "ENGINELINK_MLX", "ENGINELINK_SKIP", "ENGINELINK_REQUIRE",
             "SMG_VLLM_MM", "SMG_VLLM_SERVICER_METRICS", "SMG_MODE_REFUSAL", "ENGINELINK_TEST_MODEL"}
SOURCES = ("runtime", "machines", "journal", "wire", "proto", "tools", "tests", ".ci")
# The typos tests/test_ref_settings.py sets on purpose, to see them warned about.
TYPOS = {"ENGINELINK_DRAN_SECS", "SMG_VLLM_SERVICER_WARMPU", "SMG_SGLANG_SERVICER_SILENCE_TIMEOUT", "ENGINELINK_QQQ"}


def names_in_code() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for top in SOURCES:
        for path in (ROOT / top).rglob("*"):
            if not path.is_file() or path.suffix not in ("", ".py", ".sh") or "fixtures" in path.parts:
                continue
            if path == ROOT / "tools" / "knobs.py" or path.name == "test_knobs.py":
                continue
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                continue
            for name in NAME.findall(text):
                found.setdefault(name, path)
    return found


def test_every_name_the_code_writes_is_registered():
    unknown = {name: str(path.relative_to(ROOT)) for name, path in names_in_code().items()
               if name not in knobs.BY_NAME and name not in FRAGMENTS | TYPOS}
    assert not unknown, f"register these in tools/knobs.py (or they are warned about as typos): {unknown}"


def test_every_enginelink_name_registered_is_read_somewhere():
    written = names_in_code()
    read_by_registry = set(knobs._OWN_NAME.values())  # serve reads these through knobs.names()
    unread = [k.name for k in knobs.KNOBS if k.origin == "enginelink" and k.name not in set(written) | read_by_registry]
    assert not unread, f"registered but read nowhere: {unread}"


def reference_source() -> Path | None:
    try:
        venv = bench_refs.refs_python().parent.parent
    except RuntimeError:
        return None
    found = sorted(venv.glob("lib/python3*/site-packages/smg_grpc_servicer"))
    return found[0] if found else None


def test_every_name_in_the_reference_package_is_registered():
    source = reference_source()
    if source is None:
        if os.environ.get("ENGINELINK_REQUIRE_BENCH_REFS") == "1":
            pytest.fail("the reference package is required here: tools/setup-bench-refs installs smg-grpc-servicer 0.14.1")
        pytest.skip("the reference package is not here (tools/setup-bench-refs installs smg-grpc-servicer 0.14.1)")
    theirs = {name for path in source.rglob("*.py") for name in NAME.findall(path.read_text())}
    missing = sorted(theirs - set(knobs.BY_NAME) - FRAGMENTS)
    assert not missing, f"the reference's names tools/knobs.py does not account for: {missing}"


def test_the_issue_names_are_each_accounted_for():
    """The names issue 32 lists as read nowhere are each honoured or warned about, never silent."""
    listed = [*(f"SMG_{e}_SERVICER_{s}" for e in ("SGLANG", "TOKENSPEED") for s in (
        "WARMUP", "DRAIN_SECS", "STARTUP_TIMEOUT_SECS", "STARTUP_CEILING_SECS", "SILENCE_TIMEOUT_SECS", "KV_EVENTS",
        "METRICS_HOST", "METRICS_PORT", "PREFILL_TOKENS_PER_SEC", "HANDSHAKE_PORT")),
        "SMG_VLLM_SERVICER_HANDSHAKE_PORT", "SMG_SERVICER_WORKER_THREADS", "SMG_ZMQ_SOCKET_DIR",
        *(k.name for k in knobs.KNOBS if k.name.startswith("SMG_VLLM_MM_"))]
    for name in listed:
        knob = knobs.BY_NAME[name]
        assert knob.status in (knobs.HONOURED, knobs.INAPPLICABLE), name
        assert knob.status != knobs.INAPPLICABLE or knob.why, name


def _tests_named() -> list[str]:
    named = {k.test for k in knobs.KNOBS if k.test}
    named |= {row[-1].strip("`") for row in compat_table.servicer_flags() if row[-1] != "—"}
    named |= {test for *_, test in compat_table.OTHER_FLAGS if test}
    return sorted(named)


@pytest.mark.parametrize("test", _tests_named())
def test_each_rows_test_exists(test):
    path, _, name = test.partition("::")
    tree = ast.parse((ROOT / path).read_text())
    defined = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert name in defined, f"{test} names a test that is not there"


def test_the_compatibility_table_is_current():
    assert compat_table.DOC.read_text() == compat_table.render(), (
        "docs/compatibility.md is stale: python -m enginelink.tools.compat_table --write")
