"""Fixtures of the real-engine suite: vLLM 0.32 on CPU, started by the tests.

Every engine here is ``enginelink serve --engine vllm`` over the tiny test
model, with a short context (``--max-model-len 1024``: long requests last
seconds, short ones milliseconds) and ``--enforce-eager``
so a start costs ~20 s on 2 cores. One servicer serves the whole session's
generation, abort and router tests (``vllm_stack``); a second one, without
warm-up and with vLLM's own structured-outputs configuration, serves the
configured-backend and the KV-event tests (``vllm_quiet``); the lifecycle,
DP, PD, pooling and launcher tests start their own.
vLLM's offline ``LLM`` API runs beside it in a subprocess of the vLLM venv
(``offline_llm.py``) as the reference the outputs are compared with; it
loads while the servicer's engine starts.

Without a vLLM installation (tools/setup-vllm) these tests are skipped, unless
``ENGINELINK_REQUIRE_VLLM=1`` (tools/run-tests sets it), where that fails.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from enginelink.runtime.contracts.vllm.launch import default_vllm_python
from enginelink.runtime.engine.launchers import LauncherError
from tests.harness import ReferenceAnswers, Servicer, children, end_process, wait_until
from tests.vllm.vision_offline import build_vision_model, run_offline

# --max-logprobs -1: the logprobs tests ask for the whole vocabulary (vLLM's default is 20).
ENGINE_ARGS = ["--max-model-len", "1024", "--enforce-eager", "--max-logprobs", "-1"]
MAX_MODEL_LEN = 1024
START_TIMEOUT_S = 300.0
# vllm_quiet's --structured-outputs-config: the backend enginelink sends must be the configured
# one, and compact JSON (disable_any_whitespace) keeps a random-weight model from spending its
# tokens on the whitespace the default grammar allows between JSON tokens.
STRUCTURED_CONFIG = {"backend": "xgrammar", "disable_any_whitespace": True}
OFFLINE_SCRIPT = Path(__file__).with_name("offline_llm.py")


def vllm_python_or_skip() -> str:
    try:
        python = default_vllm_python()
    except LauncherError as error:
        python, reason = None, str(error)
    else:
        reason = f"{python} is missing"
    if python is None or not Path(python).exists():
        if os.environ.get("ENGINELINK_REQUIRE_VLLM") == "1":
            pytest.fail(f"vLLM is required here: {reason}")
        pytest.skip(f"no vLLM installation (run tools/setup-vllm): {reason}")
    return python


def vllm_servicer(tmp: Path, model_dir: Path, engine_args: list[str] | None = None,
                  env: dict[str, str] | None = None) -> Servicer:
    return Servicer(tmp, model_dir=model_dir, extra=["--engine", "vllm"],
                    engine_args=engine_args or ENGINE_ARGS, env=env)


class OfflineVllm:
    """vLLM's offline ``LLM`` in a subprocess: ``run(cases)`` answers them in order."""

    def __init__(self, python: str, model_dir: Path, log_path: Path, llm_kwargs: dict | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        kwargs = {"max_model_len": MAX_MODEL_LEN, "enforce_eager": True, "max_logprobs": -1, **(llm_kwargs or {})}
        self.process = subprocess.Popen(
            [python, str(OFFLINE_SCRIPT), str(model_dir), json.dumps(kwargs)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")},
        )
        self._answers = ReferenceAnswers(self.process, "offline vLLM", log_path)

    def run(self, cases: list[dict], timeout_s: float = 120.0) -> dict[str, list[dict]]:
        """{case id: outputs} for cases {"id", "prompt_token_ids", "sampling"}."""
        answers = self.answers(cases, timeout_s)
        return {case_id: answer["outputs"] for case_id, answer in answers.items()}

    def answers(self, cases: list[dict], timeout_s: float = 120.0) -> dict[str, dict]:
        """{case id: the whole answer} ("prompt_tokens", "outputs"; or "error" where vLLM refused it)."""
        return self._answers.ask(self.process.stdin, cases, START_TIMEOUT_S, timeout_s)

    def close(self) -> None:
        end_process(self.process, self.process.stdin.close)  # end of input: the script exits
        self._log.close()


@pytest.fixture(scope="session")
def vllm_python() -> str:
    return vllm_python_or_skip()


@pytest.fixture(scope="session")
def vllm_stack(tmp_path_factory, test_model_dir, vllm_python):
    """(servicer, offline vLLM): one real engine behind enginelink, one on its own."""
    tmp = tmp_path_factory.mktemp("vllm")
    offline = OfflineVllm(vllm_python, test_model_dir, tmp / "offline-llm.log")
    # A short drain: the session's end has nothing in flight to wait for.
    # fast warm-up: tests/vllm/test_vllm_warmup.py checks what it did.
    # Placement on: tests/vllm/test_vllm_admin.py checks it against the real Worker's binding.
    servicer = vllm_servicer(tmp, test_model_dir, env={"ENGINELINK_DRAIN_SECS": "0.5", "ENGINELINK_WARMUP": "fast",
                                                       "ENGINELINK_PLACEMENT": "auto"})
    try:
        servicer.start(timeout_s=START_TIMEOUT_S)
        yield servicer, offline
    finally:
        servicer.stop()
        offline.close()


@pytest.fixture(scope="session")
def vllm_quiet(tmp_path_factory, test_model_dir, vllm_python):
    """A second engine behind enginelink: no warm-up (its KV history holds only the tests' batches,
    from batch 0), vLLM's own --structured-outputs-config (STRUCTURED_CONFIG). One engine start
    for tests/vllm/test_vllm_constraints.py's configured backend and test_vllm_kv_events.py."""
    servicer = vllm_servicer(tmp_path_factory.mktemp("vllm-quiet"), test_model_dir,
                             engine_args=[*ENGINE_ARGS, "--structured-outputs-config", json.dumps(STRUCTURED_CONFIG)],
                             env={"ENGINELINK_DRAIN_SECS": "0.5", "ENGINELINK_WARMUP": "off"})
    try:
        servicer.start(timeout_s=START_TIMEOUT_S)
        yield servicer
    finally:
        servicer.stop()


@pytest.fixture(scope="session")
def vision_model(tmp_path_factory, vllm_python):
    """The vision test model (BLIP-2), built twice and compared: the image modules' one build."""
    return build_vision_model(tmp_path_factory.mktemp("vision-model"), vllm_python)


@pytest.fixture(scope="session")
def vision_offline(vision_model, vllm_python):
    """vLLM offline on the vision model and two images: the image modules' one reference run."""
    return run_offline(vision_model, vllm_python)


def engine_core_pid(launcher: int) -> int:
    """The EngineCore process: the launcher's child that runs vLLM's engine (spawned by multiprocessing)."""

    def find():
        for pid in children(launcher):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    cmdline = fh.read()
            except OSError:
                continue
            if b"spawn_main" in cmdline or b"EngineCore" in cmdline:
                return pid
        return None

    return wait_until(find, 5, "the EngineCore process")
