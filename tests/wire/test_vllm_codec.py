"""The vLLM wire codec: both directions, short arrays, handshake, errors."""

from __future__ import annotations

import msgspec
import pytest

from enginelink.wire import codecs, vllm, vllm_layout
from enginelink.wire.engine import (
    EngineDead,
    GenerateSpec,
    OutputBatch,
    SamplingSpec,
    SchedulerStats,
    UtilityReply,
    WireError,
)

pack = msgspec.msgpack.encode
unpack = msgspec.msgpack.decode


def spec(**sampling) -> GenerateSpec:
    sampling.setdefault("max_tokens", 8)
    return GenerateSpec(
        request_id="r1", prompt_token_ids=[1, 2, 3], sampling=SamplingSpec(**sampling), arrival_time=1795942765.75
    )


def test_registry_gives_the_vllm_codec():
    codec = codecs.get("vllm")
    assert isinstance(codec, vllm.VllmCodec) and codec.name == "vllm"
    assert "vllm" in codecs.NAMES
    with pytest.raises(KeyError, match="known: vllm"):
        codecs.get("nope")


def test_add_is_a_22_element_array_like_vllms_own():
    frames = vllm.VllmCodec().encode_add(spec(temperature=0.0, ignore_eos=True, eos_token_ids=(2,)))
    assert frames[0] == b"\x00"
    body = unpack(frames[1])
    assert len(body) == 22
    assert body[:3] == ["r1", [1, 2, 3], None]
    assert body[4:] == [None, 1795942765.75, None, None, None, None, None, 0, 0, 0,
                        None, False, None, None, None, False, None, None]  # fmt: skip


def test_sampling_map_for_greedy_ignore_eos_is_exact():
    frames = vllm.VllmCodec().encode_add(spec(temperature=0.0, ignore_eos=True, eos_token_ids=(2,)))
    sampling = unpack(frames[1])[3]
    # vLLM's own front end minus the keys it adds for detokenizing (stop,
    # bad_words, ...): no _eos_token_id under ignore_eos, but the EOS id stays
    # in _all_stop_token_ids for the min_tokens mask.
    assert list(sampling.items()) == [
        ("temperature", 0.0),
        ("ignore_eos", True),
        ("max_tokens", 8),
        ("output_kind", 1),
        ("_all_stop_token_ids", [2]),
    ]


def test_sampling_map_with_eos_and_stop_ids():
    sampling = unpack(vllm.VllmCodec().encode_add(spec(eos_token_ids=(2, 7), stop_token_ids=(9,), seed=5))[1])[3]
    assert sampling == {
        "seed": 5,
        "stop_token_ids": [9, 7],  # further EOS ids become stop ids
        "max_tokens": 8,
        "output_kind": 1,
        "_eos_token_id": 2,
        "_all_stop_token_ids": [2, 7, 9],
    }


def test_sampling_map_carries_non_defaults_and_kv_transfer_params():
    s = GenerateSpec(
        request_id="r",
        prompt_token_ids=[1],
        sampling=SamplingSpec(max_tokens=4, top_k=5, min_tokens=2, logit_bias={3: -1.5}, skip_special_tokens=False),
        kv_transfer_params={"do_remote_decode": True},
    )
    sampling = unpack(vllm.VllmCodec().encode_add(s)[1])[3]
    assert sampling == {
        "top_k": 5,
        "max_tokens": 4,
        "min_tokens": 2,
        "skip_special_tokens": False,
        "output_kind": 1,
        "logit_bias": {3: -1.5},
        "extra_args": {"kv_transfer_params": {"do_remote_decode": True}},
    }


def test_add_round_trips_through_the_engine_side():
    s = spec(temperature=0.5, eos_token_ids=(2,), stop_token_ids=(11,), min_tokens=1)
    frames = vllm.VllmCodec().encode_add(s)
    match vllm.decode_input(frames[0], frames[1]):
        case vllm.AddRequest(request=req):
            pass
    assert req.request_id == "r1" and req.prompt_token_ids == [1, 2, 3] and req.arrival_time == 1795942765.75
    p = req.sampling_params
    assert (p.temperature, p.eos_token_id, p.stop_token_ids, p.min_tokens, p.max_tokens) == (0.5, 2, [11], 1, 8)
    assert p.all_stop_token_ids == [2, 11] and p.output_kind == vllm.OUTPUT_KIND_DELTA


def test_nine_element_request_decodes_with_defaults():
    sampling = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    body = pack(["r9", [5, 6], None, sampling, None, 1.0, None, None, None])
    req = vllm.decode_input(vllm.REQ_ADD, body).request
    assert req.request_id == "r9" and req.client_index == 0 and req.kv_hints is None and req.priority == 0
    assert req.sampling_params.ignore_eos and req.sampling_params.eos_token_id is None


def test_request_from_vllms_own_front_end_decodes():
    # Keys we do not model (stop, bad_words, ...) are ignored.
    sampling = {"temperature": 0.0, "stop": [], "stop_token_ids": [], "ignore_eos": True, "max_tokens": 8,
                "output_kind": 1, "_all_stop_token_ids": [2], "bad_words": [],
                "skip_reading_prefix_cache": False}  # fmt: skip
    body = ["r1", [1, 2, 3], None, sampling, None, 1795942765.75, None, None, None, None, None, 0, 0, 0, None,
            False, None, None, None, False, None, None]  # fmt: skip
    req = vllm.decode_input(vllm.REQ_ADD, pack(body)).request
    assert req.sampling_params.max_tokens == 8 and req.sampling_params.all_stop_token_ids == [2]


def test_abort_and_utility_round_trip():
    codec = vllm.VllmCodec()
    t, payload = codec.encode_abort(("a", "b"))
    assert t == b"\x01" and unpack(payload) == ["a", "b"]
    assert vllm.decode_input(t, payload) == vllm.AbortRequest(["a", "b"])
    t, payload = codec.encode_utility(12345, "reset_prefix_cache", (False, False))
    assert t == b"\x03" and unpack(payload) == [0, 12345, "reset_prefix_cache", [False, False]]
    assert vllm.decode_input(t, payload) == vllm.UtilityCall(0, 12345, "reset_prefix_cache", [False, False])


@pytest.mark.parametrize("bad", [(b"\x02", pack([0, 0])), (b"\x00", pack(["r", [1]])), (b"\x01", b"\xc1")])
def test_engine_side_rejects_bad_input(bad):
    with pytest.raises(WireError):
        vllm.decode_input(*bad)


def _step_outputs() -> vllm.EngineCoreOutputs:
    first = vllm.EngineCoreOutput(
        "a", [4009], events=[vllm.EngineCoreEvent(1, 3.0)], prefill_stats=vllm.PrefillStats(40, 8, 32, 32, 0)
    )
    last = vllm.EngineCoreOutput("b", [2], finish_reason=0, stop_reason=None)
    stats = vllm.WireSchedulerStats(
        num_running_reqs=1, num_waiting_reqs=2, step_counter=7, kv_cache_usage=0.25,
        prefix_cache_stats=vllm.PrefixCacheStats(requests=1, queries=40, hits=32),
    )  # fmt: skip
    return vllm.EngineCoreOutputs(0, [first, last], stats, timestamp=2074.5, finished_requests=["b"])


def test_outputs_round_trip_into_an_output_batch():
    frames = vllm.encode_outputs(_step_outputs())
    assert len(frames) == 1 and len(unpack(frames[0])) == 9  # msgspec writes every field
    batch = vllm.VllmCodec().decode_output(frames)
    assert isinstance(batch, OutputBatch)
    assert batch.engine_index == 0 and batch.timestamp == 2074.5 and batch.finished_requests == ["b"]
    a, b = batch.outputs
    assert isinstance(a, vllm.EngineCoreOutput)  # the decoded struct itself, no copy
    assert (a.request_id, a.new_token_ids, a.finish_reason) == ("a", [4009], None)
    assert vllm.cached_tokens(a) == 32 and vllm.cached_tokens(b) is None
    assert (b.finish_reason, b.stop_reason) == (0, None)
    assert batch.stats == SchedulerStats(
        num_running_reqs=1, num_waiting_reqs=2, kv_cache_usage=0.25,
        prefix_cache_queries=40, prefix_cache_hits=32, step_counter=7,
    )  # fmt: skip
    assert batch.utility is None


def test_short_outputs_arrays_fill_defaults():
    codec = vllm.VllmCodec()
    batch = codec.decode_output([pack([0, [["r", [5]]], None, 12.5])])
    (out,) = batch.outputs
    assert (out.new_token_ids, out.finish_reason, out.num_nans_in_logits, out.prefill_stats) == ([5], None, 0, None)
    assert batch.stats is None and batch.timestamp == 12.5
    batch = codec.decode_output([pack([1, [["r", [2], None, None, None, 0, 2]]]), b"aux"])
    assert batch.engine_index == 1 and batch.timestamp == 0.0 and batch.finished_requests is None
    assert (batch.outputs[0].finish_reason, batch.outputs[0].stop_reason) == (0, 2)


def test_utility_reply_decodes():
    raw = pack([0, [], None, 2074.14, [12345, None, [None, True]], None, None, None, None])
    assert vllm.VllmCodec().decode_output([raw]).utility == UtilityReply(12345, None, True)
    failed = vllm.encode_outputs(
        vllm.EngineCoreOutputs(0, [], utility_output=vllm.utility_failure(9, "nope", "boom"))
    )
    assert vllm.VllmCodec().decode_output(failed).utility == UtilityReply(9, "Call to nope method failed: boom", None)


def test_dead_frame():
    assert vllm.VllmCodec().decode_output([b"ENGINE_CORE_DEAD"]) == EngineDead()
    assert vllm.encode_dead() == [b"ENGINE_CORE_DEAD"]


@pytest.mark.parametrize(
    "frames",
    [[], [b""], [b"\xc1garbage"], [pack("hello")], [pack([0])], [pack(["x", []])], [pack([0, [[1, [2]]]])]],
)
def test_garbage_is_a_wire_error(frames):
    with pytest.raises(WireError):
        vllm.VllmCodec().decode_output(frames)


def test_handshake_messages_both_sides():
    hello = vllm.encode_handshake_status(vllm.HandshakeStatus(status="HELLO", local=False, headless=True))
    assert hello == pack({"status": "HELLO", "local": False, "headless": True})
    assert vllm.decode_handshake_status(hello).status == "HELLO"
    ready = pack({"status": "READY", "local": False, "headless": True, "parallel_config_hash": "h"})
    assert vllm.decode_handshake_status(ready).parallel_config_hash == "h"
    with pytest.raises(WireError):
        vllm.decode_handshake_status(pack({"status": "BYE"}))

    init = vllm.HandshakeInit(addresses=vllm.HandshakeAddresses(inputs=["tcp://a:1"], outputs=["tcp://a:2"]))
    payload = vllm.encode_handshake_init(init)
    assert unpack(payload) == {
        "addresses": {"inputs": ["tcp://a:1"], "outputs": ["tcp://a:2"], "coordinator_input": None,
                      "coordinator_output": None, "frontend_stats_publish_address": None},
        "parallel_config": {},
    }  # fmt: skip
    assert vllm.decode_handshake_init(payload) == init


def test_ready_response_has_the_25_keys_in_order():
    payload = vllm.encode_ready_response(vllm.ReadyResponse(max_model_len=1024, vllm_version="0.32.0"))
    keys = list(unpack(payload))
    assert len(keys) == 25
    assert keys[:6] == ["max_model_len", "num_gpu_blocks", "block_size", "dp_stats_address", "dtype", "vllm_version"]
    assert keys[-1] == "effective_attention_block_size"
    partial = vllm.decode_ready_response(pack({"max_model_len": 64, "vllm_version": "0.31.0", "extra": 1}))
    assert (partial.max_model_len, partial.vllm_version, partial.block_size) == (64, "0.31.0", 16)


def test_the_canonical_structs_are_vllm_0_32_0s_layout():
    """wire/vllm.py declares 0.32.0's structs; its layout file (read from the wheel) must agree."""
    layout = vllm_layout.load(vllm.VLLM_VERSION)

    def names(struct: str) -> list[str]:
        return [f["name"] for f in layout["structs"][struct]["fields"]]

    for ours, theirs in ((vllm.EngineCoreRequest, "EngineCoreRequest"), (vllm.EngineCoreOutput, "EngineCoreOutput"),
                         (vllm.EngineCoreOutputs, "EngineCoreOutputs"), (vllm.PoolingParams, "PoolingParams"),
                         (vllm.UtilityOutput, "UtilityOutput")):
        assert [f.encode_name for f in msgspec.structs.fields(ours)] == names(theirs), theirs
    assert len(names("EngineCoreRequest")) == 22 and names("EngineCoreRequest")[-1] == "kv_hints"
    assert sum(f["required"] for f in layout["structs"]["EngineCoreRequest"]["fields"]) == 9
    assert names("EngineCoreOutput")[5:7] == ["finish_reason", "stop_reason"]
    assert "_eos_token_id" in names("SamplingParams") and "eos_token_id" not in names("SamplingParams")
    assert layout["enums"]["FinishReason"] == {"STOP": 0, "LENGTH": 1, "ABORT": 2, "ERROR": 3, "REPETITION": 4}
    assert [f["name"] for f in layout["structs"]["EngineCoreReadyResponse"]["fields"]] == list(
        vllm.ReadyResponse.__struct_fields__)


def test_stats_map_with_nulls_and_unknown_keys_decodes():
    stats = {"num_running_reqs": 3, "num_waiting_reqs": 0, "num_kv_fetch_reqs_by_stage": {"x": 1},
             "iteration_details": None, "kv_cache_usage": 0.5, "prefix_cache_stats": None,
             "kv_cache_eviction_events": None, "ec_connector_stats": None}  # fmt: skip
    batch = vllm.VllmCodec().decode_output([pack([0, [], stats, 1.0])])
    assert batch.stats == SchedulerStats(num_running_reqs=3, kv_cache_usage=0.5)
