"""The warm-up driver on trio's MockClock: exact virtual times, the budget, the failure rule, the flush.

The first tests drive ``run_warmup`` with fake ``submit``/``flush`` functions
that take virtual time; the last ones bind it to a real ``RequestHub`` in
front of the sans-io sim engine core with a cost model, in memory.
"""

from __future__ import annotations

import math

import msgspec
import pytest
import trio
import trio.testing

from enginelink.machines.link import LinkEvent, LinkMachine
from enginelink.machines.request_api import GenerateCall
from enginelink.machines.warmup import (
    StepKind,
    WarmupFacts,
    WarmupLevel,
    WarmupRequest,
    WarmupSetting,
    WarmupStep,
    plan_warmup,
)
from enginelink.runtime.errors import Unavailable
from enginelink.runtime.requests.hub import RequestHub
from enginelink.runtime.requests.validate import EngineLimits
from enginelink.runtime.context.submit import hub_submit
from enginelink.runtime.lifetime.warmup import FLUSH_TIMEOUT_S, run_warmup, warm_up
from enginelink.machines.sim_core import SimConfig, SimEngineCore, ready_response
from enginelink.wire import vllm
from enginelink.wire.engine import GenerateSpec, SamplingSpec
from tests.harness import ListJournal

REFERENCE = WarmupFacts(window=4, step=512, context=2048, vocab=4096)
PLAN = plan_warmup(REFERENCE, WarmupLevel.FULL)  # 27 request steps, then the flush


class ListLog:
    """A logger that keeps (level, message) pairs."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def _add(self, level: str, message: str, *args) -> None:
        self.lines.append((level, message % args if args else message))

    def info(self, message, *args):
        self._add("INFO", message, *args)

    def warning(self, message, *args):
        self._add("WARNING", message, *args)

    def debug(self, message, *args):
        self._add("DEBUG", message, *args)

    def messages(self, level: str = "INFO") -> list[str]:
        return [m for lv, m in self.lines if lv == level]


class Flusher:
    def __init__(self, result=True, hang=False, error=None) -> None:
        self.calls: list[float] = []
        self.result, self.hang, self.error = result, hang, error

    async def __call__(self) -> bool:
        self.calls.append(trio.current_time())
        if self.hang:
            await trio.sleep_forever()
        if self.error:
            raise self.error
        return self.result


def costed_submit(started: list, outcome=lambda request: "ok"):
    """A submit that takes prompt_len ms + max_tokens x 10 ms of virtual time."""

    async def submit(request: WarmupRequest, timeout_s: float) -> str:
        started.append((trio.current_time(), request.request_id, timeout_s))
        await trio.sleep(request.prompt_len * 1e-3 + request.max_tokens * 1e-2)
        return outcome(request)

    return submit


def fixed_steps(durations: list[float], outcome: str = "ok") -> tuple[list[WarmupStep], object]:
    """A hand-made plan of one-request steps, and a submit taking each step's duration."""
    steps = [
        WarmupStep(StepKind.PREFILL, n + 1, (WarmupRequest(f"smg-warmup-{n}", n, n + 1, 1, 4096),))
        for n in range(len(durations))
    ]

    async def submit(request: WarmupRequest, timeout_s: float) -> str:
        await trio.sleep(durations[request.ordinal])
        return outcome

    return steps + [WarmupStep(StepKind.FLUSH, 0)], submit


# -- order, concurrency, timing, logging ---------------------------------------------------


async def test_steps_in_order_requests_concurrently_exact_times(autojump_clock):
    started, flush, log = [], Flusher(), ListLog()
    outcome = await run_warmup(PLAN, submit=costed_submit(started), flush=flush, budget_s=300, log=log)

    # The staircase's 4 requests start together; each later step starts when the previous ended.
    assert sorted((t, rid) for t, rid, _ in started[:4]) == [
        (0.0, "smg-warmup-0"), (0.0, "smg-warmup-1"), (0.0, "smg-warmup-2"), (0.0, "smg-warmup-3")
    ]  # fmt: skip
    assert started[4][:2] == (pytest.approx(0.058), "smg-warmup-4")
    prefill_s = sum(n * 1e-3 + 1e-2 for n in [1, 2, 4, 8, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 384, 512])
    again_s = sum(n * 1e-3 + 1e-2 for n in [1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    assert outcome.elapsed_s == pytest.approx(0.058 + prefill_s + again_s) == pytest.approx(3.249)
    assert trio.current_time() == pytest.approx(3.249)
    assert flush.calls == [pytest.approx(3.249)]
    assert outcome.steps_total == outcome.steps_run == outcome.steps_ok == 27
    assert (outcome.requests_ok, outcome.requests_failed, outcome.requests_refused) == (30, 0, 0)
    assert outcome.stopped is None and outcome.flushed is True
    # Every request got the whole budget left, capped at 600 s.
    assert {timeout for _, _, timeout in started[:4]} == {300.0}
    assert started[-1][2] == pytest.approx(300 - (3.249 - 0.522))

    # One DEBUG line per step and for the flush; one INFO line sums it up.
    lines = log.messages("DEBUG")
    assert lines[0] == "warm-up step 1/27 decode staircase 4 x 8-token prompts, 2..5 tokens out: 4 requests in 0.058 s"
    assert lines[3] == "warm-up step 4/27 prefill 4 tokens: 1 request in 0.014 s"
    assert lines[16] == "warm-up step 17/27 prefill 512 tokens: 1 request in 0.522 s"
    assert lines[26] == "warm-up step 27/27 prefill 512 tokens again: 1 request in 0.522 s"
    assert lines[27] == "warm-up prefix-cache flush: done in 0.000 s"
    assert len(lines) == 28
    assert log.messages() == [
        "warm-up done in 3.249 s: 27 of 27 steps, requests 30 ok, 0 failed (0 timed out), 0 refused; "
        "prefix cache flushed"
    ]


async def test_request_timeout_is_capped_at_600_s(autojump_clock):
    started = []
    await run_warmup(PLAN[:1], submit=costed_submit(started), flush=Flusher(), budget_s=1000, log=ListLog())
    assert {timeout for _, _, timeout in started} == {600.0}


# -- the budget ----------------------------------------------------------------------------


async def test_budget_ends_the_pass_between_steps_never_mid_step(autojump_clock):
    plan, submit = fixed_steps([0.2] * 10)
    flush, log = Flusher(), ListLog()
    outcome = await run_warmup(plan, submit=submit, flush=flush, budget_s=0.5, log=log)
    # Steps start at 0, 0.2, 0.4 (inside the budget); the third runs to its end at 0.6.
    assert outcome.steps_run == 3 and outcome.stopped == "budget"
    assert trio.current_time() == pytest.approx(0.6)
    assert flush.calls == [pytest.approx(0.6)]
    assert outcome.requests_timed_out == 0
    assert "warm-up budget of 0.5 s is spent: 3 of 10 steps ran" in log.messages()
    assert log.messages()[-1].startswith("warm-up cut by its budget in 0.600 s: 3 of 10 steps")


async def test_budget_clamps_request_timeouts(autojump_clock):
    seen = []

    async def hang(request, timeout_s):
        seen.append((trio.current_time(), timeout_s))
        await trio.sleep_forever()

    flush = Flusher()
    outcome = await run_warmup(PLAN, submit=hang, flush=flush, budget_s=2.5, log=ListLog())
    assert seen == [(0.0, 2.5)] * 4  # the staircase, cut by its timeout
    assert trio.current_time() == 2.5 and flush.calls == [2.5]
    assert outcome.stopped == "budget" and outcome.steps_run == 1
    assert (outcome.requests_timed_out, outcome.requests_failed) == (4, 4)


async def test_timeout_is_at_least_one_second(autojump_clock):
    seen = []

    async def submit(request, timeout_s):
        seen.append((trio.current_time(), timeout_s))
        if request.ordinal == 0:
            await trio.sleep(9.5)
            return "ok"
        await trio.sleep_forever()

    plan, _ = fixed_steps([0] * 3)
    outcome = await run_warmup(plan, submit=submit, flush=Flusher(), budget_s=10, log=ListLog())
    assert seen == [(0.0, 10.0), (9.5, 1.0)]  # 0.5 s left, but a request gets at least 1 s
    assert trio.current_time() == 10.5
    assert outcome.stopped == "budget" and outcome.steps_run == 2 and outcome.requests_timed_out == 1


async def test_zero_budget_runs_no_step_but_still_flushes(autojump_clock):
    plan, submit = fixed_steps([1.0] * 3)
    flush = Flusher()
    outcome = await run_warmup(plan, submit=submit, flush=flush, budget_s=0, log=ListLog())
    assert outcome.steps_run == 0 and outcome.stopped == "budget" and flush.calls == [0.0]


# -- failures --------------------------------------------------------------------------------


async def test_three_whole_step_failures_in_a_row_stop_the_pass(autojump_clock):
    plan, submit = fixed_steps([0.1] * 10, outcome="failed")
    flush, log = Flusher(), ListLog()
    outcome = await run_warmup(plan, submit=submit, flush=flush, budget_s=300, log=log)
    assert outcome.stopped == "failures" and outcome.steps_run == 3 and outcome.steps_failed == 3
    assert flush.calls == [pytest.approx(0.3)] and outcome.flushed is True
    assert log.messages("DEBUG")[0] == "warm-up step 1/10 prefill 1 tokens: 1 request (1 failed) in 0.100 s"
    assert log.messages("WARNING") == ["warm-up stopped: 3 steps in a row failed (3 of 10 ran)"]


async def test_a_success_resets_the_streak_and_partial_steps_are_not_failures(autojump_clock):
    # Step outcomes by request: F F ok F F (partial) F F F ...
    script = {0: "failed", 1: "failed", 2: "ok", 3: "failed", 4: "failed"}

    async def submit(request, timeout_s):
        await trio.sleep(0.1)
        if request.ordinal in script:
            return script[request.ordinal]
        return "ok" if request.ordinal == 6 else "failed"

    steps = [WarmupStep(StepKind.PREFILL, 1, (WarmupRequest(f"smg-warmup-{n}", n, 1, 1, 4096),)) for n in range(5)]
    partial = WarmupStep(
        StepKind.PREFILL, 1, tuple(WarmupRequest(f"smg-warmup-{n}", n, 1, 1, 4096) for n in (5, 6))
    )
    tail = [WarmupStep(StepKind.PREFILL, 1, (WarmupRequest(f"smg-warmup-{n}", n, 1, 1, 4096),)) for n in range(7, 12)]
    outcome = await run_warmup(
        steps + [partial] + tail + [WarmupStep(StepKind.FLUSH, 0)],
        submit=submit, flush=Flusher(), budget_s=300, log=ListLog(),
    )  # fmt: skip
    assert outcome.steps_run == 9 and outcome.stopped == "failures"
    assert (outcome.steps_ok, outcome.steps_failed) == (2, 7)
    assert (outcome.requests_ok, outcome.requests_failed) == (2, 8)


async def test_refusals_count_only_while_nothing_was_covered(autojump_clock):
    async def always_refused(request, timeout_s):
        return "refused"

    flush = Flusher()
    outcome = await run_warmup(PLAN, submit=always_refused, flush=flush, budget_s=300, log=ListLog())
    assert outcome.stopped == "failures" and outcome.steps_run == 3 and flush.calls == [0.0]

    async def refused_after_the_first(request, timeout_s):
        return "ok" if request.ordinal < 4 else "refused"

    outcome = await run_warmup(PLAN, submit=refused_after_the_first, flush=Flusher(), budget_s=300, log=ListLog())
    assert outcome.stopped is None and outcome.steps_run == 27
    assert (outcome.requests_ok, outcome.requests_refused) == (4, 26)


async def test_an_exception_from_submit_is_a_failed_request_not_a_crash(autojump_clock):
    async def broken(request, timeout_s):
        raise RuntimeError("boom")

    log = ListLog()
    outcome = await run_warmup(PLAN, submit=broken, flush=Flusher(), budget_s=300, log=log)
    assert outcome.stopped == "failures" and outcome.requests_failed == 4 + 1 + 1
    assert "warm-up request smg-warmup-0 failed: RuntimeError: boom" in log.messages("WARNING")[:4]


# -- the flush -------------------------------------------------------------------------------


async def test_flush_failure_or_hang_is_reported_not_raised(autojump_clock):
    plan, submit = fixed_steps([0.1])
    outcome = await run_warmup(plan, submit=submit, flush=Flusher(result=False), budget_s=300, log=ListLog())
    assert outcome.flushed is False
    log = ListLog()
    outcome = await run_warmup(plan, submit=submit, flush=Flusher(error=OSError("gone")), budget_s=300, log=log)
    assert outcome.flushed is False
    assert log.messages("WARNING") == ["warm-up prefix-cache flush failed: OSError: gone"]
    start = trio.current_time()
    outcome = await run_warmup(plan, submit=submit, flush=Flusher(hang=True), budget_s=300, log=ListLog())
    assert outcome.flushed is False
    assert trio.current_time() - start == pytest.approx(0.1 + FLUSH_TIMEOUT_S)


async def test_a_plan_without_a_flush_step_does_not_flush(autojump_clock):
    plan, submit = fixed_steps([0.1, 0.1])
    flush = Flusher()
    outcome = await run_warmup(plan[:-1], submit=submit, flush=flush, budget_s=300, log=ListLog())
    assert flush.calls == [] and outcome.flushed is None and outcome.steps_run == 2


async def test_cancellation_passes_through(autojump_clock):
    plan, submit = fixed_steps([1.0] * 5)
    flush = Flusher()
    with trio.move_on_after(2.5) as scope:
        await run_warmup(plan, submit=submit, flush=flush, budget_s=300, log=ListLog())
    assert scope.cancelled_caught and flush.calls == []


# -- bound to a real hub, in front of the sim engine core -------------------------------------


class SimLink:
    """An engine link in memory: the sim core behind the vLLM codec, paying its cost model in virtual time.

    Inputs are handled as they are sent; each engine step's outputs arrive
    when its cost has passed.
    """

    def __init__(self, config: SimConfig) -> None:
        self.core = SimEngineCore(config)
        self.codec = vllm.VllmCodec()
        self.ready = msgspec.to_builtins(ready_response(config))
        self.machine = LinkMachine("sim-0", trio.current_time())
        self.machine.handle(LinkEvent.HANDSHAKE_DONE, trio.current_time())
        self.cached: list[int] = []
        self.hub = RequestHub(
            link=self.machine, codec=self.codec, send_frames=self.send, journal=ListJournal(),
            cached_tokens=self._cached_tokens,
        )  # fmt: skip
        self.sent: list[bytes] = []
        self._kick = trio.Event()
        self._replies: dict[int, object] = {}
        self._next_call_id = 1

    def _cached_tokens(self, output) -> int | None:
        cached = vllm.cached_tokens(output)
        self.cached.append(cached or 0)
        return cached

    def send(self, frames: list[bytes], rank: int = 0) -> None:
        self.sent.append(frames[0])
        for message in self.core.handle_input(frames[0], frames[1], trio.current_time()):
            self._deliver(message)
        self._kick.set()

    def _deliver(self, message: list[bytes]) -> None:
        batch = self.codec.decode_output(message)
        if batch.utility is not None:
            self._replies[batch.utility.call_id] = batch.utility
        if batch.outputs:
            self.hub.on_batch(batch, trio.current_time())

    async def utility(self, method: str, args: list, timeout_s: float) -> object:
        call_id, self._next_call_id = self._next_call_id, self._next_call_id + 1
        self.send(self.codec.encode_utility(call_id, method, args))
        reply = self._replies.pop(call_id)
        assert reply.failure is None, reply.failure
        return reply.result

    async def run(self) -> None:
        while True:
            # Requests sent at one instant reach one engine step, as they would through
            # the real engine's socket, whatever order trio runs their tasks in.
            await trio.testing.wait_all_tasks_blocked()
            messages, cost_s = self.core.step(trio.current_time()) if self.core.has_work else ([], 0.0)
            if not messages and cost_s == 0:
                await self._kick.wait()
                self._kick = trio.Event()
                continue
            await trio.sleep(cost_s)
            for message in messages:
                self._deliver(message)


def sim_link(**cost) -> SimLink:
    return SimLink(
        SimConfig(vocab_size=4096, max_model_len=2048, max_num_seqs=4, max_num_batched_tokens=512, eos_token_id=2, **cost)
    )


LIMITS = EngineLimits(max_model_len=2048, vocab_size=4096, eos_token_ids=(2,))


async def test_fast_and_full_warm_up_on_the_sim_engine_with_a_cost_model(autojump_clock):
    link = sim_link(prefill_us_per_token=100, step_us=1000)
    log = ListLog()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run)

        async def client_request():
            await trio.sleep(0.05)  # in the middle of the warm-up
            spec = GenerateSpec(request_id="client-1", prompt_token_ids=[1000, 1001], sampling=SamplingSpec(max_tokens=4))
            with pytest.raises(Unavailable, match="warming up"):
                link.hub.admit(GenerateCall("client-1", False, [1000, 1001], [spec], engine_ids=["client-1"]), 0.05)

        nursery.start_soon(client_request)
        outcome = await warm_up(WarmupSetting(WarmupLevel.FULL, 300.0), link=link, hub=link.hub, limits=LIMITS, log=log)
        nursery.cancel_scope.cancel()

    # Staircase: one step prefilling 4 x 8 tokens (1 ms + 3.2 ms), then 4 decode steps of 1 ms as
    # the batch shrinks 4, 3, 2, 1. Each prefill of L tokens is one engine step: 1 ms + L x 0.1 ms.
    staircase_s = 0.0042 + 4 * 0.001
    prefill_s = sum(0.001 + n * 1e-4 for n in [1, 2, 4, 8, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 384, 512])
    again_s = sum(0.001 + n * 1e-4 for n in [1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    assert outcome.elapsed_s == pytest.approx(staircase_s + prefill_s + again_s, abs=1e-9)
    assert outcome.elapsed_s == pytest.approx(0.3273, abs=1e-9)
    assert outcome.steps_run == outcome.steps_ok == 27 and outcome.requests_ok == 30
    assert outcome.flushed is True and link.core.num_cached_blocks == 0
    assert link.cached == [0] * 30  # distinct prompts: the prefix cache never hid a prefill
    assert link.hub.calls == {}
    lines = log.messages()
    assert lines[0] == "warm-up full, budget 300 s: 27 steps (window 4, step 512 tokens, context 2048, 1 DP rank)"
    assert lines[1].startswith("warm-up done in ") and len(lines) == 2  # the plan and the summary at INFO
    steps = log.messages("DEBUG")
    assert steps[0] == "warm-up step 1/27 decode staircase 4 x 8-token prompts, 2..5 tokens out: 4 requests in 0.008 s"
    assert steps[16] == "warm-up step 17/27 prefill 512 tokens: 1 request in 0.052 s"
    assert steps[-1] == "warm-up prefix-cache flush: done in 0.000 s"

    link = sim_link(prefill_us_per_token=100, step_us=1000)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run)
        outcome = await warm_up(WarmupSetting(WarmupLevel.FAST, 300.0), link=link, hub=link.hub, limits=LIMITS, log=log)
        nursery.cancel_scope.cancel()
    assert outcome.steps_run == 26 and outcome.elapsed_s == pytest.approx(0.3273 - 0.001 - 0.0384, abs=1e-9)


async def test_off_sends_nothing(autojump_clock):
    link = sim_link()
    outcome = await warm_up(WarmupSetting(WarmupLevel.OFF, 300.0), link=link, hub=link.hub, limits=LIMITS, log=ListLog())
    assert outcome is None and link.sent == []


async def test_a_slow_engine_times_out_and_the_requests_are_aborted(autojump_clock):
    # 4 x 8 prompt tokens at 0.5 s each: the staircase's first engine step alone takes 16 s.
    link = sim_link(prefill_us_per_token=500_000)
    submit = hub_submit(link.hub, LIMITS)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run)
        outcome = await run_warmup(PLAN, submit=submit, flush=_flush(link), budget_s=5, log=ListLog())
        nursery.cancel_scope.cancel()
    assert outcome.stopped == "budget" and outcome.steps_run == 1 and outcome.requests_timed_out == 4
    assert trio.current_time() == 5.0
    assert link.hub.calls == {}  # every timed-out call was ended...
    assert link.sent.count(vllm.REQ_ABORT) == 4  # ...and the engine told to stop (one ABORT each)
    assert link.sent.count(vllm.REQ_ADD) == 4
    assert outcome.flushed is True


@pytest.mark.parametrize(("dies_at", "stopped", "steps_run", "ok", "failed", "refused"), [
    # Before any request ended: the staircase fails, then admission refuses (engine not
    # alive) twice, which counts while nothing was covered: three in a row.
    (0.0005, "failures", 3, 0, 4, 2),
    # After the staircase's first request ended (2 ms): the rest of it fails, and the
    # refusals that follow do not count; they cost no time, and the pass runs out.
    (0.0025, None, 27, 1, 3, 26),
])  # fmt: skip
async def test_engine_failure_mid_warm_up(autojump_clock, dies_at, stopped, steps_run, ok, failed, refused):
    link = sim_link(step_us=1000)
    submit = hub_submit(link.hub, LIMITS)

    async def die():
        await trio.sleep(dies_at)
        link.machine.handle(LinkEvent.FAIL, trio.current_time(), "engine died")
        link.hub.fail_all("engine died", trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run)
        nursery.start_soon(die)
        outcome = await run_warmup(PLAN, submit=submit, flush=_flush(link), budget_s=300, log=ListLog())
        nursery.cancel_scope.cancel()
    assert (outcome.stopped, outcome.steps_run) == (stopped, steps_run)
    assert (outcome.requests_ok, outcome.requests_failed, outcome.requests_refused) == (ok, failed, refused)
    assert outcome.flushed is False  # no engine to flush
    assert math.isclose(trio.current_time(), dies_at)


def _flush(link: SimLink):
    from enginelink.runtime.lifetime.warmup import engine_flush

    return engine_flush(link)


async def test_a_wire_without_control_calls_skips_the_flush_instead_of_waiting_its_timeout(autojump_clock):
    """TokenSpeed 0.1.1's wire carries no utility calls: the flush used to retry the codec's refusal
    for the whole flush timeout (30 s), holding readiness; now it says no at once."""
    from types import SimpleNamespace

    from enginelink.runtime.lifetime.warmup import engine_flush
    from enginelink.wire.tokenspeed import TokenSpeedCodec

    calls = []

    async def utility(*args):
        calls.append(args)
        raise AssertionError("no utility call may be sent on this wire")

    link = SimpleNamespace(codec=TokenSpeedCodec(), machine=SimpleNamespace(live=True), utility=utility)
    start = trio.current_time()
    with trio.fail_after(1):  # the old flush retried for ever (its caller's 30 s bound cut it)
        assert await engine_flush(link)() is False
    assert trio.current_time() == start and calls == []
