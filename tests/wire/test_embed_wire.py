"""Embed on the vLLM wire: pooling params out, pooled tensors (inline and aux frames) back."""

from __future__ import annotations

import array
import copy
import struct

import msgspec
import pytest

from enginelink.wire import vllm, vllm_arrays, vllm_layout, vllm_release
from enginelink.wire.engine import GenerateSpec, PoolingSpec, SamplingSpec, WireError
from enginelink.wire.vllm_arrays import ArrayWriter, Tensor, decode_tensor

pack = msgspec.msgpack.encode
unpack = msgspec.msgpack.decode

# What vLLM 0.32's own front end (LLM.embed on the test model, --runner pooling
# --convert embed) put on the wire for prompt [5, 6, 7, 8]: captured from
# SyncMPClient.add_request with vLLM's MsgpackEncoder.
VLLM_EMBED_REQUEST = bytes.fromhex(
    "dc0016aa302d62343133383531309405060708c0c09ac3c0c0c0a5656d626564c2c2c0c002cb41dac3b42b736333"
    "c0c0c0c0c0000000c0c2a130c0c0c2c0c0"
)
# vLLM 0.32's PoolingParams fields, in order (vllm/pooling_params.py).
VLLM_POOLING_FIELDS = [
    "use_activation", "dimensions", "step_tag_id", "returned_token_ids", "task", "requires_token_ids",
    "skip_reading_prefix_cache", "late_interaction_params", "extra_kwargs", "output_kind",
]


def embed_spec(request_id: str = "0-b4138510") -> GenerateSpec:
    return GenerateSpec(request_id=request_id, prompt_token_ids=[5, 6, 7, 8], sampling=SamplingSpec(max_tokens=1),
                        arrival_time=1.5, pooling=PoolingSpec())


def test_embed_request_is_what_vllms_front_end_sends():
    (kind, payload) = vllm.VllmCodec().encode_add(embed_spec())
    assert kind == vllm.REQ_ADD
    ours, theirs = unpack(payload), unpack(VLLM_EMBED_REQUEST)
    assert len(ours) == len(theirs) == 22
    assert ours[3] is None and theirs[3] is None  # no sampling params
    assert ours[4] == theirs[4] == [True, None, None, None, "embed", False, False, None, None, 2]
    assert pack(ours[4]) == pack(theirs[4])
    # The rest as for Generate: the prompt, no lora/cache salt/dp rank; ids and times differ by run.
    assert ours[1] == theirs[1] == [5, 6, 7, 8]
    assert ours[6:16] == theirs[6:16]


def test_vllms_embed_request_decodes_on_the_engine_side():
    add = vllm.decode_input(vllm.REQ_ADD, VLLM_EMBED_REQUEST)
    assert add.request.sampling_params is None
    pooling = add.request.pooling_params
    assert (pooling.task, pooling.use_activation, pooling.output_kind) == ("embed", True, vllm.OUTPUT_KIND_FINAL_ONLY)


def test_a_generate_request_still_carries_no_pooling_params():
    spec = GenerateSpec(request_id="g", prompt_token_ids=[5], sampling=SamplingSpec(max_tokens=3))
    decoded = unpack(vllm.VllmCodec().encode_add(spec)[1])
    assert decoded[4] is None and decoded[3]["max_tokens"] == 3


def test_layout_declares_vllms_pooling_fields_and_a_move_is_spoken_by_name():
    layout = vllm_layout.load("0.32.0")
    assert [f["name"] for f in layout["structs"]["PoolingParams"]["fields"]] == VLLM_POOLING_FIELDS
    assert [f.name for f in msgspec.structs.fields(vllm.PoolingParams)] == VLLM_POOLING_FIELDS
    # A release that swaps two pooling fields gets them swapped on the wire: values go by name.
    moved = copy.deepcopy(layout)
    fields = moved["structs"]["PoolingParams"]["fields"]
    fields[0], fields[1] = fields[1], fields[0]
    (_, payload) = vllm.VllmCodec(release=vllm_release.for_layout(moved)).encode_add(embed_spec())
    assert unpack(payload)[4] == [None, True, None, None, "embed", False, False, None, None, 2]
    # A release whose pooling params need a field enginelink does not know cannot be spoken.
    fields.insert(3, {"name": "new_required", "required": True})
    assert vllm_release.speakable(moved) == [
        "PoolingParams field 'new_required' is required in vLLM 0.32.0; enginelink does not know it"]


def outputs_with(pooled, writer: ArrayWriter | None = None) -> list[bytes]:
    out = vllm.EngineCoreOutputs(0, [vllm.EngineCoreOutput("e1", [], pooling_output=pooled, finish_reason=0)])
    return vllm.encode_outputs(out, writer)


def float32_tensor(values, writer: ArrayWriter) -> list:
    """A 1-D float32 tensor as vLLM (and the sim engine) writes a pooled vector."""
    return writer.array("float32", [len(values)], values)


@pytest.mark.parametrize("dim, frames", [(8, 1), (63, 1), (64, 2), (4096, 2)])
def test_pooled_float32_inline_or_in_an_aux_frame_decodes_exactly(dim, frames):
    values = [(i - dim / 2) / 7.0 for i in range(dim)]
    writer = ArrayWriter()
    message = outputs_with(float32_tensor(values, writer), writer)
    assert len(message) == frames  # under 256 bytes inline (vLLM's threshold), else an aux frame
    batch = vllm.VllmCodec().decode_output(message)
    (out,) = batch.outputs
    assert out.finish_reason == 0 and out.new_token_ids == []
    assert out.pooling_output.shape == (dim,)
    assert out.pooling_output.floats() == array.array("f", values).tolist()


def test_tensors_as_torch_writes_them():
    """torch's dtype names and memory layouts, written by hand: float32, float16, bfloat16, 2-D."""
    ext = msgspec.msgpack.Ext
    assert decode_tensor(["float16", [3], ext(3, struct.pack("<3e", 1.0, -2.5, 0.0999755859375))], []).floats() == [
        1.0, -2.5, 0.0999755859375]  # a half float exactly
    bf16 = b"".join(struct.pack("<f", v)[2:] for v in (1.0, -0.5, 3.0))  # the high halves
    assert decode_tensor(["bfloat16", [3], ext(3, bf16)], []).floats() == [1.0, -0.5, 3.0]
    two_d = decode_tensor(["float32", [2, 2], 1], [b"", struct.pack("<4f", 1, 2, 3, 4)])
    assert two_d.shape == (2, 2) and two_d.floats() == [1.0, 2.0, 3.0, 4.0]
    assert decode_tensor(["<f4", [1], ext(3, struct.pack("<f", 0.5))], []).floats() == [0.5]  # a numpy array


def test_a_replay_without_the_aux_frames_still_decodes():
    """The journal keeps frame 0 only: the fold decodes it, the values are simply absent."""
    writer = ArrayWriter()
    message = outputs_with(float32_tensor([0.25] * 256, writer), writer)
    (out,) = vllm.VllmCodec().decode_output(message[:1]).outputs
    assert out.finish_reason == 0 and out.pooling_output.data is None
    with pytest.raises(WireError, match="extra frame"):
        out.pooling_output.floats()


@pytest.mark.parametrize(
    "bad, words",
    [
        (["float32", [2]], "must be \\[dtype, shape, data\\]"),
        ("float32", "must be \\[dtype, shape, data\\]"),
        (["complex64", [2], 1], "dtype 'complex64' is not one enginelink reads"),
        (["float32", [-1], 1], "shape"),
        (["float32", "2", 1], "shape"),
        (["float32", [1 << 13, 1 << 12], 1], "over"),
        (["float32", [2], msgspec.msgpack.Ext(1, b"pickle")], "Ext type 1"),
        (["float32", [2], 0], "frame 0 is the message"),
        (["float32", [2], {"handle": 1}], "out of band"),
        (["float32", [2], "bytes"], "raw bytes or a frame index"),
        (["float32", [2], True], "raw bytes or a frame index"),
    ],
)
def test_a_tensor_that_does_not_read_is_the_engines_fault(bad, words):
    with pytest.raises(WireError, match=words):
        vllm.VllmCodec().decode_output([*outputs_with(bad), b"\0" * 8])


def test_bytes_that_do_not_match_the_shape_are_refused_when_read():
    tensor = decode_tensor(["float32", [3], msgspec.msgpack.Ext(3, b"\0" * 8)], [])
    with pytest.raises(WireError, match="has 8 bytes, not 12"):
        tensor.floats()
    assert Tensor("float32", (0,), b"").floats() == []
    assert vllm_arrays.TENSOR_ELEMENTS_MAX >= 1 << 20  # any real model's hidden size fits
