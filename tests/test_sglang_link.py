"""The link's SGLang start-up: readiness is one JSON line on an inherited fd, not a handshake.

A stand-in engine process (a few lines of Python) gets the fd the link passes
and says what a scheduler launcher might: a ready report, another status,
garbage, or nothing before it exits. What is asserted is what the servicer
would act on: the link up with the report's facts, or failed saying why
(journaled as the engine's fault).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

import pytest
import trio

from enginelink.runtime.engine.engine_link import EngineLink, LinkFailed, Supervision
from enginelink.runtime.engine.launchers import redact_args
from enginelink.runtime.engine.sglang_link import SglangTransport
from enginelink.wire import codecs
from tests.harness import ListJournal

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)


@dataclass
class FakeScheduler:
    """Writes ``line`` (if any) to the ready fd, then lives on (``stay``) or exits 3."""

    line: str | None
    stay: bool = True
    engine: str = "sglang"
    seen: dict = field(default_factory=dict)
    connect: bool = True  # connect a PULL to the input socket before the report, as a scheduler does

    def scheduler_command(self, input_address: str, output_address: str, ready_fd: int):
        self.seen = {"inputs": input_address, "outputs": output_address, "fd": ready_fd}
        code = ["import os, sys, time"]
        if self.connect:
            code.append(f"import zmq; pull = zmq.Context().socket(zmq.PULL); pull.connect({input_address!r})")
        if self.line is not None:
            code.append(f"os.write({ready_fd}, {self.line.encode()!r})")
        code.append("time.sleep(60)" if self.stay else "sys.exit(3)")
        return [sys.executable, "-c", "; ".join(code)], {}

    def redacted(self, argv):
        return redact_args(argv)


async def _start(launcher, monkeypatch, socket_dir):
    monkeypatch.setenv("SMG_ZMQ_SOCKET_DIR", str(socket_dir))
    link = EngineLink(name="sglang-0", launcher=launcher, codec=codecs.get("sglang"), journal=ListJournal(),
                      supervision=Supervision(startup_timeout_s=20, stop_grace_s=2),
                      transport=SglangTransport(launcher, max_model_len=4096))
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            try:
                await nursery.start(link.run)
            except LinkFailed as error:
                return link, error
            nursery.cancel_scope.cancel()
    return link, None


async def test_a_ready_report_brings_the_link_up_with_its_facts(monkeypatch, socket_dir):
    report = {"status": "ready", "max_total_num_tokens": 65536, "max_req_input_len": 2047,
              "max_running_requests": 48, "chunked_prefill_size": 512}
    launcher = FakeScheduler(json.dumps(report) + "\n")
    link, error = await _start(launcher, monkeypatch, socket_dir)
    assert error is None
    assert launcher.seen["inputs"].startswith(f"ipc://{socket_dir}/") and launcher.seen["fd"] > 2
    assert {k: link.ready[k] for k in ("max_model_len", "max_num_seqs", "max_num_batched_tokens",
                                       "max_total_num_tokens")} == {
        "max_model_len": 2048, "max_num_seqs": 48, "max_num_batched_tokens": 512, "max_total_num_tokens": 65536}
    steps = [p["step"] for _, _, kind, p in link.journal.records if kind == "engine.handshake"]
    assert steps[0] == "launch" and "ready" in steps
    assert list(socket_dir.iterdir()) == []  # its sockets are gone with it


async def test_a_ready_report_without_the_input_connection_fails_the_start_saying_so(monkeypatch, socket_dir):
    # A request sent before the scheduler's PULL connected fails with EAGAIN (seen as a restart's re-sent
    # requests failing at once): the start waits for the connection, and says so when it never comes.
    monkeypatch.setattr("enginelink.runtime.engine.sglang_link.CONNECT_TIMEOUT_S", 0.5)
    launcher = FakeScheduler(json.dumps({"status": "ready", "max_total_num_tokens": 65536}) + "\n", connect=False)
    link, error = await _start(launcher, monkeypatch, socket_dir)
    assert error is not None and "did not connect to its input socket within 0.5 s" in str(error)


@pytest.mark.parametrize("line, stay, said", [
    ('{"status": "error", "error": "CUDA out of memory"}\n', True,
     "the engine reported {'status': 'error', 'error': 'CUDA out of memory'} instead of ready"),
    ("Traceback (most recent call last)\n", True, "the engine's ready report is not JSON"),
    (None, False, None),  # exits without a word: the pipe closes, or the exit is seen first
])  # fmt: skip
async def test_anything_but_a_ready_report_fails_the_start_saying_why(monkeypatch, socket_dir, line, stay, said):
    link, error = await _start(FakeScheduler(line, stay), monkeypatch, socket_dir)
    assert isinstance(error, LinkFailed) and not link.ready
    if said is not None:
        assert said in str(error)
    else:
        assert ("closed its ready pipe without reporting ready" in str(error)
                or "exited with status 3" in str(error)), error
    errors = [p for _, _, kind, p in link.journal.records if kind == "error"]
    assert len(errors) == 1 and errors[0]["whose"] == "engine"
    assert link.machine.state.value == "failed"
