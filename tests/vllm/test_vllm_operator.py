"""A real vLLM engine refusing its arguments: the servicer exits 2 (the operator's typo), not 1."""

from __future__ import annotations

import os
import subprocess

import pytest

from enginelink.journal.store import open_reader
from tests.harness import VENV_BIN, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_vllm_refusing_an_unknown_argument_exits_2_with_its_reason(tmp_path, test_model_dir, vllm_python, socket_dir):
    journal = tmp_path / "j.sqlite"
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "SMG_ZMQ_SOCKET_DIR": str(socket_dir),
           "ENGINELINK_VLLM_PYTHON": vllm_python, "SMG_VLLM_SERVICER_WARMUP": "off"}
    done = subprocess.run(
        [str(VENV_BIN / "enginelink"), "serve", "--engine", "vllm", "--model", str(test_model_dir),
         "--port", str(free_port()), "--journal", str(journal),
         "--", "--max-model-len", "1024", "--hf-token", "s3cret", "--bogus", "3"],
        capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    [line] = [line for line in done.stderr.splitlines() if "exiting with status" in line]
    assert "exiting with status 2: engine link failed: the engine refused its arguments" in line, line
    assert "vllm-headless (enginelink): error: unrecognized arguments: --bogus 3" in line, line
    # Not vLLM's 250-line usage, and the credential nowhere.
    assert "usage:" not in done.stderr and "s3cret" not in done.stderr
    with open_reader(journal) as reader:
        records = reader.records()
    [stop] = [r for r in records if r.kind == "run.stop"]
    assert stop.payload["exit_status"] == 2
    assert "s3cret" not in str([r.payload for r in records])
