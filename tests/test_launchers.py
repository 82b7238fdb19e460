"""Launch recipes: the vLLM launcher's command and environment, finding vLLM, redaction."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from enginelink.runtime.contracts.vllm import launch
from enginelink.runtime.contracts.vllm.launch import VllmLauncher, default_vllm_python
from enginelink.runtime.engine import side_venv
from enginelink.runtime.engine.launchers import flag_value, redact_args


def test_vllm_command_runs_the_headless_script_with_the_users_args(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    launcher = VllmLauncher(python="/venv/bin/python", model_dir=Path("/models/tiny"),
                            extra_args=["--max-model-len", "256", "--enforce-eager"])
    argv, env = launcher.command("tcp://127.0.0.1:4242")
    assert argv == ["/venv/bin/python", str(launch.VLLM_HEADLESS_SCRIPT), "--handshake", "tcp://127.0.0.1:4242",
                    "--", "--model", "/models/tiny", "--max-model-len", "256", "--enforce-eager"]
    assert launch.VLLM_HEADLESS_SCRIPT.is_file()
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1"}


def test_kv_cache_space_is_left_to_the_operator_when_set(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    assert VllmLauncher("/p", Path("/m")).command("tcp://h:1")[1] == {}
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    sized = VllmLauncher("/p", Path("/m"), ["--kv-cache-memory-bytes", "4194304"])
    assert sized.command("tcp://h:1")[1] == {}


def test_ready_response_is_checked_against_the_checked_release():
    launcher = VllmLauncher("/p", Path("/m"), checked_version="0.32.0")
    assert launcher.check_ready({"vllm_version": "0.32.0"}) is None
    assert "0.31.0" in launcher.check_ready({"vllm_version": "0.31.0"})


def test_finding_vllm(monkeypatch, tmp_path):
    monkeypatch.setenv("ENGINELINK_VLLM_PYTHON", "/x/python")
    monkeypatch.setenv("ENGINELINK_VLLM_VENV", "/v")
    assert default_vllm_python() == "/x/python"
    monkeypatch.delenv("ENGINELINK_VLLM_PYTHON")
    assert default_vllm_python() == "/v/bin/python"
    monkeypatch.delenv("ENGINELINK_VLLM_VENV")
    monkeypatch.setattr(side_venv, "CHECKOUT", tmp_path)  # a checkout without .venv-vllm
    monkeypatch.setattr(launch.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(launch.LauncherError, match="tools/setup-vllm"):
        default_vllm_python()
    monkeypatch.setattr(launch.importlib.util, "find_spec", lambda name: object())
    assert default_vllm_python() == sys.executable


def test_flag_value_reads_both_spellings():
    assert flag_value(["--served-model-name", "a", "b"], "--served-model-name") == "a"
    assert flag_value(["--served-model-name=x"], "--served-model-name") == "x"
    assert flag_value(["--served-model-name"], "--served-model-name") is None
    assert flag_value([], "--x") is None


def test_credentials_are_redacted_and_nothing_else():
    argv = ["--hf-token", "hf_abc", "--api-key=sk-1", "--hf-token", "--enforce-eager",
            "--max-num-batched-tokens", "2048", "--tokenizer", "/m", "--skip-tokenizer-init", "--x",
            "--kv-transfer-config", '{"kv_connector":"C","extra":{"auth_token":"t0k","url":"http://u:pw@h:1/p"}}',
            "--model=s3://id:secret@bucket/model"]
    assert redact_args(argv) == [
        "--hf-token", "<redacted>", "--api-key=<redacted>", "--hf-token", "--enforce-eager",
        "--max-num-batched-tokens", "2048", "--tokenizer", "/m", "--skip-tokenizer-init", "--x",
        "--kv-transfer-config", '{"kv_connector":"C","extra":{"auth_token":"<redacted>","url":"http://u:<redacted>@h:1/p"}}',
        "--model=s3://id:<redacted>@bucket/model",
    ]
