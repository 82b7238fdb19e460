"""``enginelink headless`` on the real SMG router 1.13.0's SGLang ZMQ lane (issue 33 item 8).

``smg launch --worker-urls ipc://DIR/engine-N --backend sglang`` is the router
side of ``smg serve --backend sglang --connection-mode zmq``: it binds the
handshake port it derives from the URL and the two ipc data sockets, and
waits for the engine to dial. ``enginelink headless --engine sim --wire
sglang --zmq-handshake-address tcp://127.0.0.1:PORT`` dials it as the engine
(HELLO, INIT, READY, the ready response with its positional layouts) once
its own engine serves, and the router promotes the worker and routes to it.
What a client of the router sees, and what the servicer's journal holds
(``inspect``, ``journal verify``, ``journal replay`` on the headless run).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from smg.serve import _zmq_handshake_port

from enginelink.journal.store import open_reader
from tests.harness import VENV_BIN, Router, end_process, wait_until
from tests.router.openai_http import SSEStream, get, post, stream
from tests.router.test_router_e2e import COMPLETIONS, ok, streamed

pytestmark = pytest.mark.router

ENGINELINK = VENV_BIN / "enginelink"


class Headless:
    """``enginelink headless`` in a subprocess, dialling ``address``."""

    def __init__(self, tmp: Path, model_dir: Path, address: str, engine_args: list[str]) -> None:
        self.journal = tmp / "headless.sqlite"
        self.log_path = tmp / "headless.log"
        self.socket_dir = Path(tempfile.mkdtemp(prefix="el-sock-"))
        self.argv = [str(ENGINELINK), "headless", "--engine", "sim", "--wire", "sglang", "--model", str(model_dir),
                     "--journal", str(self.journal), "--zmq-handshake-address", address, "--", *engine_args]
        self.env = {"SMG_ZMQ_SOCKET_DIR": str(self.socket_dir), "XDG_STATE_HOME": str(tmp / "state"),
                    "ENGINELINK_WARMUP": "fast"}
        self.process: subprocess.Popen | None = None

    def start(self) -> "Headless":
        import os

        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **self.env})
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int | None:
        if self.process is None:
            return None
        end_process(self.process, lambda: self.process.send_signal(signal.SIGTERM))
        self._log.close()
        return self.process.returncode

    def records(self) -> list:
        with open_reader(self.journal) as reader:
            return list(reader.records())


def enginelink(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(ENGINELINK), *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def lane(tmp_path_factory, test_model_dir):
    tmp = tmp_path_factory.mktemp("router-headless")
    ipc_dir = Path(tempfile.mkdtemp(prefix="smg-"))  # short: ipc paths have a length limit
    ipc_dir.chmod(0o700)
    url = f"ipc://{ipc_dir}/engine-{int(time.time()) % 100000}"
    address = f"tcp://127.0.0.1:{_zmq_handshake_port(url)}"
    headless = Headless(tmp, test_model_dir, address, ["--step-us", "5000"]).start()
    router = Router(tmp, 0, test_model_dir)
    at = router.argv.index("--worker-urls")
    router.argv[at + 1] = url
    router.argv += ["--backend", "sglang"]
    router.worker_url = url
    try:
        router.start(timeout_s=60)
    except BaseException:
        headless.stop()
        raise
    yield router, headless, str(test_model_dir)  # a ZMQ worker's model id is the router's --model-path
    router.stop()
    headless.stop()


def test_the_router_registers_enginelink_as_its_sglang_engine(lane):
    router, headless, model = lane
    wait_until(lambda: "Promoted worker on connect signal" in router.log(), 10, "the router's promotion line")
    assert f"registered with the router at {headless.argv[headless.argv.index('--zmq-handshake-address') + 1]}" \
        in headless.log()
    status, workers = get(router.url, "/workers")
    assert status == 200 and [w["url"] for w in workers["workers"]] == [router.worker_url]


@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "stream"])
def test_completions_through_the_lane(lane, streaming):
    router, _, model = lane
    body = {"model": model, "prompt": "def foo(x):", "max_tokens": 9, "ignore_eos": True, "temperature": 0}
    if streaming:
        chunks, _ = streamed(stream(router.url, COMPLETIONS, {**body, "stream": True}))
        text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
        assert [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1] == "length"
    else:
        reply = ok(post(router.url, COMPLETIONS, body))
        assert reply["usage"]["completion_tokens"] == 9 and reply["choices"][0]["finish_reason"] == "length"
        text = reply["choices"][0]["text"]
    assert text
    # Greedy: the same text either way (the sim's tokens depend on the prompt alone).
    again = ok(post(router.url, COMPLETIONS, body))["choices"][0]["text"]
    assert again == text


def test_n_2_is_two_lane_requests_and_a_refusal_is_the_routers_error(lane):
    router, headless, model = lane
    reply = ok(post(router.url, COMPLETIONS, {"model": model, "prompt": "x", "max_tokens": 4, "n": 2,
                                             "ignore_eos": True}))
    assert len(reply["choices"]) == 2 and reply["usage"]["completion_tokens"] == 8
    # A prompt that leaves no room in the context: the servicer refuses it, the lane answers a terminal abort.
    status, body = post(router.url, COMPLETIONS, {"model": model, "prompt": "word " * 3000, "max_tokens": 4})
    assert status >= 400 and "no room for output" in json.dumps(body), (status, body)


def test_a_client_gone_is_the_routers_abort_and_the_journal_holds_the_run(lane):
    router, headless, model = lane
    with SSEStream(router.url, COMPLETIONS, {"model": model, "prompt": "long", "max_tokens": 600,
                                             "ignore_eos": True}) as events:
        for count, _ in enumerate(events.data()):
            if count == 3:
                break
    def aborted() -> bool:
        return any(r.kind == "client.abort" and r.payload["reason"] == "abort_rpc" for r in headless.records())
    wait_until(aborted, 15, "the router's ABORT reaching the hub")
    kinds = {r.kind for r in headless.records()}
    assert {"router.handshake", "router.frame", "client.generate", "engine.request", "client.sent"} <= kinds
    shown = enginelink("inspect", "--journal", str(headless.journal))
    assert shown.returncode == 0, shown.stderr
    address = headless.argv[headless.argv.index("--zmq-handshake-address") + 1]
    assert re.search(rf"router-0 +registered .* router {re.escape(address)}", shown.stdout), shown.stdout
    verified = enginelink("journal", "verify", "--journal", str(headless.journal))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    replayed = enginelink("journal", "replay", "--journal", str(headless.journal))
    assert replayed.returncode == 0 and "router-0" in replayed.stdout, replayed.stdout + replayed.stderr


def test_stopping_tells_the_router_the_engine_is_dead(lane):
    """SIGTERM: the servicer drains, closes its router link and sends ENGINE_CORE_DEAD; the router evicts
    the dead client at once and fails requests fast (without it, a stopped engine stays "ready" and
    requests fail with broken pipes until the health probes catch up: ``reference/router-harness.md`` §6.4)."""
    router, headless, model = lane
    assert headless.stop() == 0
    wait_until(lambda: "received ENGINE_CORE_DEAD sentinel from engine" in router.log(), 5, "the router's line")
    started = time.monotonic()
    status, body = post(router.url, COMPLETIONS, {"model": model, "prompt": "x", "max_tokens": 2}, timeout_s=10)
    assert status >= 500 and time.monotonic() - started < 5, (status, body)
    records = headless.records()
    steps = [r for r in records if r.kind == "transition" and r.payload["machine"] == "router"]
    assert [(t.payload["source"], t.payload["dest"]) for t in steps] == [
        ("waiting", "dialing"), ("dialing", "registered"), ("registered", "closed")]
