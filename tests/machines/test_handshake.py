"""The engine handshake machine (``machines/handshake.py``): every transition, every refusal, one and two DP ranks.

Pure: bytes in, actions out, on vLLM's wire (``wire.vllm.VllmHandshake``);
then a wire codec of another engine (a vLLM-like handshake with its own
ready-response keys), which the machine runs unchanged.
"""

from __future__ import annotations

from typing import Sequence

import msgspec
import pytest

from enginelink.machines.handshake import (
    HANDSHAKE_TABLE,
    EngineHandshake,
    HandshakeDone,
    HandshakeRefused,
    RankEvent,
    RankState,
    Record,
    SendInit,
)
from enginelink.runtime.contracts.vllm import compat as vllm_compat
from enginelink.wire import codecs, vllm
from enginelink.wire.engine import HandshakeStep, WireError

WIRE = vllm.VllmHandshake()
IN, OUT = "ipc:///s/in", "ipc:///s/out"


def status(step: str, **extra) -> bytes:
    return msgspec.msgpack.encode({"status": step, "local": False, "headless": True, **extra})


HELLO, READY = status("HELLO"), status("READY")


def ready(rank: int = 0, version: str = vllm.VLLM_VERSION, **extra) -> bytes:
    return vllm.encode_ready_response(vllm.ReadyResponse(
        max_model_len=1024, data_parallel_rank=rank, vllm_version=version, instance_id=f"i{rank}", **extra))  # fmt: skip


def ident(rank: int) -> bytes:
    return rank.to_bytes(2, "little")


def machine(ranks: Sequence[int] = (0,), expected_version: str | None = None) -> EngineHandshake:
    return EngineHandshake(WIRE, ranks, [IN], [OUT], expected_version=expected_version)


# -- the table -------------------------------------------------------------------------------


def test_the_table_holds_both_orders_and_nothing_else():
    assert HANDSHAKE_TABLE.steps == {
        ("waiting", "hello"): "greeted",
        ("greeted", "response"): "responded",
        ("greeted", "ready"): "confirmed",
        ("responded", "ready"): "up",
        ("confirmed", "response"): "up",
    }
    assert HANDSHAKE_TABLE.terminal == {"up"}
    assert "greeted --> confirmed: ready" in HANDSHAKE_TABLE.diagram()


# Every (state, event) pair the table does not hold is refused, naming the rank, the state and the message.
_TO_STATE = {
    RankState.WAITING: [],
    RankState.GREETED: [("status", HELLO)],
    RankState.RESPONDED: [("status", HELLO), ("response", ready())],
    RankState.CONFIRMED: [("status", HELLO), ("status", READY)],
}
_EVENT = {RankEvent.HELLO: ("status", HELLO), RankEvent.READY: ("status", READY), RankEvent.RESPONSE: ("response", ready())}


def _feed(hs: EngineHandshake, rank: int, steps) -> list:
    actions = []
    for socket, payload in steps:
        if socket == "status":
            actions += hs.on_status(ident(rank), payload)
        else:
            actions += hs.on_ready_response(ident(rank), payload)
    return actions


@pytest.mark.parametrize("state", list(_TO_STATE))
@pytest.mark.parametrize("event", list(RankEvent))
def test_every_transition_of_the_table_and_every_refusal(state, event):
    hs = machine(ranks=(0, 1))  # two ranks: rank 0 reaching ``up`` does not end the handshake
    _feed(hs, 0, _TO_STATE[state])
    assert hs.states[0] is state
    allowed = HANDSHAKE_TABLE.allows(state, event)
    if allowed:
        _feed(hs, 0, [_EVENT[event]])
        assert hs.states[0].value == HANDSHAKE_TABLE.steps[(state.value, event.value)]
    else:
        with pytest.raises(HandshakeRefused) as refused:
            _feed(hs, 0, [_EVENT[event]])
        message = str(refused.value)
        assert "engine DP rank 0" in message and f"handshake state {state.value!r}" in message
        assert hs.states[0] is state  # a refusal changes nothing
    assert hs.states[1] is RankState.WAITING and hs.done is None


# -- one rank ---------------------------------------------------------------------------------


def test_one_rank_hello_init_ready_response_then_ready():
    hs = machine()
    actions = hs.on_status(ident(0), HELLO)
    assert actions == [
        Record("hello", {"status": "HELLO", "local": False, "headless": True}, 0),
        SendInit(ident(0), WIRE.encode_init([IN], [OUT])),
        Record("init", {"inputs": [IN], "outputs": [OUT]}, 0),
    ]
    init = vllm.decode_handshake_init(actions[1].payload)  # what the engine reads: vLLM's EngineHandshakeMetadata
    assert (init.addresses.inputs, init.addresses.outputs, init.parallel_config) == ([IN], [OUT], {})
    [record] = hs.on_ready_response(ident(0), ready())
    assert record.step == "ready" and record.rank == 0
    assert record.message["vllm_version"] == vllm.VLLM_VERSION and record.message["max_model_len"] == 1024
    assert hs.done is None
    record, done = hs.on_status(ident(0), READY)
    assert record == Record("READY", {"status": "READY", "local": False, "headless": True}, 0)
    assert isinstance(done, HandshakeDone) and done is hs.done
    assert done.ranks == (0,) and done.ready[0]["instance_id"] == "i0" and done.incompatible is None


def test_ready_before_the_ready_response_is_the_other_order():
    hs = machine()
    hs.on_status(ident(0), HELLO)
    assert hs.on_status(ident(0), READY) == [Record("READY", {"status": "READY", "local": False, "headless": True}, 0)]
    assert hs.states[0] is RankState.CONFIRMED
    *_, done = hs.on_ready_response(ident(0), ready())
    assert done.ranks == (0,)


# -- two ranks (data parallelism) ---------------------------------------------------------------


def test_two_ranks_interleaved_each_on_its_own_identity():
    hs = machine(ranks=(0, 1))
    assert hs.identities == {b"\x00\x00", b"\x01\x00"}
    sent = []
    for rank, socket, payload in [(1, "status", status("HELLO", parallel_config_hash="h")), (0, "status", HELLO),
                                  (0, "response", ready(0)), (1, "status", status("READY", parallel_config_hash="h")),
                                  (0, "status", READY)]:  # fmt: skip
        actions = _feed(hs, rank, [(socket, payload)])
        sent += [a.identity for a in actions if isinstance(a, SendInit)]
        assert hs.done is None
    assert sent == [ident(1), ident(0)]  # each init to the rank that said HELLO, in that order
    *_, done = hs.on_ready_response(ident(1), ready(1))
    assert done.ranks == (0, 1)  # rank order, not arrival order
    assert [done.ready[r]["data_parallel_rank"] for r in (0, 1)] == [0, 1]


def test_two_ranks_one_missing_is_not_done():
    hs = machine(ranks=(0, 1))
    _feed(hs, 0, [("status", HELLO), ("response", ready(0)), ("status", READY)])
    assert hs.states == {0: RankState.UP, 1: RankState.WAITING} and hs.done is None


def test_a_frame_from_an_identity_that_is_no_rank_is_refused():
    hs = machine(ranks=(0, 1))
    with pytest.raises(HandshakeRefused, match=r"identity 0200 is no DP rank of this engine \(ranks 0, 1\)"):
        hs.on_status(ident(2), HELLO)


def test_a_version_mismatch_names_the_rank_when_there_are_two():
    hs = machine(ranks=(0, 1), expected_version="0.32.0")
    _feed(hs, 0, [("status", HELLO), ("response", ready(0)), ("status", READY)])
    *_, done = _feed(hs, 1, [("status", HELLO), ("response", ready(1, version="0.31.0")), ("status", READY)])
    assert done.incompatible.startswith("DP rank 1: the engine's ready response says vLLM 0.31.0")
    assert "the launch check verified vLLM 0.32.0" in done.incompatible


# -- the version and codec checks --------------------------------------------------------------


@pytest.mark.parametrize(("said", "expected", "problem"), [
    ("0.32.0", "0.32.0", None),
    ("0.32.0", None, None),  # nothing checked at launch (the sim engine)
    ("0.31.0", "0.32.0", "says vLLM 0.31.0, but the launch check verified vLLM 0.32.0"),
    ("", "0.32.0", "says vLLM (none)"),
    ("sglang-0.5.3", None, "says sglang-0.5.3: it is sglang, not vLLM"),
    ("tokenspeed-0.1.1", "0.32.0", "it is tokenspeed, not vLLM"),
])  # fmt: skip
def test_the_engine_must_be_the_checked_release_of_this_wire(said, expected, problem):
    hs = machine(expected_version=expected)
    *_, done = _feed(hs, 0, [("status", HELLO), ("response", ready(version=said)), ("status", READY)])
    if problem is None:
        assert done.incompatible is None
    else:
        assert problem in done.incompatible
    if expected and WIRE.foreign(said) is None:  # the launcher's own check on a map says the same
        assert vllm_compat.check_ready({"vllm_version": said}, expected) == (
            None if said == expected else done.incompatible)  # fmt: skip


# -- malformed and unknown messages --------------------------------------------------------------


@pytest.mark.parametrize(("payload", "said"), [
    (b"\xc1 not msgpack", "undecodable vLLM handshake status"),
    (msgspec.msgpack.encode([1, 2, 3]), "[1, 2, 3]"),
    (msgspec.msgpack.encode({"status": "GOODBYE"}), "'GOODBYE'"),
    (msgspec.msgpack.encode({"local": False}), "missing required field `status`"),
    (msgspec.msgpack.encode({"status": "HELLO", "local": "yes"}), "Expected `bool`"),
])  # fmt: skip
def test_a_status_that_is_no_hello_or_ready_is_refused_clearly(payload, said):
    hs = machine()
    with pytest.raises(HandshakeRefused) as refused:
        hs.on_status(ident(0), payload)
    message = str(refused.value)
    assert message.startswith("the engine sent ") and "which is no vLLM HELLO or READY" in message
    assert said in message and "'waiting'" in message
    assert hs.states[0] is RankState.WAITING


@pytest.mark.parametrize(("payload", "said"), [
    (b"\xc1", "undecodable vLLM ready response"),
    (msgspec.msgpack.encode(["max_model_len", 1024]), "Expected `object`, got `array`"),
    (msgspec.msgpack.encode({"max_model_len": "long"}), "Expected `int`, got `str` - at `$.max_model_len`"),
])  # fmt: skip
def test_a_ready_response_the_wire_cannot_read_is_refused_clearly(payload, said):
    hs = machine()
    hs.on_status(ident(0), HELLO)
    with pytest.raises(HandshakeRefused, match="the engine sent a ready response vLLM's wire cannot read") as refused:
        hs.on_ready_response(ident(0), payload)
    assert said in str(refused.value)


def test_unknown_keys_of_a_newer_engine_are_ignored():
    hs = machine()
    hs.on_status(ident(0), status("HELLO", newer_key=1))
    payload = msgspec.msgpack.encode({**msgspec.to_builtins(vllm.ReadyResponse(vllm_version="0.32.0")), "newer": [1]})
    [record] = hs.on_ready_response(ident(0), payload)
    assert "newer" not in record.message and record.message["vllm_version"] == "0.32.0"


def test_anything_after_the_handshake_is_refused():
    hs = machine()
    _feed(hs, 0, [("status", HELLO), ("response", ready()), ("status", READY)])
    with pytest.raises(HandshakeRefused, match="after its handshake was done"):
        hs.on_status(ident(0), READY)


def test_a_huge_message_is_quoted_short():
    hs = machine()
    payload = msgspec.msgpack.encode({"status": "x" * 100_000})
    with pytest.raises(HandshakeRefused) as refused:
        hs.on_status(ident(0), payload)
    assert len(str(refused.value)) < 600 and f"({len(payload)} bytes)" in str(refused.value)


def test_is_hello_is_what_the_gate_asks_where_the_pid_is_unknown():
    hs = machine()
    assert hs.is_hello(HELLO)
    assert not hs.is_hello(READY) and not hs.is_hello(b"junk") and not hs.is_hello(msgspec.msgpack.encode({}))


def test_a_handshake_needs_a_rank():
    with pytest.raises(ValueError):
        machine(ranks=())


# -- another engine's wire: the machine is the same ------------------------------------------------


class OtherReady(msgspec.Struct, kw_only=True):
    """A vLLM-like ready response with keys of its own (as TokenSpeed's: prefix_granularity)."""

    vllm_version: str
    max_model_len: int
    prefix_granularity: int


class OtherHandshake:
    """A second wire: its own ready-response struct and version prefix, the same HELLO/READY words."""

    engine = "Other"

    @staticmethod
    def identity(rank: int) -> bytes:
        return bytes([rank, 0])

    @staticmethod
    def decode_status(payload: bytes):
        try:
            message = msgspec.msgpack.decode(payload, type=vllm.HandshakeStatus)
        except msgspec.DecodeError as error:
            raise WireError(str(error)) from None
        return HandshakeStep(message.status), message

    @staticmethod
    def encode_init(inputs, outputs) -> bytes:
        return msgspec.msgpack.encode({"addresses": {"inputs": list(inputs), "outputs": list(outputs)}})

    @staticmethod
    def decode_ready(payload: bytes) -> OtherReady:
        try:
            return msgspec.msgpack.decode(payload, type=OtherReady)
        except msgspec.DecodeError as error:
            raise WireError(str(error)) from None

    @staticmethod
    def facts(ready: OtherReady) -> dict:
        return {"vllm_version": ready.vllm_version, "max_model_len": ready.max_model_len,
                "block_size": ready.prefix_granularity}  # fmt: skip

    @staticmethod
    def version(ready: OtherReady) -> str:
        return ready.vllm_version.removeprefix("other-")

    @staticmethod
    def foreign(version: str) -> str | None:
        return None


def test_another_wire_runs_the_same_machine():
    hs = EngineHandshake(OtherHandshake(), (0, 1), [IN], [OUT], expected_version="1.0")
    other_ready = lambda v: msgspec.msgpack.encode({"vllm_version": v, "max_model_len": 64, "prefix_granularity": 32})  # noqa: E731
    _feed(hs, 0, [("status", HELLO), ("status", READY), ("response", other_ready("other-1.0"))])
    *_, done = _feed(hs, 1, [("status", HELLO), ("response", other_ready("other-1.1")), ("status", READY)])
    assert done.ready[0] == {"vllm_version": "other-1.0", "max_model_len": 64, "block_size": 32}
    assert done.incompatible == ("DP rank 1: the engine's ready response says Other 1.1, "
                                 "but the launch check verified Other 1.0: the engine runs from another installation")
    with pytest.raises(HandshakeRefused, match="the engine sent a ready response Other's wire cannot read"):
        hs2 = EngineHandshake(OtherHandshake(), (0,), [IN], [OUT])
        hs2.on_status(b"\x00\x00", HELLO)
        hs2.on_ready_response(b"\x00\x00", ready())  # vLLM's response lacks prefix_granularity


def test_the_codec_registry_gives_each_wire_its_handshake():
    assert isinstance(codecs.handshake("vllm"), vllm.VllmHandshake)
    with pytest.raises(KeyError, match="unknown engine wire 'mlx'"):
        codecs.handshake("mlx")
