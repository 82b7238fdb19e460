"""Every contract's hand-encoded stream chunk is the bytes its protobuf path writes for the same call state.

The hub's fast path writes a one-choice streaming call's new tokens with its
edge's ``chunk_body(call, choice, tokens)`` (``runtime/requests/chunk_bytes.py``)
instead of building a ``GenerateResponse``; a client must not be able to
tell. Here, for vLLM, SGLang, TokenSpeed and MLX: the bytes equal
``SerializeToString`` of what the same call would have sent through
``take`` / ``encode`` (TokenSpeed's stamped with its id), over random and
edge values (varint widths 1-5 bytes, zeros, uint32's largest id, unicode
and long request ids); and through a real hub, a streamed call's chunks go
as bytes and read back as the contract's running counts.
"""

from __future__ import annotations

import asyncio
import importlib
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, assume, example, given, settings, strategies as st

from enginelink.machines.link import LinkEvent, LinkMachine
from enginelink.machines.request_call import Call
from enginelink.runtime.errors import ClientError
from enginelink.runtime.contracts.shared.call_stamp import CallStamp
from enginelink.runtime.requests.hub import RequestHub
from enginelink.runtime.requests.validate import EngineLimits
from enginelink.wire.engine import FinishReason, OutputBatch
from enginelink.wire.vllm import VllmCodec
from tests.harness import ListJournal

LIMITS = EngineLimits(max_model_len=4096, vocab_size=1 << 20, eos_token_ids=(2,))
UINT32_MAX = (1 << 32) - 1
# Each varint width's edges (the encoder writes up to 3 bytes without a loop).
EDGES = [0, 1, 127, 128, 16383, 16384, 2097151, 2097152, 268435455, 268435456, UINT32_MAX]

# contract -> (its wing's edge, its pb module, the max-tokens field)
CONTRACTS = {
    "vllm": ("VLLM_EDGE", "vllm_engine_pb2", "max_tokens"),
    "sglang": ("SGLANG_EDGE", "sglang_scheduler_pb2", "max_new_tokens"),
    "tokenspeed": ("TOKENSPEED_EDGE", "tokenspeed_scheduler_pb2", "max_new_tokens"),
    "mlx": ("MLX_EDGE", "mlx_engine_pb2", "max_tokens"),
}
# The contracts whose every response repeats the call's request_id (runtime/contracts/shared/call_stamp.py).
STAMPED = ("sglang", "tokenspeed")


def contract(name: str):
    edge, messages, max_field = CONTRACTS[name]
    edge = getattr(importlib.import_module(f"enginelink.runtime.contracts.{name}.edge"), edge)
    pb = importlib.import_module(f"smg_grpc_proto.generated.{messages}")
    return edge, pb, max_field


def request(name: str, request_id: str, prompt: list[int], max_tokens: int = 8):
    _, pb, max_field = contract(name)
    return pb.GenerateRequest(request_id=request_id, tokenized=pb.TokenizedInput(input_ids=prompt),
                              sampling_params=pb.SamplingParams(**{max_field: max_tokens}), stream=True)


def protobuf_bytes(name: str, call: Call) -> list[bytes]:
    """What the call's pending tokens become through the core's ``take`` and the edge's ``encode``."""
    edge, _, _ = contract(name)
    messages = edge.encode(call.take_messages())
    if name in STAMPED:  # their gRPC handler stamps each message with the call's id (service_common.py)
        stamp = CallStamp(call.spec.request_id, True).stamp
        messages = [stamp(m) for m in messages]
    return [m.SerializeToString() for m in messages]


uint32 = st.one_of(st.sampled_from(EDGES), st.integers(0, UINT32_MAX), st.integers(0, 300))
request_ids = st.one_of(
    st.sampled_from(["r", "chatcmpl-0123456789abcdef", "é", "请求-🚀", "x" * 127, "x" * 128, "ü" * 200]),
    st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=300),
)


@pytest.mark.parametrize("name", list(CONTRACTS))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    request_id=request_ids,
    prompt_len=st.integers(1, 300),
    tokens=st.lists(uint32.filter(lambda v: v <= UINT32_MAX), min_size=1, max_size=40),
    prompt_tokens=st.one_of(st.none(), uint32),
    sent=uint32.filter(lambda v: v <= UINT32_MAX - 40),
    cached=uint32,
    index=st.one_of(st.just(0), uint32),
)
@example(request_id="r", prompt_len=1, tokens=[0], prompt_tokens=0, sent=0, cached=0, index=0)
@example(request_id="请求-🚀" * 30, prompt_len=200, tokens=[UINT32_MAX] * 3, prompt_tokens=UINT32_MAX,
         sent=UINT32_MAX - 40, cached=UINT32_MAX, index=UINT32_MAX)
@example(request_id="x" * 128, prompt_len=128, tokens=[127, 128, 16383, 16384, 2097151, 2097152], prompt_tokens=None,
         sent=127, cached=128, index=8)
def test_a_hand_encoded_chunk_is_the_bytes_of_the_protobuf_path(name, request_id, prompt_len, tokens, prompt_tokens,
                                                                  sent, cached, index):
    edge, _, _ = contract(name)
    try:
        spec = edge.validate(request(name, request_id, [5] * prompt_len), LIMITS, 0.0)
    except ClientError:
        assume(False)  # an id the contract refuses never reaches a chunk
    call = Call(spec, 0.0, None, None)
    assert call.plain_one
    # The counts as the core would hold them mid-stream; values beyond a real call's reach the encoder's widths.
    if prompt_tokens is not None:
        call.prompt_tokens = prompt_tokens
    choice = call.choices[0]
    choice.tokens_sent, choice.cached_tokens, choice.index = sent, cached, index
    choice.pending = list(tokens)

    body = edge.chunk_body(call, choice, tokens)
    expected = protobuf_bytes(name, call)
    if name == "mlx" and len(tokens) > 1:  # one message per token there: not hand-encoded
        assert body is None and len(expected) == len(tokens)
    else:
        assert [body] == expected


# -- through the hub ----------------------------------------------------------------------


class Wire:
    """A stream's direct sender as the hub sees it: each message's bytes, and which way it came."""

    def __init__(self, stamp=lambda message: message) -> None:
        self.bodies: list[bytes] = []
        self.ways: list[str] = []
        self.stamp = stamp  # SGLang's and TokenSpeed's sender stamps the id first (service_common.StampedSender)

    def send(self, messages) -> int:
        self.ways += ["protobuf"] * len(messages)
        self.bodies += [self.stamp(m).SerializeToString() for m in messages]
        return len(messages)

    def send_body(self, body: bytes) -> bool:
        self.ways.append("bytes")
        self.bodies.append(body)
        return True

    def send_bodies(self, bodies) -> int:
        bodies = list(bodies)
        self.ways += ["protobuf"] * len(bodies)
        self.bodies += bodies
        return len(bodies)

    def end_ok(self) -> bool:
        return True


def output(request_id: str, tokens: list[int], finish: FinishReason | None = None):
    return SimpleNamespace(request_id=request_id, new_token_ids=tokens,
                           finish_reason=None if finish is None else int(finish), stop_reason=None,
                           kv_transfer_params=None)


def streamed(name: str, request_id: str, frames: list[list[int]]):
    """A call of ``name``'s contract through a hub, the engine's frames as given, its last one finishing."""
    edge, pb, _ = contract(name)
    link = LinkMachine("sim-0", 0.0)
    link.handle(LinkEvent.HANDSHAKE_DONE, 0.0)
    link.handle(LinkEvent.WARMUP_DONE, 0.0)
    hub = RequestHub(link=link, codec=VllmCodec(), send_frames=lambda frames, rank=0: None, journal=ListJournal(),
                     edge=edge)
    total = sum(len(f) for f in frames)
    call = hub.admit(edge.validate(request(name, request_id, [5, 6, 7], total), LIMITS, 0.0), 0.0,
                     wake=asyncio.Event())
    wire = Wire(CallStamp(request_id, True).stamp) if name in STAMPED else Wire()
    call.direct = wire
    engine_id = call.choices[0].engine_id
    for i, tokens in enumerate(frames):
        finish = FinishReason.LENGTH if i == len(frames) - 1 else None
        hub.on_batch(OutputBatch(0, [output(engine_id, tokens, finish)]), 1.0 + i)
    return wire.ways, [pb.GenerateResponse.FromString(b) for b in wire.bodies]


@pytest.mark.parametrize("name", ["sglang", "tokenspeed"])
def test_a_streamed_call_gets_running_counts_from_bytes_then_a_complete(name):
    ways, replies = streamed(name, "ünï-1", [[11], [12, 13], [14]])
    # The finishing frame's chunk goes as bytes with the frame's other chunks (as vLLM's), its complete
    # after them through ``encode`` (``RequestHub._write_rest``).
    assert ways == ["bytes", "bytes", "bytes", "protobuf"]
    chunks = [r.chunk for r in replies[:3]]
    assert [list(c.token_ids) for c in chunks] == [[11], [12, 13], [14]]
    assert [c.completion_tokens for c in chunks] == [1, 3, 4]  # running totals, as the reference's
    assert all(c.prompt_tokens == 3 for c in chunks)
    complete = replies[3].complete
    assert complete.completion_tokens == 4 and list(complete.output_ids) == [14] and complete.finish_reason == "length"
    assert [r.request_id for r in replies] == ["ünï-1"] * 4  # every response names its call, as the references'


def test_mlx_sends_single_tokens_as_bytes_and_a_several_token_chunk_as_one_message_each():
    ways, replies = streamed("mlx", "m-1", [[11], [12, 13], [14], [15]])
    assert ways == ["bytes", "protobuf", "protobuf", "bytes", "bytes", "protobuf"]
    chunks = [r.chunk for r in replies[:5]]
    assert [list(c.token_ids) for c in chunks] == [[11], [12], [13], [14], [15]]
    assert [c.completion_tokens for c in chunks] == [1, 2, 3, 4, 5]
    assert replies[5].complete.completion_tokens == 5
