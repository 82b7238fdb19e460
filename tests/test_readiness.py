"""Readiness (``runtime/lifetime/readiness.py``): one map from the link's state to health, followed, never set by hand."""

from __future__ import annotations

import pytest

from enginelink.machines.link import LinkEvent, LinkState
from enginelink.runtime.engine import engine_link as el
from enginelink.runtime.lifetime.readiness import Readiness, serving
from enginelink.wire.vllm import VllmCodec
from tests.harness import ListJournal


@pytest.mark.parametrize("state", list(LinkState))
@pytest.mark.parametrize("closing", [False, True])
def test_serving_only_in_serving_and_never_while_closing(state, closing):
    assert serving(state, closing) is (state is LinkState.SERVING and not closing)


class Sink:
    def __init__(self) -> None:
        self.values: list[bool] = []

    def set(self, value: bool) -> None:
        self.values.append(value)


async def test_readiness_follows_every_transition_of_the_link_and_publishes_changes_only():
    link = el.EngineLink(name="vllm-0", launcher=None, codec=VllmCodec(), journal=ListJournal(), servicer_sched="normal")
    sink = Sink()
    readiness = Readiness(link.machine.state, sink)
    link.on_transition = readiness.follow
    assert sink.values == [False]  # NOT_SERVING from the start (grpclib's ServiceStatus starts unknown)
    link.step(LinkEvent.HANDSHAKE_DONE)  # warming up: still not serving
    link.step(LinkEvent.WARMUP_DONE)
    assert readiness.value is True
    link.step(LinkEvent.DRAIN)
    assert readiness.value is False
    link.step(LinkEvent.DRAINED)
    assert sink.values == [False, True, False]  # one publication per change


async def test_a_failure_and_the_end_of_the_lifetime_turn_it_off_for_good():
    link = el.EngineLink(name="vllm-0", launcher=None, codec=VllmCodec(), journal=ListJournal(), servicer_sched="normal")
    sink = Sink()
    readiness = Readiness(link.machine.state, sink)
    link.on_transition = readiness.follow
    link.step(LinkEvent.HANDSHAKE_DONE)
    link.step(LinkEvent.WARMUP_DONE)
    link.fail("engine process 1 exited with status 1")  # the link's own failure path
    assert link.machine.state is LinkState.FAILED and sink.values == [False, True, False]
    serving_again = Readiness(LinkState.SERVING, sink)
    serving_again.close()  # the servicer's finally, with the link still saying "serving"
    serving_again.follow(LinkState.SERVING)
    assert serving_again.value is False and sink.values[-2:] == [True, False]
