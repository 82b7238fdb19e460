"""Fixtures of the MLX real-engine suite: mlx-lm 0.31.3 on CPU, started by the tests.

Every engine here is ``enginelink serve --engine mlx`` over the tiny test
model (mlx-lm loads it as it is). One servicer serves the session's
generation, refusal and router tests; the lifecycle tests start their own.
mlx-lm on its own runs beside it in a subprocess of the MLX venv
(``offline_mlx.py``) as the reference the outputs are compared with.

Without an MLX installation (tools/setup-mlx) these tests are skipped, unless
``ENGINELINK_REQUIRE_MLX=1`` (tools/run-tests sets it), where that fails.
"""

from __future__ import annotations

import os
import subprocess
import threading
import urllib.request
from pathlib import Path

import pytest
from smg_grpc_proto.generated import mlx_engine_pb2 as mlx_pb, mlx_engine_pb2_grpc as mlx_grpc

from enginelink.runtime.engine.launchers import LauncherError
from enginelink.runtime.contracts.mlx.launch import default_mlx_python
from tests.harness import ReferenceAnswers, Servicer, end_process, free_port

MLX_SERVICE = "mlx.grpc.engine.MlxEngine"

START_TIMEOUT_S = 300.0
OFFLINE_SCRIPT = Path(__file__).with_name("offline_mlx.py")
# --max-logprobs -1: the logprobs tests ask past vLLM's default of 20.
ENGINE_ARGS = ["--max-logprobs", "-1"]
# Warm-up off: it is the shared code every engine runs (tests/test_warmup_driver.py); on a
# loaded 2-core box its 44 steps cost minutes at the engine's lower priority.
ENV = {"ENGINELINK_WARMUP": "off", "ENGINELINK_DRAIN_SECS": "0.5"}


def mlx_python_or_skip() -> str:
    try:
        python = default_mlx_python()
    except LauncherError as error:
        python, reason = None, str(error)
    else:
        reason = f"{python} is missing"
    if python is None or not Path(python).exists():
        if os.environ.get("ENGINELINK_REQUIRE_MLX") == "1":
            pytest.fail(f"MLX is required here: {reason}")
        pytest.skip(f"no MLX installation (run tools/setup-mlx): {reason}")
    return python


class MlxServicer(Servicer):
    """``enginelink serve --engine mlx``: it serves ``MlxEngine`` (health and ``stub`` are MLX's)."""

    stub_class = mlx_grpc.MlxEngineStub

    def __init__(self, tmp: Path, **kwargs) -> None:
        super().__init__(tmp, health_service=MLX_SERVICE, **kwargs)
        # MlxEngine has no GetLoads: the engine's own stats are read from /metrics.
        self.metrics_port = free_port()
        self.argv[2:2] = ["--metrics-port", str(self.metrics_port)]

    def engine_running(self) -> int:
        """Requests the engine's scheduler runs, from its last stats (``smg_servicer_dp_rank_running_requests``)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        (line,) = [x for x in text.splitlines() if x.startswith("smg_servicer_dp_rank_running_requests{")]
        return int(float(line.rsplit(" ", 1)[1]))


def mlx_servicer(tmp: Path, model_dir: Path, engine_args: list[str] | None = None,
                 env: dict[str, str] | None = None) -> MlxServicer:
    return MlxServicer(tmp, model_dir=model_dir, extra=["--engine", "mlx"],
                       engine_args=ENGINE_ARGS if engine_args is None else engine_args, env={**ENV, **(env or {})})


def mlx_request(request_id: str, input_ids: list[int], *, stream: bool = False, **sampling) -> mlx_pb.GenerateRequest:
    """An MLX ``GenerateRequest``: tokenized input, the sampling fields as given."""
    return mlx_pb.GenerateRequest(request_id=request_id, tokenized=mlx_pb.TokenizedInput(input_ids=input_ids),
                                  sampling_params=mlx_pb.SamplingParams(**sampling), stream=stream)


class OfflineMlx:
    """mlx-lm's own greedy generation in a subprocess: ``run(cases)`` answers them in order."""

    def __init__(self, python: str, model_dir: Path, log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen([python, str(OFFLINE_SCRIPT), str(model_dir)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self._log, text=True)  # fmt: skip
        self._answers = ReferenceAnswers(self.process, "offline mlx-lm", log_path)

    def run(self, cases: list[dict], timeout_s: float = 120.0) -> dict[str, dict]:
        """{case id: {"token_ids", "finish_reason", "logprobs"}} for cases {"id", "prompt_token_ids", "max_tokens"}."""
        return self._answers.ask(self.process.stdin, cases, START_TIMEOUT_S, timeout_s)

    def close(self) -> None:
        end_process(self.process, self.process.stdin.close)
        self._log.close()


@pytest.fixture(scope="session")
def mlx_python() -> str:
    return mlx_python_or_skip()


@pytest.fixture(scope="session")
def mlx_stack(tmp_path_factory, test_model_dir, mlx_python):
    """(servicer, offline mlx-lm): one MLX engine behind enginelink, one on its own."""
    tmp = tmp_path_factory.mktemp("mlx")
    offline = OfflineMlx(mlx_python, test_model_dir, tmp / "offline-mlx.log")
    servicer = mlx_servicer(tmp, test_model_dir)
    try:
        servicer.start(timeout_s=START_TIMEOUT_S)
        yield servicer, offline
    finally:
        servicer.stop()
        offline.close()
