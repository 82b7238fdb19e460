"""The warm-up driver: runs a plan (``machines/warmup.py``) against the engine, under a budget.

Theory of operation. ``run_warmup`` walks the plan's steps in order and runs
the requests of one step concurrently, each through ``submit(request,
timeout_s)``, which answers "ok", "failed" or "refused". Each request gets
min(600 s, budget left), at least 1 s; the driver enforces it with a cancel
scope (a request that overruns is a timeout, counted as failed, and
``submit`` must clean up on cancellation). The budget ends the pass between
steps, never in the middle of one. Three whole-step failures in a row end the
pass too (a step where every request was refused counts only while no step
has succeeded yet: refusals after that are not the engine's shapes failing).
The plan's flush step runs at the end whatever happened, bounded by
``FLUSH_TIMEOUT_S``. One INFO line per step with its time, one at the end.

The driver depends only on ``submit``, ``flush`` and trio's clock, so tests
run it on ``MockClock`` with fakes. ``hub_submit`` (``runtime/context/submit.py``,
which SGLang's health probe uses too) and ``engine_flush`` bind it to the real
request hub and engine link; ``warm_up`` does the whole job for the server.

Rules: the warm-up never takes the servicer down (an exception from
``submit`` or ``flush`` is logged and counted as a failure; only
cancellation passes through); time only from ``trio.current_time()``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final

import trio

from enginelink.machines.warmup import (
    StepKind,
    WarmupLevel,
    WarmupRequest,
    WarmupSetting,
    WarmupStep,
    facts_from_ready,
    plan_warmup,
)
from enginelink.runtime.context.submit import Outcome, Submit, hub_submit
from enginelink.runtime.requests.embed import RUNNER_POOLING, runner_type
from enginelink.runtime.requests.pd_bootstrap import stand_in_params
from enginelink.runtime.requests.validate import EngineLimits

REQUEST_TIMEOUT_MAX_S: Final = 600.0
REQUEST_TIMEOUT_MIN_S: Final = 1.0
FAILED_STEPS_MAX: Final = 3  # whole-step failures in a row that end the pass
FLUSH_TIMEOUT_S: Final = 30.0  # the reference's cap on one prefix-cache reset
FLUSH_RETRY_S: Final = 0.1  # the engine refuses a reset while requests run: retry this often

logger = logging.getLogger("enginelink.warmup")


Flush = Callable[[], Awaitable[bool]]


@dataclass
class WarmupOutcome:
    steps_total: int  # request steps in the plan (the flush is not one)
    steps_run: int = 0
    steps_ok: int = 0  # at least one request of the step succeeded
    steps_failed: int = 0  # no request succeeded
    requests_ok: int = 0
    requests_failed: int = 0  # timeouts included
    requests_refused: int = 0
    requests_timed_out: int = 0
    stopped: str | None = None  # "budget" | "failures" | None (ran to the end)
    flushed: bool | None = None  # None: the plan has no flush
    elapsed_s: float = 0.0


async def run_warmup(
    plan: Sequence[WarmupStep],
    *,
    submit: Submit,
    flush: Flush,
    budget_s: float,
    log: logging.Logger | logging.LoggerAdapter = logger,
) -> WarmupOutcome:
    """Run ``plan``; returns what happened. Never raises but for cancellation."""
    steps = [step for step in plan if step.kind is not StepKind.FLUSH]
    flushes = len(plan) - len(steps)
    outcome = WarmupOutcome(steps_total=len(steps))
    start = trio.current_time()
    deadline = start + budget_s
    streak = 0
    for number, step in enumerate(steps, 1):
        left = deadline - trio.current_time()
        if left <= 0:
            outcome.stopped = "budget"
            log.info("warm-up budget of %g s is spent: %d of %d steps ran", budget_s, number - 1, len(steps))
            break
        timeout_s = max(REQUEST_TIMEOUT_MIN_S, min(REQUEST_TIMEOUT_MAX_S, left))
        step_start = trio.current_time()
        results = await _run_step(step, submit, timeout_s, log)
        elapsed = trio.current_time() - step_start
        streak = _count(outcome, results, streak)
        # One line per step at DEBUG; the INFO summary below says how it went.
        log.debug("warm-up step %d/%d %s: %s in %.3f s", number, len(steps), step.label, _summary(results), elapsed)
        if streak >= FAILED_STEPS_MAX:
            outcome.stopped = "failures"
            log.warning("warm-up stopped: %d steps in a row failed (%d of %d ran)", streak, number, len(steps))
            break
    if flushes:
        outcome.flushed = await _flush(flush, log)
    outcome.elapsed_s = trio.current_time() - start
    log.info(
        "warm-up %s in %.3f s: %d of %d steps, requests %d ok, %d failed (%d timed out), %d refused%s",
        {None: "done", "budget": "cut by its budget", "failures": "stopped"}[outcome.stopped],
        outcome.elapsed_s,
        outcome.steps_run,
        outcome.steps_total,
        outcome.requests_ok,
        outcome.requests_failed,
        outcome.requests_timed_out,
        outcome.requests_refused,
        {None: "", True: "; prefix cache flushed", False: "; prefix cache NOT flushed"}[outcome.flushed],
    )
    return outcome


async def _run_step(step: WarmupStep, submit: Submit, timeout_s: float, log) -> list[Outcome]:
    results = [Outcome.TIMEOUT] * len(step.requests)

    async def one(index: int, request: WarmupRequest) -> None:
        with trio.move_on_after(timeout_s):
            try:
                results[index] = Outcome(await submit(request, timeout_s))
            except Exception as error:  # a bug or a broken engine: the warm-up goes on
                log.warning("warm-up request %s failed: %s: %s", request.request_id, type(error).__name__, error)
                results[index] = Outcome.FAILED

    async with trio.open_nursery() as nursery:
        for index, request in enumerate(step.requests):
            nursery.start_soon(one, index, request)
    return results


def _count(outcome: WarmupOutcome, results: list[Outcome], streak: int) -> int:
    """Add a step's results; returns the new streak of whole-step failures."""
    outcome.steps_run += 1
    ok = results.count(Outcome.OK)
    timed_out = results.count(Outcome.TIMEOUT)
    refused = results.count(Outcome.REFUSED)
    outcome.requests_ok += ok
    outcome.requests_timed_out += timed_out
    outcome.requests_failed += results.count(Outcome.FAILED) + timed_out
    outcome.requests_refused += refused
    if ok:
        outcome.steps_ok += 1
        return 0
    covered = outcome.steps_ok > 0
    outcome.steps_failed += 1
    if results and refused == len(results) and covered:
        return streak  # admission said no: not a failing shape, and something is warm already
    return streak + 1


def _summary(results: list[Outcome]) -> str:
    text = f"{len(results)} request{'' if len(results) == 1 else 's'}"
    bad = [
        f"{count} {name}"
        for name, count in (
            ("failed", results.count(Outcome.FAILED)),
            ("timed out", results.count(Outcome.TIMEOUT)),
            ("refused", results.count(Outcome.REFUSED)),
        )
        if count
    ]
    return f"{text} ({', '.join(bad)})" if bad else text


async def _flush(flush: Flush, log) -> bool:
    start = trio.current_time()
    flushed = False
    with trio.move_on_after(FLUSH_TIMEOUT_S):
        try:
            flushed = bool(await flush())
        except Exception as error:
            log.warning("warm-up prefix-cache flush failed: %s: %s", type(error).__name__, error)
    log.debug(
        "warm-up prefix-cache flush: %s in %.3f s",
        "done" if flushed else "not done",
        trio.current_time() - start,
    )
    return flushed


# -- binding to the hub and the link ---------------------------------------------------


def engine_flush(link) -> Flush:
    """``flush`` for ``run_warmup``: reset the engine's prefix cache, retrying while it refuses."""

    async def flush() -> bool:
        if not getattr(link.codec, "control_calls", True):
            # TokenSpeed 0.1.1's wire carries no utility calls: retrying the refusal would only hold the
            # warm-up (and so readiness) for the whole flush timeout.
            logger.info("warm-up prefix-cache flush skipped: the %s wire has no control calls", link.codec.name)
            return False
        while link.machine.live:
            try:
                if await link.utility("reset_prefix_cache", [], FLUSH_TIMEOUT_S):
                    return True
            except Exception as error:  # LinkFailed: a refusal or no answer; try again
                logger.debug("prefix-cache reset: %s", error)
            await trio.sleep(FLUSH_RETRY_S)
        return False

    return flush


async def warm_up(setting: WarmupSetting, *, link, hub, limits: EngineLimits, log=logger) -> WarmupOutcome | None:
    """The server's whole warm-up: plan from the engine's facts, run it, flush. None when off."""
    if setting.level is WarmupLevel.OFF:
        log.info("warm-up is off")
        return None
    if runner_type(link.ready) == RUNNER_POOLING:
        # The plan is generation requests; a pooling engine takes none (vLLM plans none for pooling models either).
        log.info("warm-up skipped: the engine runs a pooling model")
        return None
    if limits.pd_leg.is_leg and stand_in_params(limits.pd_leg, 0) is None:
        # A leg's request needs a peer's bootstrap, and this engine (TokenSpeed) has no stand-in transfer to
        # nobody: the reference plans no warm-up on such a leg either.
        log.info("warm-up skipped: a %s leg of an engine with no stand-in bootstrap", limits.pd_leg.mode)
        return None
    # Every rank the link fronts gets every step pinned (the pins are places in [0, N), as a client's).
    facts = facts_from_ready({**link.ready, "data_parallel_size": limits.data_parallel_size}, limits.vocab_size)
    plan = plan_warmup(facts, setting.level)
    log.info(
        "warm-up %s, budget %g s: %d steps (window %d, step %d tokens, context %d, %d DP rank%s)",
        setting.level,
        setting.budget_s,
        len([s for s in plan if s.kind is not StepKind.FLUSH]),
        facts.window,
        facts.step,
        facts.context,
        facts.dp_size,
        "" if facts.dp_size == 1 else "s",
    )
    return await run_warmup(
        plan, submit=hub_submit(hub, limits), flush=engine_flush(link), budget_s=setting.budget_s, log=log
    )
