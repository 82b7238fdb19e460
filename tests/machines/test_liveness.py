"""The idle probe (``machines/liveness.py``): exact times, pure; then the link's shell on a MockClock."""

from __future__ import annotations

import pytest
import trio

from enginelink.machines.link import LinkEvent
from enginelink.machines.liveness import IdleProbe, ProbeFailed, ProbeSend, ProbeTiming, ProbeWait
from enginelink.runtime.engine import engine_link as el
from enginelink.runtime.engine.supervision import Supervisor
from enginelink.wire.vllm import VllmCodec

TIMING = ProbeTiming(interval_s=5.0, timeout_s=10.0)


def test_an_idle_engine_is_probed_after_the_interval_and_an_answer_restarts_it():
    probe = IdleProbe(TIMING)
    assert probe.poll(100.0, idle=True, last_frame_at=100.0) == ProbeWait(105.0)
    assert probe.poll(105.0, idle=True, last_frame_at=100.0) == ProbeSend()
    assert probe.poll(105.1, idle=True, last_frame_at=100.0) == ProbeWait(115.0)  # one outstanding at a time
    # The answer (any frame after the probe) came at 105.2: quiet again from there.
    assert probe.poll(106.0, idle=True, last_frame_at=105.2) == ProbeWait(110.2)
    assert probe.poll(110.2, idle=True, last_frame_at=105.2) == ProbeSend()
    assert (probe.probes_sent, probe.probes_answered) == (2, 1)  # the second awaits its answer


def test_an_unanswered_probe_fails_at_its_timeout_exactly():
    probe = IdleProbe(TIMING)
    assert probe.poll(5.0, idle=True, last_frame_at=0.0) == ProbeSend()
    assert probe.poll(14.99, idle=True, last_frame_at=0.0) == ProbeWait(15.0)
    assert probe.poll(15.0, idle=True, last_frame_at=0.0) == ProbeFailed(10.0)
    assert (probe.probes_sent, probe.probes_answered) == (1, 0)


def test_a_frame_just_before_the_probe_does_not_answer_it():
    probe = IdleProbe(TIMING)
    assert probe.poll(5.0, idle=True, last_frame_at=0.0) == ProbeSend()
    assert probe.poll(15.0, idle=True, last_frame_at=4.999) == ProbeFailed(10.0)


def test_a_busy_engine_is_never_probed():
    # With requests in flight the silence limit judges the engine (a long prefill is quiet).
    probe = IdleProbe(TIMING)
    for now in (5.0, 50.0, 500.0):
        assert isinstance(probe.poll(now, idle=False, last_frame_at=0.0), ProbeWait)
    assert probe.probes_sent == 0


def test_requests_arriving_after_a_probe_do_not_excuse_its_silence():
    # The probe went ahead of them on the same socket: an engine that answers
    # neither is frozen, and the request is not left to the silence limit.
    probe = IdleProbe(TIMING)
    assert probe.poll(5.0, idle=True, last_frame_at=0.0) == ProbeSend()
    assert probe.poll(6.0, idle=False, last_frame_at=0.0) == ProbeWait(15.0)
    assert probe.poll(15.0, idle=False, last_frame_at=0.0) == ProbeFailed(10.0)


def test_interval_zero_turns_probing_off():
    probe = IdleProbe(ProbeTiming(interval_s=0.0, timeout_s=10.0))
    assert all(isinstance(probe.poll(t, idle=True, last_frame_at=0.0), ProbeWait) for t in (1.0, 100.0, 10_000.0))
    assert probe.probes_sent == 0


# -- the link's shell, on trio's MockClock ----------------------------------------------------


class _Launcher:
    engine = "vllm"


def serving_link(timing: ProbeTiming) -> el.EngineLink:
    link = el.EngineLink(name="vllm-0", launcher=_Launcher(), codec=VllmCodec(), journal=_Journal(),
                         supervision=el.Supervision(idle_probe=timing), servicer_sched="normal")  # fmt: skip
    link.step(LinkEvent.HANDSHAKE_DONE)
    link.step(LinkEvent.WARMUP_DONE)
    return link


class _Journal:
    def __init__(self) -> None:
        self.records = []

    def append(self, now, stream, kind, payload) -> None:
        self.records.append((now, stream, kind, payload))

    def note_decoded(self, seq, decoded) -> None:  # the live fold's feed (Journal.note_decoded): none here
        pass


@pytest.fixture
def engine(monkeypatch):
    """Probes the link sends, by virtual time; ``answer`` says whether the engine answers them."""
    state = {"sent": [], "answer": True, "frozen_ranks": set()}

    def send_probe(self) -> None:
        now = trio.current_time()
        state["sent"].append(now)
        if state["answer"]:
            link = self.link
            link.last_frame_at = now + 0.01  # the engine's reply arrives 10 ms later
            for rank in link.rank_heard_at:  # from every DP rank that is not frozen
                if rank not in state["frozen_ranks"]:
                    link.rank_heard_at[rank] = now + 0.01

    monkeypatch.setattr(Supervisor, "_send_probe", send_probe)
    return state


async def test_a_frozen_idle_engine_fails_the_link_at_interval_plus_timeout(autojump_clock, engine):
    link = serving_link(ProbeTiming(interval_s=5.0, timeout_s=10.0))
    failures = []
    link.on_failure = lambda message, now: failures.append((message, now))
    start = trio.current_time()
    engine["answer"] = False  # frozen from the start
    with trio.move_on_after(60):
        await link.supervisor.probe_while_idle()
    assert engine["sent"] == [start + 5.0]
    assert [now - start for _, now in failures] == [15.0]
    assert "ENGINELINK_IDLE_PROBE_TIMEOUT_SECS" in failures[0][0]
    assert link.machine.state.value == "failed"
    errors = [payload for _, _, kind, payload in link.journal.records if kind == "error"]
    assert len(errors) == 1 and "liveness probe" in errors[0]["message"]  # journaled once, on failure


async def test_an_answering_idle_engine_is_probed_every_interval_and_stays_up(autojump_clock, engine):
    link = serving_link(ProbeTiming(interval_s=5.0, timeout_s=10.0))
    start = trio.current_time()
    with trio.move_on_after(31):
        await link.supervisor.probe_while_idle()
    gaps = [round(b - a, 2) for a, b in zip([start, *engine["sent"]], engine["sent"])]
    # Each probe 5 s after the last frame (the previous answer, 10 ms after its probe).
    assert gaps[0] == 5.0 and all(5.0 <= gap <= 6.0 for gap in gaps[1:]), gaps
    assert len(engine["sent"]) >= 5
    assert link.machine.state.value == "serving"
    assert [kind for _, _, kind, _ in link.journal.records if kind == "error"] == []


async def test_one_frozen_dp_rank_among_answering_ones_fails_the_link_naming_it(autojump_clock, engine):
    """Every rank gets the probe and each must answer: the other ranks' frames do not cover a frozen one."""
    link = serving_link(ProbeTiming(interval_s=5.0, timeout_s=10.0))
    start = trio.current_time()
    link.rank_heard_at = {0: start, 1: start}  # as the handshake sets them
    engine["frozen_ranks"] = {1}
    failures = []
    link.on_failure = lambda message, now: failures.append((message, now))
    with trio.move_on_after(60):
        await link.supervisor.probe_while_idle()
    assert engine["sent"] == [start + 5.0]
    assert [now - start for _, now in failures] == [15.0]
    assert "DP rank 1 answered no liveness probe" in failures[0][0]


async def test_no_probe_while_requests_are_in_flight(autojump_clock, engine):
    link = serving_link(ProbeTiming(interval_s=5.0, timeout_s=10.0))
    link.load_probe = lambda: (1, 0)
    engine["answer"] = False
    with trio.move_on_after(100):
        await link.supervisor.probe_while_idle()
    assert engine["sent"] == [] and link.machine.state.value == "serving"


async def test_probes_off_means_no_probe_task_at_all(autojump_clock, engine):
    link = serving_link(ProbeTiming(interval_s=0.0, timeout_s=10.0))
    start = trio.current_time()
    await link.supervisor.probe_while_idle()  # returns at once: nothing left polling every 50 ms
    assert trio.current_time() == start and engine["sent"] == []
