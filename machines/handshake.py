"""The engine handshake machine: every DP rank's HELLO → init → ready response and READY.

One ``EngineHandshake`` per engine start, used by the ZMQ link
(``runtime/engine/engine_link.py``) and the simulation's memory link
(``runtime/engine/memory_link.py``) alike. Sans-io, h11-style: the shell hands it
what arrived — ``on_status`` for a message on the handshake socket,
``on_ready_response`` for one on the input socket — with the sender's
identity, and carries out the actions it returns (journal a step, send the
init to a rank, the handshake is done). It never reads a clock or a socket.

Theory of operation. Each rank runs its own handshake on its own identity
(vLLM's headless wire, reference §3): ``waiting``, HELLO → ``greeted`` (the
init goes out), then its ready response (input socket) and READY (handshake
socket) in either order, through ``responded`` or ``confirmed``, → ``up``.
They arrive close together and SGLang's adapter sends READY first, so both
orders are in the table (``HANDSHAKE_TABLE.diagram()`` draws it). When every rank is ``up`` the machine returns
``HandshakeDone``: each rank's ready response as the runtime reads it, and
``incompatible`` when the engine is not the one the launch check verified
(its version) or not this wire's engine at all (another engine's adapter
names itself in its version): the shell fails the link with that, after
recording the engine's facts.

The wire's messages are read by a small codec object (``HandshakeWire``:
vLLM's is ``wire.vllm.VllmHandshake``; SGLang's and TokenSpeed's differ in a
few fields of the ready response), into typed msgspec structs. Nothing
vLLM-specific is written here.

Rules: one transition table (``HANDSHAKE_TABLE``) per rank; a message the
table does not allow (READY before HELLO, a second HELLO, a ready response
twice), a message the codec cannot read, or one from an identity that is no
rank of this engine raises ``HandshakeRefused`` naming the rank, its state
and what it sent: the engine's fault, the link fails. The shell's gate
(``runtime/engine/handshake_gate.py``) has already passed over strangers' frames,
so whatever reaches this machine is the engine's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Sequence

import msgspec

from enginelink.machines.table import ProtocolError, build_table
from enginelink.wire.engine import HandshakeStep, HandshakeWire, WireError

MACHINE_HANDSHAKE = "engine_handshake"
# How much of an engine message an error quotes: enough to recognise it, never a whole frame.
QUOTED_CHARS_MAX = 160


class RankState(StrEnum):
    WAITING = "waiting"  # nothing heard from the rank yet
    GREETED = "greeted"  # HELLO in, init sent
    RESPONDED = "responded"  # its ready response in, READY not yet
    CONFIRMED = "confirmed"  # READY in, its ready response not yet
    UP = "up"


class RankEvent(StrEnum):
    HELLO = "hello"
    RESPONSE = "response"  # the ready response, on the input socket
    READY = "ready"  # READY, on the handshake socket


HANDSHAKE_TABLE = build_table(
    MACHINE_HANDSHAKE,
    states=[s.value for s in RankState],
    transitions=[
        (RankEvent.HELLO, RankState.WAITING, RankState.GREETED),
        (RankEvent.RESPONSE, RankState.GREETED, RankState.RESPONDED),
        (RankEvent.READY, RankState.GREETED, RankState.CONFIRMED),
        (RankEvent.READY, RankState.RESPONDED, RankState.UP),
        (RankEvent.RESPONSE, RankState.CONFIRMED, RankState.UP),
    ],
    initial=RankState.WAITING,
    terminal={RankState.UP},
)


class HandshakeRefused(Exception):
    """The engine broke its handshake (the engine's fault): the message says which rank and how."""


# -- actions --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """Journal one handshake step (``engine.handshake``): what the rank said or was sent."""

    step: str  # "hello", "init", "ready" (the ready response), "READY"
    message: dict
    rank: int


@dataclass(frozen=True)
class SendInit:
    """Send ``payload`` to ``identity`` on the handshake socket."""

    identity: bytes
    payload: bytes


@dataclass(frozen=True)
class HandshakeDone:
    """Every rank is up. ``ready``: each rank's ready response (rank order); ``incompatible``:
    why this engine must not be used (its version, or another engine's wire), else None."""

    ready: dict[int, dict]
    incompatible: str | None = None

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(self.ready)


Action = Record | SendInit | HandshakeDone


def version_refusal(engine: str, said: str, checked: str) -> str | None:
    """The run-time guard: the engine that answered is the release the launch check verified."""
    if said != checked:
        return (
            f"the engine's ready response says {engine} {said or '(none)'}, but the launch check "
            f"verified {engine} {checked}: the engine runs from another installation"
        )
    return None


class EngineHandshake:
    """The handshake of one engine start, over every rank in ``ranks``.

    ``inputs``/``outputs``: the addresses the init message gives each rank;
    ``expected_version``: the release the launch check verified (None: not
    checked, as for the sim engine the servicer launches itself).
    """

    def __init__(
        self,
        wire: HandshakeWire,
        ranks: Sequence[int],
        inputs: Sequence[str],
        outputs: Sequence[str],
        expected_version: str | None = None,
    ) -> None:
        if not ranks:
            raise ValueError("a handshake needs at least one rank")
        self.wire = wire
        self.expected_version = expected_version
        self._inputs = list(inputs)
        self._outputs = list(outputs)
        self._rank_of = {wire.identity(rank): rank for rank in ranks}
        self.states: dict[int, RankState] = {rank: RankState.WAITING for rank in ranks}
        self._ready: dict[int, Any] = {}
        self.done: HandshakeDone | None = None

    @property
    def identities(self) -> frozenset[bytes]:
        """The identities the engine's ranks speak from (the gate lets only these through)."""
        return frozenset(self._rank_of)

    def identity(self, rank: int) -> bytes:
        return self.wire.identity(rank)

    def is_hello(self, payload: bytes) -> bool:
        """Whether ``payload`` reads as a HELLO (the gate's test where the sender's pid is unknown)."""
        try:
            step, _ = self.wire.decode_status(payload)
        except WireError:
            return False
        return step is HandshakeStep.HELLO

    # -- events ----------------------------------------------------------------------------

    def on_status(self, identity: bytes, payload: bytes) -> list[Action]:
        """A message on the handshake socket: HELLO, or READY."""
        rank = self._rank(identity, payload)
        try:
            step, status = self.wire.decode_status(payload)
        except WireError as error:
            raise HandshakeRefused(
                f"{self._who(rank)} sent {_quote(payload)} on the handshake socket in state "
                f"{self.states[rank].value!r}, which is no {self.wire.engine} HELLO or READY ({_cut(str(error))})"
            ) from None
        event = RankEvent.HELLO if step is HandshakeStep.HELLO else RankEvent.READY
        self._step(rank, event, step.value)
        shown = msgspec.to_builtins(status)
        if event is RankEvent.HELLO:
            return [
                Record("hello", shown, rank),
                SendInit(identity, self.wire.encode_init(self._inputs, self._outputs)),
                Record("init", {"inputs": list(self._inputs), "outputs": list(self._outputs)}, rank),
            ]
        return [Record("READY", shown, rank), *self._finish()]

    def on_ready_response(self, identity: bytes, payload: bytes) -> list[Action]:
        """A message on the input socket: the rank's ready response."""
        rank = self._rank(identity, payload)
        try:
            ready = self.wire.decode_ready(payload)
        except WireError as error:
            raise HandshakeRefused(
                f"{self._who(rank)} sent a ready response {self.wire.engine}'s wire cannot read "
                f"({_cut(str(error))}): {_quote(payload)}"
            ) from None
        self._step(rank, RankEvent.RESPONSE, "its ready response")
        self._ready[rank] = ready
        return [Record("ready", self.wire.facts(ready), rank), *self._finish()]

    # -- internals -------------------------------------------------------------------------

    def _rank(self, identity: bytes, payload: bytes) -> int:
        if self.done is not None:
            raise HandshakeRefused(f"the engine sent {_quote(payload)} after its handshake was done")
        rank = self._rank_of.get(identity)
        if rank is None:
            known = ", ".join(str(r) for r in self.states)
            raise HandshakeRefused(
                f"identity {identity[:32].hex() or '(empty)'} is no DP rank of this engine (ranks {known}); "
                f"it sent {_quote(payload)}"
            )
        return rank

    def _step(self, rank: int, event: RankEvent, what: str) -> None:
        state = self.states[rank]
        try:
            self.states[rank] = RankState(HANDSHAKE_TABLE.next_state(str(rank), state, event))
        except ProtocolError:
            raise HandshakeRefused(f"{self._who(rank)} sent {what} in handshake state {state.value!r}") from None

    def _who(self, rank: int) -> str:
        return "the engine" if len(self.states) == 1 else f"engine DP rank {rank}"

    def _finish(self) -> list[Action]:
        if any(state is not RankState.UP for state in self.states.values()):
            return []
        ordered = sorted(self._ready)
        self.done = HandshakeDone({rank: self.wire.facts(self._ready[rank]) for rank in ordered},
                                  self._incompatible(ordered))  # fmt: skip
        return [self.done]

    def _incompatible(self, ordered: list[int]) -> str | None:
        for rank in ordered:
            version = self.wire.version(self._ready[rank])
            foreign = self.wire.foreign(version)
            if foreign is not None:
                problem = (f"the engine's ready response says {version}: it is {foreign}, not {self.wire.engine}, "
                           f"whose wire this link speaks")  # fmt: skip
            elif self.expected_version:
                problem = version_refusal(self.wire.engine, version, self.expected_version)
            else:
                problem = None
            if problem:
                return problem if len(ordered) == 1 else f"DP rank {rank}: {problem}"
        return None


def _quote(payload: bytes) -> str:
    """The message as msgpack reads it (else its bytes), cut to ``QUOTED_CHARS_MAX`` characters."""
    try:
        shown = repr(msgspec.msgpack.decode(payload))
    except msgspec.DecodeError:
        shown = repr(bytes(payload))
    return _cut(shown, f" ({len(payload)} bytes)")


def _cut(text: str, tail: str = "") -> str:
    """``text`` as an error may quote it: the wire's own errors quote the message too."""
    return text if len(text) <= QUOTED_CHARS_MAX else f"{text[:QUOTED_CHARS_MAX]}…{tail}"
