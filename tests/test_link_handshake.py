"""The handshake machine inside a link: what an operator sees when the engine breaks its handshake.

The memory link (``runtime/engine/memory_link.py``) feeds the same machine as the
ZMQ link; an engine double that says the wrong thing shows the failure the
servicer would exit with, and the journal's record of it. Runs on trio's
MockClock: no sockets, no processes, no waiting.
"""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest
import trio

from enginelink.machines.sim_core import SimConfig, ready_response
from enginelink.runtime.engine.engine_link import EngineIncompatible, LinkFailed
from enginelink.runtime.engine.engine_link import EngineLink
from enginelink.runtime.engine.memory_link import MemoryLink, MemoryTransport
from enginelink.wire import vllm
from tests.harness import ListJournal

HELLO = vllm.encode_handshake_status(vllm.HandshakeStatus(status="HELLO"))
READY = vllm.encode_handshake_status(vllm.HandshakeStatus(status="READY"))


class ScriptedTransport(MemoryTransport):
    """A memory transport whose engine says ``script``: (socket, payload) pairs, in order."""

    def __init__(self, script) -> None:
        super().__init__(SimConfig())
        self.script = script

    async def _engine_handshake(self) -> None:
        identity = self.link.handshake_wire.identity(0)
        for socket, payload in self.script:
            await self._hs_to_link_tx.send((socket, identity, payload))
            if payload is HELLO:
                await self._hs_to_engine_rx.receive()  # the init
        await trio.sleep_forever()


def ScriptedEngine(script) -> EngineLink:
    """A memory link whose engine says ``script``."""
    return MemoryLink(name="vllm-0", config=SimConfig(), journal=ListJournal(), transport=ScriptedTransport(script))


async def _run(link: EngineLink) -> Exception | None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            try:
                await nursery.start(link.run)
            except LinkFailed as error:  # raised before ``started``: the link never came up
                return error
            nursery.cancel_scope.cancel()
    return None


def _errors(link: EngineLink) -> list[str]:
    return [payload["message"] for _, _, kind, payload in link.journal.records if kind == "error"]


GOOD_READY = vllm.encode_ready_response(ready_response(SimConfig()))


@pytest.mark.parametrize(("script", "said"), [
    ([("handshake", READY)], "the engine sent READY in handshake state 'waiting'"),
    ([("handshake", HELLO), ("handshake", HELLO)], "the engine sent HELLO in handshake state 'greeted'"),
    ([("handshake", msgspec.msgpack.encode({"status": "HI"}))], "{'status': 'HI'} on the handshake socket"),
    ([("handshake", HELLO), ("input", msgspec.msgpack.encode({"max_num_seqs": "many"}))],
     "a ready response vLLM's wire cannot read (undecodable vLLM ready response: Expected `int`, got `str` - "
     "at `$.max_num_seqs`): {'max_num_seqs': 'many'}"),
])  # fmt: skip
async def test_a_broken_handshake_fails_the_link_saying_how(autojump_clock, script, said):
    link = ScriptedEngine(script)
    error = await _run(link)
    assert isinstance(error, LinkFailed) and not isinstance(error, EngineIncompatible)
    assert str(error).startswith("engine broke the handshake: ") and said in str(error)
    assert _errors(link) == [str(error)]  # journaled as the engine's fault, once
    assert link.machine.state.value == "failed" and not link.ready


async def test_another_release_than_the_checked_one_is_refused_after_its_facts_are_recorded(autojump_clock):
    link = ScriptedEngine([("handshake", HELLO), ("input", GOOD_READY), ("handshake", READY)])
    link.launcher = SimpleNamespace(checked_version="0.31.0")  # what a launch check would have verified
    error = await _run(link)
    assert isinstance(error, EngineIncompatible)  # the servicer exits 2
    assert str(error) == ("the engine's ready response says vLLM 0.32.0, but the launch check verified "
                          "vLLM 0.31.0: the engine runs from another installation")
    kinds = [kind for _, _, kind, _ in link.journal.records]
    assert kinds.index("engine.facts") < kinds.index("error")
    assert link.ready["vllm_version"] == "0.32.0" and link.ranks.ranks == (0,)


async def test_the_other_order_comes_up(autojump_clock):
    link = ScriptedEngine([("handshake", HELLO), ("handshake", READY), ("input", GOOD_READY)])
    assert await _run(link) is None
    steps = [payload["step"] for _, _, kind, payload in link.journal.records if kind == "engine.handshake"]
    assert steps == ["launch", "hello", "init", "READY", "ready"]
    assert link.ready["max_num_seqs"] == SimConfig().max_num_seqs
