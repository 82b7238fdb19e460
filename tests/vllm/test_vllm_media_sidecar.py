"""``--mm-processor redis`` on a real vLLM 0.32 engine, beside a real Redis, both ways with the reference.

One enginelink servicer on the vision test model (``enginelink make-test-model
--vision``) under ``--mm-processor redis``, one private redis-server
(``tests/redis_server.py``), and in turn:

1. enginelink's sidecar (``enginelink media-sidecar``, its own process with the
   real processor helper): the worker advertises ``mm_processor=redis`` once
   the sidecar's hello is there; images by ``data:`` and ``http`` URL give vLLM
   offline's tokens, and so does a chat through the real SMG router 1.13.0
   under ``--mm-processing worker``;
2. its lifecycle: SIGTERM ends it (exit 0) with its helper, and the worker
   stops advertising when its hello lapses; Redis killed mid-job is
   UNAVAILABLE at once through gRPC, and the worker recovers when Redis returns;
3. the reference's sidecar (smg-grpc-servicer 0.14.1,
   ``python -m smg_grpc_servicer.vllm.mm_sidecar``) serves this enginelink
   worker: the same tokens;
4. enginelink's sidecar serves the reference's worker side (its
   ``RedisMediaProcessor``, driven in the reference's venv): the same
   expanded prompt and, after its cast to the model's dtype, the very pixels
   vLLM's offline processor makes.

The reference's venv is ``tools/setup-bench-refs``' (``.venv-bench-refs``, which
run-tests builds); without it the interop tests skip, unless
``ENGINELINK_REQUIRE_BENCH_REFS=1``.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from tokenizers import Tokenizer

from enginelink.tools import bench_refs
from enginelink.tools.test_vision_model import NUM_QUERY_TOKENS
from enginelink.wire import mm_sidecar as wire
from tests.adversarial.media_origin import Origin
from tests.harness import VENV_BIN, Router, Servicer, children, free_port, wait_until
from tests.redis_server import RedisServer
from tests.router.openai_http import post
from tests.vllm.conftest import START_TIMEOUT_S
from tests.vllm.test_vllm_vision import _media_request
from tests.vllm.vision_offline import MAX_TOKENS, PROMPT

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ENGINE_ARGS = ["--max-model-len", "512", "--enforce-eager"]
SIDECAR_START_S = 300.0

REFERENCE_WORKER = r"""
import asyncio, base64, json, sys
import torch
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from smg_grpc_servicer.vllm.media_refs import MediaRefItem
from smg_grpc_servicer.vllm.mm_processor import RedisMediaProcessor, engine_fingerprint

class Engine:  # what RedisMediaProcessor reads of vLLM's AsyncLLM: its model config
    def __init__(self, model_config):
        self.model_config = model_config

async def main(model, redis_url, engine_args, prompt, url):
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    config = AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", model, *engine_args])).create_model_config()
    engine = Engine(config)
    processor = RedisMediaProcessor(engine, engine_fingerprint(engine), redis_url=redis_url, timeout_ms=120000)
    for _ in range(100):
        if await processor.probe():
            break
        await asyncio.sleep(0.5)
    else:
        raise SystemExit("the reference's worker never saw a sidecar hello with its fingerprint")
    out = await processor.process(prompt, None, [MediaRefItem("image", url)], 0.0, request_id="interop")
    [item] = out["mm_kwargs"]["image"]
    pixels = item["pixel_values"].data
    [place] = out["mm_placeholders"]["image"]
    print("RESULT " + json.dumps({
        "advertised": True, "schemes": processor.schemes, "prompt_token_ids": list(out["prompt_token_ids"]),
        "placeholder": [place.offset, place.length], "dtype": str(pixels.dtype), "shape": list(pixels.shape),
        "pixels": base64.b64encode(pixels.contiguous().view(torch.int16).numpy().tobytes()).decode()}))

asyncio.run(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5]))
"""


def _ref_python() -> str:
    try:
        return str(bench_refs.refs_python())
    except RuntimeError as missing:
        if os.environ.get("ENGINELINK_REQUIRE_BENCH_REFS") == "1":
            pytest.fail(f"the reference's venv is required here: {missing}")
        pytest.skip(f"no reference venv for the sidecar interop: {missing}")


class SidecarProcess:
    """A sidecar in its own process (ours or the reference's), its output in a log file."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **env})  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()
        return self.process.returncode


@pytest.fixture(scope="module")
def offline(vision_offline):
    return vision_offline


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def origin():
    with Origin() as running:
        yield running


@pytest.fixture(scope="module")
def servicer(vision_model, offline, origin, redis, tmp_path_factory):
    metrics_port = free_port()
    running = Servicer(tmp_path_factory.mktemp("redis-worker"), model_dir=vision_model,
                       extra=["--engine", "vllm", "--metrics-port", str(metrics_port), "--mm-processor", "redis",
                              "--mm-redis-url", redis.url, "--mm-sidecar-timeout-ms", "60000"],
                       engine_args=ENGINE_ARGS,
                       env={"ENGINELINK_WARMUP": "off", "ENGINELINK_DRAIN_SECS": "0.5"})  # fmt: skip
    running.metrics_port = metrics_port
    for index, case in enumerate(offline):
        origin.routes[f"/image-{index}.png"] = (200, {"Content-Type": "image/png"}, base64.b64decode(case["png"]))
    running.start(timeout_s=START_TIMEOUT_S)
    try:
        yield running
    finally:
        running.stop()


def _ours(vision_model, redis, tmp_path, name="sidecar") -> SidecarProcess:
    return SidecarProcess([str(VENV_BIN / "enginelink"), "media-sidecar", "--model", str(vision_model),
                           "--redis-url", redis.url, "--", *ENGINE_ARGS], tmp_path / f"{name}.log",
                          {"SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS": "1"})  # fmt: skip


def _info(servicer) -> pb.GetServerInfoResponse:
    return servicer.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


def _advertised(servicer, sidecar: SidecarProcess, timeout_s: float = SIDECAR_START_S,
                ready_words: str = "media sidecar serving under") -> None:
    """This sidecar serving (its log says so) and the worker advertising (a hello with its fingerprint)."""
    deadline = time.monotonic() + timeout_s
    while ready_words not in sidecar.log() or _info(servicer).mm_processor != "redis":
        assert sidecar.process.poll() is None, sidecar.log()[-4000:]
        assert time.monotonic() < deadline, (sidecar.log()[-3000:], servicer.log()[-3000:])
        time.sleep(0.5)


def _tokens_equal_offline(servicer, offline, origin, tag: str, kinds=("data", "http")) -> None:
    for index, case in enumerate(offline):
        urls = {"data": "data:image/png;base64," + case["png"], "http": origin.url(f"/image-{index}.png")}
        for kind in kinds:
            replies = list(servicer.stub.Generate(_media_request(case, f"{tag}-{kind}-{index}", urls[kind]),
                                                  timeout=300))  # fmt: skip
            assert list(replies[-1].complete.output_ids) == case["output_ids"], (tag, kind, servicer.log()[-3000:])
            assert replies[-1].complete.prompt_tokens == len(case["prompt_ids"])
            print(f"{tag} {kind} image {index}: output_ids={case['output_ids']} (vLLM offline's)")


def test_enginelinks_sidecar_serves_the_worker_as_vllm_offline_and_behind_the_router(
        servicer, offline, origin, vision_model, redis, tmp_path):  # fmt: skip
    assert offline[0]["output_ids"] != offline[1]["output_ids"]  # the image matters to this model
    assert _info(servicer).mm_processor == ""  # no sidecar yet: not advertised
    sidecar = _ours(vision_model, redis, tmp_path)
    try:
        _advertised(servicer, sidecar)
        info = _info(servicer)
        assert (info.mm_processor, info.mm_processor_source, info.mm_media_ref_schemes) == ("redis", "flag",
                                                                                           "http,https,data")
        _tokens_equal_offline(servicer, offline, origin, "ours")
        tokenizer = Tokenizer.from_file(str(vision_model / "tokenizer.json"))
        router = Router(tmp_path, servicer.port, vision_model, extra=["--mm-processing", "worker"]).start(timeout_s=60)
        try:
            for index, case in enumerate(offline):
                status, body = post(router.url, "/v1/chat/completions", {
                    "model": vision_model.name, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "messages": [{"role": "user", "content": [
                        {"type": "text", "text": PROMPT},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + case["png"]}}]}],
                })  # fmt: skip
                assert status == 200, (body, router.log()[-3000:])
                assert body["choices"][0]["message"]["content"] == tokenizer.decode(case["chat_output_ids"],
                                                                                   skip_special_tokens=True)
                assert body["usage"]["prompt_tokens"] == len(case["chat_prompt_ids"])
                print(f"router e2e via the redis sidecar, image {index}: "
                      f"{body['choices'][0]['message']['content']!r} usage={body['usage']}")
        finally:
            router.stop()
        assert "media sidecar serving under smg:mm:v1:" in sidecar.log()
    finally:
        sidecar.stop()


def test_the_sidecar_stops_on_sigterm_and_redis_killed_mid_job_is_unavailable_at_once(
        servicer, offline, vision_model, redis, tmp_path):  # fmt: skip
    redis.client().delete(*redis.client().keys("smg:mm:v1:*") or ["none"])  # the last sidecar's hello, gone
    wait_until(lambda: _info(servicer).mm_processor == "", 10, "the advertising to stop with the hello")
    sidecar = _ours(vision_model, redis, tmp_path, "lifecycle")
    try:
        _advertised(servicer, sidecar)
        helpers = children(sidecar.process.pid)
        assert helpers, "the processor helper runs under the sidecar"
    finally:
        started = time.monotonic()
        status = sidecar.stop()  # SIGTERM (a kill only past 30 s)
    assert status == 0 and time.monotonic() - started < 15, sidecar.log()[-3000:]
    wait_until(lambda: all(not os.path.exists(f"/proc/{pid}") or
                           open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
                           for pid in helpers), 15, "the helper to end with its sidecar")  # fmt: skip
    # Its hello lapses (no sidecar refreshes it): the worker stops advertising.
    wait_until(lambda: _info(servicer).mm_processor == "", wire.HELLO_TTL_S + 10, "the advertising to stop")

    # A job no sidecar takes sits in the queue; Redis killed under the waiting worker: UNAVAILABLE at once.
    outcome = {}

    def request():
        started = time.monotonic()
        try:
            list(servicer.stub.Generate(_media_request(offline[0], "redis-killed", "data:image/png;base64,"
                                                       + offline[0]["png"]), timeout=120))  # fmt: skip
        except grpc.RpcError as error:
            outcome["error"], outcome["waited"] = error, time.monotonic() - started

    thread = threading.Thread(target=request)
    thread.start()
    wait_until(lambda: any(redis.client().llen(key) for key in redis.client().keys("smg:mm:v1:*:jobs")), 30,
               "the job to be queued")
    killed_at = time.monotonic()
    redis.kill()
    thread.join(30)
    assert outcome["error"].code() == grpc.StatusCode.UNAVAILABLE, outcome["error"].details()
    assert "sidecar_unavailable" in outcome["error"].details()
    assert time.monotonic() - killed_at < 5, "UNAVAILABLE at once, not at the 60 s sidecar timeout"
    redis.start()  # Redis returns, empty


def test_the_references_sidecar_serves_this_worker(servicer, offline, origin, vision_model, redis, tmp_path):
    python = _ref_python()
    sidecar = SidecarProcess([python, "-m", "smg_grpc_servicer.vllm.mm_sidecar", "--model", str(vision_model),
                              "--redis-url", redis.url, *ENGINE_ARGS], tmp_path / "reference-sidecar.log",
                             {"SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS": "1"})  # fmt: skip
    try:
        # Its fingerprint is this worker's: the same namespace, the same hello.
        _advertised(servicer, sidecar, ready_words="media sidecar serving under")
        hello = {k.decode(): v.decode() for k, v in redis.client().hgetall(next(iter(
            redis.client().keys("smg:mm:v1:*:hello")))).items()}
        assert "implementation" not in hello  # the reference's hello, not ours
        _tokens_equal_offline(servicer, offline, origin, "reference-sidecar", kinds=("data",))
    finally:
        sidecar.stop()


def test_enginelinks_sidecar_serves_the_references_worker(offline, vision_model, redis, tmp_path, servicer):
    python = _ref_python()
    redis.client().delete(*redis.client().keys("smg:mm:v1:*") or ["none"])  # the reference's hello, gone
    sidecar = _ours(vision_model, redis, tmp_path, "for-the-reference")
    try:
        case = offline[0]
        done = subprocess.run([python, "-c", REFERENCE_WORKER, str(vision_model), redis.url, json.dumps(ENGINE_ARGS),
                               json.dumps(case["prompt_ids"][NUM_QUERY_TOKENS:]),
                               "data:image/png;base64," + case["png"]], capture_output=True, timeout=600)  # fmt: skip
        lines = [line for line in done.stdout.decode().splitlines() if line.startswith("RESULT ")]
        assert done.returncode == 0 and lines, (done.stderr.decode()[-4000:], sidecar.log()[-3000:])
        result = json.loads(lines[-1][len("RESULT "):])
        assert result["prompt_token_ids"] == case["prompt_ids"]  # the placeholders expanded by our sidecar
        assert result["placeholder"] == [0, NUM_QUERY_TOKENS]
        assert (result["dtype"], result["shape"]) == ("torch.bfloat16", case["shape"][1:])
        assert result["pixels"] == case["pixels"]  # the very pixels of vLLM's own processor, in the model's dtype
        print(f"the reference's worker through enginelink's sidecar: prompt {len(result['prompt_token_ids'])} "
              f"tokens, pixels {result['shape']} {result['dtype']} equal to vLLM offline's")
    finally:
        assert sidecar.stop() == 0
