"""Engine restarts on the real vLLM engine (CPU): streams that outlive their EngineCore (docs/resume.md).

One servicer with ``--engine-restarts 1``. Four greedy streams of 2,000
tokens (the tiny model's context is 2,048: its longest) run once
uninterrupted, for reference; then again, and the EngineCore is SIGKILLed
under them: the servicer starts the engine again with the same arguments,
re-submits each stream as its prompt plus the tokens it had, and each
completes with its full count, equal to the uninterrupted run token for
token. ``enginelink inspect`` during the restart shows the link restarting
and the four streams held; the journal afterwards the crash, the restart and
each resumption. Then the budget: a second kill (one restart per window)
stops the restarts: every stream fails naming the cause, exit 1.

Set ``ENGINELINK_RESUME_EVIDENCE=DIR`` to keep the inspect view and the
journal's story in DIR (what docs/resume.md and the issue quote).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest

from enginelink.journal import records as r
from enginelink.journal.store import open_reader
from enginelink.tools.inspect import render_view
from tests.harness import (
    VENV_BIN, Servicer, engine_pid, free_port, generate_request, scrape, wait_not_serving, wait_until,
)
from tests.test_lifecycle import StreamReader
from tests.vllm.conftest import START_TIMEOUT_S, StoppedEngine, engine_core_pid

pytestmark = pytest.mark.vllm

ENGINE_ARGS = ["--max-model-len", "2048", "--enforce-eager"]
# Each stream is killed once every one is KILL_AT tokens in, and runs to TOKENS: hundreds re-prefilled and
# hundreds generated after the restart, which is what the equality with an uninterrupted run checks. (The
# kill was once timed on what the client had read, which lagged the servicer by up to 1,100 tokens; the
# bursts below time it on the servicer's own count.)
TOKENS = 2000
KILL_AT = 300
# The EngineCore runs BURST_S at a time. A view after a stop can still miss tokens: what the engine's
# output thread had not sent (it stops with the process) and, on a loaded box, what the servicer had not
# read or journaled yet (InspectWatch.stable_view waits for two views that agree); at a load of 8 a kill
# meant for 300 tokens once came at 990 with bursts that grew while nothing showed, and at 658 with these
# fixed ones. So the bursts stay short and fixed, and the streams keep the length CI has run them at
# (1,000-token streams took ~80 s against ~165 s on a quiet box, but left too little room under load).
BURST_S = 0.2
PROMPTS = [[318, 283, 1552, 10, 90, 305], [40, 1079, 257, 1332, 13, 198], [464, 2068, 758, 2183, 1804, 625],
           [2061, 318, 262, 3139, 286, 1204]]  # the test model's vocabulary is 4096


def _stream(stub, request_id: str, prompt: list[int]) -> StreamReader:
    reader = StreamReader(stub, generate_request(request_id, prompt, stream=True, temperature=0.0, max_tokens=TOKENS,
                                                 ignore_eos=True))
    reader.start()
    return reader


def _tokens(reader: StreamReader) -> list[int]:
    return [t for m in reader.messages if m.HasField("chunk") for t in m.chunk.token_ids]


def _cli(*argv: str) -> str:
    return subprocess.run([str(VENV_BIN / "enginelink"), *argv], capture_output=True, text=True, timeout=60).stdout


class InspectWatch:
    """``enginelink inspect --watch --json`` running as a user leaves it beside the servicer: one process
    refreshing its view from the journal (the servicer's own count of each stream's tokens), started before
    the kills; a view during the restart needs no fresh interpreter's start-up (over 10 s at a CI load)."""

    def __init__(self, journal: Path, every_s: float = 0.5) -> None:
        self.process = subprocess.Popen([str(VENV_BIN / "enginelink"), "inspect", "--journal", str(journal),
                                         "--watch", str(every_s), "--json"], stdout=subprocess.PIPE, text=True)
        self.views: list[dict] = []
        self.arrived: list[float] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.views.append(json.loads(line))
            self.arrived.append(time.monotonic())

    def request(self, request_id: str, view: dict | None = None) -> dict | None:
        """The request in flight as ``view`` (the latest) shows it (admitted: sent to the engine)."""
        view = view or (self.views[-1] if self.views else {"requests": []})
        return next((q for q in view["requests"] if q["id"] == request_id), None)

    def settled_view(self) -> dict:
        """A view read wholly after now + 0.5 s: with the engine stopped, what the servicer had by then."""
        since = time.monotonic() + 0.5
        wait_until(lambda: sum(at > since for at in self.arrived) >= 2, 120, "two inspect views after a stop")
        return self.views[-1]

    def stable_view(self, request_ids: list[str]) -> dict:
        """A settled view whose token counts the next settled view repeats: with the engine stopped, the
        servicer has read what it had sent (on a loaded box the servicer lagged a view by hundreds of
        tokens, and bursts sized on that undercount ran the streams on)."""
        def counts(view: dict) -> list:
            return [(q or {}).get("tokens") for q in (self.request(i, view) for i in request_ids)]

        def stable() -> dict | None:
            first = self.settled_view()
            second = self.settled_view()
            return second if counts(first) == counts(second) else None

        return wait_until(stable, 120, "two inspect views with the same token counts after a stop")

    def rendered_showing(self, text: str) -> str | None:
        """The first view, as ``inspect`` prints it, with ``text`` in it."""
        return next((shown for view in list(self.views) if text in (shown := render_view(view))), None)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def _state(pid: int) -> str:
    """The process's state letter (/proc): "T" while stopped."""
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def _keep(name: str, text: str) -> None:
    where = os.environ.get("ENGINELINK_RESUME_EVIDENCE")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        (Path(where) / name).write_text(text)


def test_engine_core_killed_under_four_greedy_streams_each_completes_equal_to_an_uninterrupted_run(
        tmp_path, test_model_dir, vllm_python):
    metrics_port = free_port()
    servicer = Servicer(tmp_path, model_dir=test_model_dir, engine_args=ENGINE_ARGS,
                        extra=["--engine", "vllm", "--metrics-port", str(metrics_port), "--engine-restarts", "1",
                               "--resume-timeout", "300"],
                        env={"ENGINELINK_WARMUP": "off"}).start(timeout_s=START_TIMEOUT_S)
    watch: InspectWatch | None = None
    engine: StoppedEngine | None = None
    try:
        # Uninterrupted, for reference.
        reference = [_stream(servicer.stub, f"ref-{i}", prompt) for i, prompt in enumerate(PROMPTS)]
        for reader in reference:
            reader.join(300)
            assert reader.error is None and len(_tokens(reader)) == TOKENS, reader.error
        # Again, and the EngineCore killed under the four once each is a few hundred tokens in.
        launcher = engine_pid(servicer.journal)
        watch = InspectWatch(servicer.journal)
        wait_until(lambda: watch.views, 120, "inspect --watch's first view")
        # The engine (its EngineCore and its Worker: with only the EngineCore stopped, twice in full runs the
        # four streams' 2,000 tokens were all there at the first burst) runs in short bursts between stops,
        # and each stop is read in a view taken after it: the kill lands with every stream a few hundred tokens
        # in, however fast the engine or slow this box (timed on what the client had read, it once came 1,100
        # tokens late: the client lagged the servicer).
        engine = StoppedEngine(launcher)
        readers = [_stream(servicer.stub, f"s-{i}", prompt) for i, prompt in enumerate(PROMPTS)]
        wait_until(lambda: all(watch.request(f"s-{i}") for i in range(len(PROMPTS))), 120,
                   "four calls sent to the engine")
        for _ in range(100):
            view = watch.stable_view([f"s-{i}" for i in range(len(PROMPTS))])
            shown = [watch.request(f"s-{i}", view) for i in range(len(PROMPTS))]
            # Only this test continues the EngineCore; a stop it did not lift means something else did.
            assert _state(engine.core.pid) == "T", f"the EngineCore was continued behind this test's back: {shown}"
            assert all(shown), (f"a stream ended before the kill: {shown}; the view's ended requests "
                                f"{view['ended_recently']}, as of {view['as_of']}; the engine's bursts (s) "
                                f"{engine.bursts}; the servicer's log ends:\n{servicer.log()[-3000:]}")
            least = min(q["tokens"] for q in shown)
            if least >= KILL_AT:
                break
            engine.run_for(BURST_S)
        else:
            raise AssertionError(f"the streams did not reach {KILL_AT} tokens in 100 bursts: {shown}")
        assert max(q["tokens"] for q in shown) < TOKENS
        engine.kill_core()
        engine.close()
        engine = None
        killed_at = time.monotonic()
        wait_not_serving(servicer, 10, "NOT_SERVING while the engine restarts", interval_s=0.1)
        during = wait_until(lambda: watch.rendered_showing("4 held for the restarting engine"), 120,
                            "inspect --watch showing the four streams held")
        _keep("inspect-during-restart.txt", during)
        assert "restarting" in during and during.count("HELD") == 4
        for reader in readers:
            reader.join(300)
        restarted_in = time.monotonic() - killed_at
        for reader, ref in zip(readers, reference):
            assert reader.error is None, f"{reader.request.request_id}: {reader.error}\n{servicer.log()[-4000:]}"
            tokens = _tokens(reader)
            assert len(tokens) == TOKENS
            assert [c.finish_reason for c in reader.completes] == ["length"]
            assert tokens == _tokens(ref), (f"{reader.request.request_id}: first difference at "
                                            f"{next(i for i, (a, b) in enumerate(zip(tokens, _tokens(ref))) if a != b)}")
        assert engine_pid(servicer.journal) != launcher
        metrics = scrape(metrics_port)
        assert _metric(metrics, "smg_servicer_resume_restarts") == 1
        assert _metric(metrics, "smg_servicer_resume_resumed_requests") == 4
        reprefilled = _metric(metrics, "smg_servicer_resume_reprefilled_tokens")
        assert 4 * KILL_AT <= reprefilled < 4 * TOKENS
        story = _cli("journal", "show", "--journal", str(servicer.journal), "--kind",
                     "error,engine.restart,engine.held,engine.resume,transition")
        _keep("journal-after-restart.txt", f"(from the kill to the four streams' end: {restarted_in:.1f} s)\n"
              + "\n".join(line for line in story.splitlines() if "ref-" not in line))

        # The budget: one restart per window is spent; the next death stops the restarts and fails what is held.
        # The EngineCore is stopped first, so the two calls reach it and wait there: neither can end before
        # the kill, however fast the engine or slow this box (once both ended before a kill timed on tokens).
        core = engine_core_pid(engine_pid(servicer.journal))
        os.kill(core, signal.SIGSTOP)
        last = [_stream(servicer.stub, f"t-{i}", prompt) for i, prompt in enumerate(PROMPTS[:2])]
        wait_until(lambda: all(watch.request(f"t-{i}") for i in range(2)), 120, "two calls sent to the engine")
        os.kill(core, signal.SIGKILL)
        for reader in last:
            reader.join(180)  # the death noticed, the budget found spent, the held calls failed: slow under load
            assert not reader.is_alive(), f"{reader.request.request_id} still streaming 180 s after the kill"
            assert reader.error is not None and reader.error.code() == grpc.StatusCode.UNAVAILABLE
            assert "engine restarts stop: 2 crashes" in reader.error.details(), reader.error.details()
        assert servicer.wait(60) == 1
    finally:
        if engine is not None:
            engine.close()
        if watch is not None:
            watch.stop()
        servicer.stop()
    with open_reader(servicer.journal) as reader:
        kinds = [rec.kind for rec in reader.iter_records(after_seq=0)]
    assert kinds.count(r.KIND_ENGINE_RESTART) == 1
    assert kinds.count(r.KIND_ENGINE_RESUME) == 4
    _keep("journal-replay.txt", _cli("journal", "replay", "--journal", str(servicer.journal)))


def _metric(metrics: dict[str, float], name: str) -> float:
    return sum(value for key, value in metrics.items() if key.startswith(name + "{"))
