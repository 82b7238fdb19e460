"""Run one seed: build its scenario, drive the servicer core through it on MockClock, check everything.

``run_seed(seed, model, tokenizer)`` is the whole simulation of one seed; it
returns a ``SimRun`` whose ``violations`` list what broke (empty: all held).
The run is deterministic: trio's scheduler is put in its deterministic mode
and seeded with the seed (it shuffles runnable tasks; see
``trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING``, which pytest-trio and
Hypothesis also use), time is ``MockClock(autojump_threshold=0)``, wall time
is a fixed fake start, and the scenario comes from ``random.Random(seed)``.
So the same seed gives the same journal, byte for byte (``journal_rows``).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass, field

import trio
import trio.testing

from enginelink.journal.fold import FoldState, fold
from tests.sim.checks import check_live, check_run
from tests.sim.scenario import Scenario, scenario
from tests.sim.servicer import VLLM_CLIENTS, ClientContract, Observation, SimServicer

# Virtual seconds after which a run counts as hung (every scenario ends well before).
HUNG_AFTER_S = 600.0


def repro(seed: int) -> str:
    """The one line that replays a seed."""
    return f"ENGINELINK_SIM_SEED={seed} .venv/bin/pytest tests/sim -k seed  # or: pytest tests/sim -k seed --sim-seed {seed}"


@dataclass
class SimRun:
    scenario: Scenario
    servicer: SimServicer
    observations: list[Observation]
    violations: list[str] = field(default_factory=list)
    hung: bool = False

    @property
    def journal_rows(self) -> list[tuple]:
        return self.servicer.journal.ring.rows()

    def report(self) -> str:
        lines = [self.scenario.summary(), f"exit {self.servicer.exit_status}: {self.servicer.reason}"]
        lines += [f"  - {v}" for v in self.violations[:30]]
        if len(self.violations) > 30:
            lines.append(f"  ... and {len(self.violations) - 30} more")
        lines.append(f"reproduce: {repro(self.scenario.seed)}")
        return "\n".join(lines)


@contextmanager
def deterministic_trio(seed: int):
    run = trio._core._run
    allow = run._ALLOW_DETERMINISTIC_SCHEDULING
    state = run._r.getstate()
    run._ALLOW_DETERMINISTIC_SCHEDULING = True
    run._r.seed(seed)
    quiet = logging.getLogger("enginelink")
    level = quiet.level
    if not os.environ.get("ENGINELINK_SIM_LOG"):
        quiet.setLevel(logging.WARNING)  # warm-up logs its plan and summary at INFO; a sweep does not need them
    try:
        yield
    finally:
        run._ALLOW_DETERMINISTIC_SCHEDULING = allow
        run._r.setstate(state)
        quiet.setLevel(level)


def run_seed(seed: int, model, tokenizer, sc: Scenario | None = None,
             contract: ClientContract = VLLM_CLIENTS) -> SimRun:
    """``contract``: the gRPC contract the clients speak (vLLM's; tests/sim/test_second_contract.py another)."""
    sc = sc if sc is not None else scenario(seed)
    with deterministic_trio(seed):
        return trio.run(_main, sc, model, tokenizer, contract, clock=trio.testing.MockClock(autojump_threshold=0))


async def _main(sc: Scenario, model, tokenizer, contract: ClientContract = VLLM_CLIENTS) -> SimRun:
    servicer = SimServicer(sc, model, tokenizer, contract)
    clients = [[Observation(plan, attempt) for attempt in range(1 + plan.retries)] for plan in sc.clients]
    observations = [obs for attempts in clients for obs in attempts]
    run = SimRun(sc, servicer, observations)
    live_state = FoldState()
    with trio.move_on_after(HUNG_AFTER_S) as watchdog:
        async with trio.open_nursery() as top:

            async def lifetime() -> None:
                await servicer.serve()
                top.cancel_scope.cancel()

            async def live_check(at: float) -> None:
                await trio.sleep_until(at)
                fold(servicer.journal.records(after_seq=live_state.last_seq), live_state)
                run.violations += [f"t={at:.3f}: {v}" for v in check_live(servicer, live_state)]

            top.start_soon(lifetime)
            for attempts in clients:
                top.start_soon(servicer.client, attempts)
            for abort in sc.aborts:
                top.start_soon(servicer.abort_rpc, abort.at, abort.request_ids)
            for fault in sc.faults:
                top.start_soon(servicer.fault, fault.at, fault.kind)
            top.start_soon(servicer.sigterm, sc.sigterm_at)
            for at in sc.live_checks_at:
                top.start_soon(live_check, at)
    if watchdog.cancelled_caught:
        run.hung = True
        run.violations.append(f"the run did not end within {HUNG_AFTER_S:g} virtual seconds")
        return run
    run.violations += check_run(run)
    return run

