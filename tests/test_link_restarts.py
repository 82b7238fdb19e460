"""One engine death, seen by several of the link's watchers, is one crash (``restarts.crash_or_fail``).

The output connection closing and the launcher's exit report the same SIGKILL within the same instant,
in either order. The real vLLM restart test met it on CI: the disconnect came first this time, the
process exit 0.3 ms later was counted as a second crash, and with ``--engine-restarts 1`` the four held
streams failed "engine restarts stop: 2 crashes within 600 s" after a single kill.
"""

from __future__ import annotations

import pytest

from enginelink.machines.link import LinkEvent, LinkState
from enginelink.machines.resume import ResumePolicy, RestartBudget
from enginelink.runtime.engine import engine_link as el
from enginelink.wire.vllm import VllmCodec
from tests.harness import ListJournal

DISCONNECT = "engine closed its output connection (its engine core exited) while its launcher process 7 still runs"
EXITED = "engine process 7 exited with status 1"


def serving_link(restarts_max: int) -> tuple[el.EngineLink, list[str]]:
    link = el.EngineLink(name="vllm-0", launcher=None, codec=VllmCodec(), journal=ListJournal(), servicer_sched="normal")
    link.restart_budget = RestartBudget(ResumePolicy(restarts_max=restarts_max))
    crashes: list[str] = []
    link.on_crash = lambda message, now: crashes.append(message)
    link.starts = 1  # as run() counts its start
    link.step(LinkEvent.HANDSHAKE_DONE)
    link.step(LinkEvent.WARMUP_DONE)
    return link, crashes


@pytest.mark.parametrize("first,second", [(DISCONNECT, EXITED), (EXITED, DISCONNECT)])
async def test_one_death_reported_twice_is_one_crash_and_one_restart(first, second):
    link, crashes = serving_link(restarts_max=1)
    link.fail(first)
    link.fail(second)
    assert link.machine.state is LinkState.RESTARTING
    assert crashes == [first]
    assert link.restart_budget.restarts == 1
    errors = [payload for _, _, kind, payload in link.journal.records if kind == "error"]
    assert [e["message"] for e in errors] == [first] and errors[0]["restarting"] is True


async def test_a_death_of_the_restarts_own_start_is_a_second_crash():
    """The budget still counts a death after the restart began: that start is a new one (``starts``)."""
    link, crashes = serving_link(restarts_max=1)
    link.fail(EXITED)
    link.starts = 2  # run() again: the restart's start
    link.fail("engine process 8 exited with status 1")
    assert link.machine.state is LinkState.FAILED
    errors = [payload["message"] for _, _, kind, payload in link.journal.records if kind == "error"]
    assert "engine restarts stop: 2 crashes within 600 s" in errors[-1]
