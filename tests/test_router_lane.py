"""The router's SGLang ZMQ lane, engine side: its codec, the router link machine, the lane's edge.

The ADD below is the one the real router 1.13.0 sent a registered engine for
``POST /v1/completions {"prompt": "hello", "max_tokens": 3}`` (captured on
loopback with ``smg launch --worker-urls ipc://… --backend sglang``): SGLang's
``TokenizedGenerateReqInput`` through ``stream``, ids as a plain list, its
sampling params 32 long (0.5.23's 33 less ``watermark``).
"""

from __future__ import annotations

import msgspec
import pytest

from enginelink.machines.router_link import ROUTER_LINK_TABLE, RouterLink
from enginelink.machines.table import ProtocolError
from enginelink.runtime.errors import ClientError
from enginelink.runtime.contracts.sglang.lane_edge import validate_generate
from enginelink.runtime.requests.validate import EngineLimits
from enginelink.wire import sglang_router as lane
from enginelink.wire import vllm
from enginelink.wire.engine import GenerateSpec, SamplingSpec, WireError
from enginelink.wire.sglang import SglangCodec

ROUTER_ADD = [
    "TokenizedGenerateReqInput", "cmpl-R0g3s8QJII1ualwzB6b565Eh-01a24d01-40d3-7020-bf4c-f64968a0eb81", None, None,
    [282, 78, 333], None, None, None,
    [3, None, None, None, 1.0, 1.0, -1, 0.0, 0.0, 0.0, 1.0, 0, 1, None, None, None, None, None, False, True, True,
     False, None, None, None, None, None, None, 0, 0, False, False],
    False, -1, 0, None, False,
]
LIMITS = EngineLimits(max_model_len=2048, vocab_size=4096, eos_token_ids=(2,))


def frames(kind: bytes, payload) -> list[bytes]:
    return [kind, msgspec.msgpack.encode(payload)]


def test_the_routers_add_decodes_to_sglangs_meaning():
    request = lane.decode_request(frames(lane.ADD, ROUTER_ADD))
    assert request.rid == ROUTER_ADD[1] and request.input_ids == [282, 78, 333] and request.stream is False
    sp = request.sampling_params
    assert (sp.max_new_tokens, sp.temperature, sp.top_p, sp.top_k, sp.n, sp.skip_special_tokens) == (3, 1.0, 1.0, -1, 1, True)
    call = validate_generate(request, LIMITS, 0.0)
    (spec,) = call.specs
    assert spec.prompt_token_ids == [282, 78, 333] and spec.sampling.max_tokens == 3 and spec.sampling.top_k == 0
    assert call.engine_ids == [ROUTER_ADD[1]] and not call.stream


def test_sglangs_own_full_request_decodes_too():
    """A whole 0.5.23 request (what SGLang's own front end sends: 49 fields, ids as its array extension)."""
    spec = GenerateSpec(request_id="r1", prompt_token_ids=[5, 6, 7], sampling=SamplingSpec(max_tokens=4, temperature=0.0))
    (payload,) = SglangCodec().encode_add(spec)
    request = lane.decode_request([lane.ADD, payload])
    call = validate_generate(request, LIMITS, 0.0)
    assert call.specs[0].prompt_token_ids == [5, 6, 7] and call.specs[0].sampling.top_k == 1  # greedy, as normalised


def test_aborts_controls_and_what_cannot_be_read():
    assert lane.decode_request(frames(lane.ABORT, ["a", "b"])) == lane.AbortRequest(["a", "b"])
    assert lane.decode_request(frames(lane.CONTROL, [7, "flush_cache", [0.0]])) == lane.ControlRequest(7, "flush_cache", [0.0])
    for bad in ([lane.ADD], [b"\x09", b"\x90"], [lane.ADD, b"\xc1"], frames(lane.ABORT, {"x": 1})):
        with pytest.raises(WireError):
            lane.decode_request(bad)
    broken = ["TokenizedGenerateReqInput", "rid-9", None, None, [1], None, None, None, "not sampling params"]
    with pytest.raises(WireError):
        lane.decode_request(frames(lane.ADD, broken))
    assert lane.request_id_of(frames(lane.ADD, broken)) == "rid-9"  # still answered, by id


@pytest.mark.parametrize("field, value, words", [
    ("n", 2, "sampling_params.n: n=2 is not served on this wire; SMG fans out n > 1 itself"),
    ("ids", [], "input_ids: input_ids are required on this wire"),
    ("ids", [5000], "input_ids: token id 5000 at position 0 is outside the vocabulary (size 4096)"),
    ("start", 0, "logprob_start_len: prompt logprobs are not served on this wire; send -1"),
    # Decoded, not forwarded: served as text alone they would answer another question, so refused by name.
    ("mm", ["MultimodalProcessorOutput", [["MultimodalDataItem", "image"]]],
     "mm_inputs: is not forwarded to the scheduler on this wire by enginelink headless (it would be served as text "
     "alone); send it through the gRPC lane (--connection-mode grpc)"),
    ("embeds", [[0.5, 0.25]], "input_embeds: is not forwarded to the scheduler on this wire"),
    ("types", [0, 0, 1], "token_type_ids: is not forwarded to the scheduler on this wire"),
])
def test_the_lanes_refusals_name_the_field(field, value, words):
    payload = [*ROUTER_ADD]
    payload[8] = [*ROUTER_ADD[8]]
    if field == "n":
        payload[8][12] = value
    elif field == "ids":
        payload[4] = value
    elif field in ("embeds", "mm", "types"):
        payload[{"embeds": 5, "mm": 6, "types": 7}[field]] = value
    else:
        payload[10] = value
    with pytest.raises(ClientError) as caught:
        validate_generate(lane.decode_request(frames(lane.ADD, payload)), LIMITS, 0.0)
    assert str(caught.value).startswith(words)


def test_rows_go_out_as_the_reference_columns_with_the_load_tail():
    rows = [lane.Row("a", [5, 6], prompt_tokens=3, completion_tokens=2),
            lane.Row("b", [], finish="abort", message="no room", status=400)]
    raw = msgspec.msgpack.decode(lane.encode_rows(rows, lane.Load(engine_index=1, num_running=2, kv_total_tokens=99)))
    assert raw[0] == "BatchTokenIDSlimOutput" and raw[1] == ["a", "b"] and raw[2] == [[5, 6], []]
    assert raw[3] == ["", "abort"] and raw[4] == [None, "no room"]
    assert raw[11:16] == [1, 2, 0, 0, 99]  # engine_index, num_running, num_waiting, kv_used, kv_total
    assert raw[16] == [None, 400]  # finished_status
    decoded = lane.decode_output(lane.encode_rows(rows, lane.Load()))
    assert decoded.rids == ["a", "b"] and decoded.finished_status == [None, 400]
    reply = lane.decode_output(lane.encode_control_reply(7, False, "busy", 0))
    assert reply == lane.ControlReplySlim(call_id=7, success=False, message="busy", engine_index=0)


def _init(inputs=("ipc:///x-in.sock",), outputs=("ipc:///x-out.sock",)) -> bytes:
    return msgspec.msgpack.encode({"addresses": {"inputs": list(inputs), "outputs": list(outputs),
                                                 "coordinator_input": None, "coordinator_output": None,
                                                 "frontend_stats_publish_address": None}, "parallel_config": {}})


def test_the_router_link_registers_in_its_tables_order():
    link = RouterLink(3, lane.ReadyResponse(max_model_len=2048, vllm_version="sglang-0.5.23"))
    assert link.identity == b"\x03\x00" and link.name == "router-3"
    hello, first = link.dial()
    assert lane.decode_status(hello).status == "HELLO" and (first.source, first.dest) == ("waiting", "dialing")
    registration, second = link.on_init(_init())
    assert (second.source, second.dest) == ("dialing", "registered") and link.registered
    assert registration.inputs == "ipc:///x-in.sock" and lane.decode_status(registration.ready).status == "READY"
    assert lane.decode_ready_response(registration.ready_response).vllm_version == "sglang-0.5.23"
    with pytest.raises(ProtocolError, match="router 'router-3': event 'init' is not allowed in state 'registered'"):
        link.on_init(_init())
    assert (link.close().dest, link.close()) == ("closed", None)
    for source, event in ROUTER_LINK_TABLE.steps:
        assert ROUTER_LINK_TABLE.allows(source, event)


def test_an_init_without_addresses_fails_the_link():
    link = RouterLink(0, lane.ReadyResponse())
    link.dial()
    registration, transition = link.on_init(_init(inputs=()))
    assert registration is None and transition.dest == "failed" and "named no data addresses" in link.failure
    with pytest.raises(WireError):
        RouterLink(0, lane.ReadyResponse()).on_init(b"\xc1")
    assert vllm.decode_handshake_init(_init()).addresses.outputs == ["ipc:///x-out.sock"]
