"""vLLM's logprob arrays on the EngineCore wire: both encodings, read without numpy or torch.

The frames here are built by hand, byte for byte, with the layout
``vllm/v1/serial_utils.py`` writes (``[dtype, shape, data]``; data inline as
msgpack Ext 3 under 256 bytes, else the index of a further frame of the same
message), so a mistake in ``wire/vllm_arrays.py`` cannot hide behind the sim
engine writing the same mistake. ``test_real_vllm_encoder_*`` (marked
``vllm``) checks both directions against vLLM 0.32's own encoder and decoder.
"""

from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

import msgspec
import pytest

from enginelink.machines import sim_logprobs
from enginelink.wire import vllm, vllm_arrays
from enginelink.wire.engine import WireError

EXT = msgspec.msgpack.Ext
CODEC = vllm.VllmCodec()


def _f32(values) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def _i32(values) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def _i64(values) -> bytes:
    return struct.pack(f"<{len(values)}q", *values)


def _frames(output: list, aux: list[bytes] = ()) -> list[bytes]:
    """One EngineCoreOutputs message with one output, written with plain msgpack."""
    return [msgspec.msgpack.encode([0, [output], None, 1.0]), *aux]


def _decode(frames):
    batch = CODEC.decode_output(frames)
    (out,) = batch.outputs
    return out, CODEC.logprobs(out, batch.frames)


def test_inline_sample_logprobs_decode_to_their_rows():
    # One new token (17) with k = 2: [17, top1, top2]; 3 x 4 bytes, inline (Ext 3).
    ids, values = [17, 17, 40], [-0.25, -0.25, -1.5]
    output = ["r", [17], [["<i4", [1, 3], EXT(3, _i32(ids))], ["<f4", [1, 3], EXT(3, _f32(values))],
                          ["<i8", [1], EXT(3, _i64([1]))], None]]
    out, (sample, prompt) = _decode(_frames(output))
    assert prompt is None
    assert (sample.rows, sample.cols) == (1, 3)
    assert list(sample.token_ids) == ids
    assert list(sample.logprobs) == values


def test_aux_frame_logprobs_decode_from_the_frames_they_name():
    # k = 100: 101 x 4 = 404 bytes, over vLLM's 256-byte threshold: frames 1 and 2.
    ids = [9] + list(range(100, 200))
    values = [-3.0] + [-0.01 * j for j in range(100)]
    output = ["r", [9], [["<i4", [1, 101], 1], ["<f4", [1, 101], 2], ["<i8", [1], EXT(3, _i64([57]))], None]]
    out, (sample, _) = _decode(_frames(output, [_i32(ids), _f32(values)]))
    assert (sample.rows, sample.cols) == (1, 101)
    assert list(sample.token_ids) == ids
    assert [round(v, 6) for v in sample.logprobs] == [round(v, 6) for v in values]


def test_prompt_logprobs_tensors_use_torch_dtype_names_and_five_elements():
    # Prompt of 4 tokens -> 3 rows of [prompt token, top1] (k = 1); torch names the dtypes.
    ids = [6, 6, 7, 99, 8, 6]
    values = [-0.5, -0.5, -2.0, -1.0, -0.75, -0.75]
    output = ["r", [11], None, [["int32", [3, 2], EXT(3, _i32(ids))], ["float32", [3, 2], EXT(3, _f32(values))],
                                ["int64", [3], EXT(3, _i64([1, 4, 1]))], None, None]]
    out, (sample, prompt) = _decode(_frames(output))
    assert sample is None
    assert (prompt.rows, prompt.cols) == (3, 2)
    assert list(prompt.token_ids) == ids and list(prompt.logprobs) == values


def test_outputs_without_logprobs_cost_no_array_decoding():
    out, (sample, prompt) = _decode(_frames(["r", [5]]))
    assert sample is None and prompt is None


def _sample_with(data_ids, data_values=None, dtype_ids="<i4", shape=(1, 2)):
    data_values = EXT(3, _f32([-1.0, -1.0])) if data_values is None else data_values
    return ["r", [5], [[dtype_ids, list(shape), data_ids], ["<f4", list(shape), data_values],
                       ["<i8", [1], EXT(3, _i64([1]))], None]]


@pytest.mark.parametrize("output, aux, problem", [
    (_sample_with(EXT(3, _i32([5]))), [], "needs 8 bytes"),  # too few bytes for the shape
    (_sample_with(3), [], "names frame 3"),  # an aux frame the message does not have
    (_sample_with(0), [], "names frame 0"),  # frame 0 is the msgpack body itself
    (_sample_with(EXT(1, b"pickle")), [], "Ext type 1"),  # pickle: never unpickled
    (_sample_with({"oob": 1}), [], "out-of-band"),
    (_sample_with(EXT(3, _i32([5, 5])), dtype_ids="<u2"), [], "dtype"),
    (_sample_with(EXT(3, _i32([5, 5])), dtype_ids=">i4"), [], "dtype"),  # big-endian: not guessed at
    (_sample_with(EXT(3, _f32([5, 5])), dtype_ids="<f4"), [], "integers"),  # float token ids
    (["r", [5], [["<i4", [2], EXT(3, _i32([5, 5]))], ["<f4", [2], EXT(3, _f32([-1, -1]))],
                 ["<i8", [1], EXT(3, _i64([1]))]]], [], "rows"),
    (["r", [5], "not logprobs"], [], "at least 3"),
], ids=["short", "missing-frame", "frame-0", "pickle", "oob", "dtype", "big-endian", "float-ids", "1-d",
        "not-an-array"])
def test_malformed_arrays_are_the_engines_fault(output, aux, problem):
    batch = CODEC.decode_output(_frames(output, aux))  # the frame itself decodes: logprobs are read lazily
    with pytest.raises(WireError, match=problem):
        CODEC.logprobs(batch.outputs[0], batch.frames)


def test_the_array_writer_inlines_small_arrays_and_frames_large_ones():
    writer = vllm_arrays.ArrayWriter()
    small = writer.array("<f4", [1, 3], [0.0, -1.0, -2.0])
    large = writer.array("int32", [1, 64], list(range(64)))
    assert small == ["<f4", [1, 3], EXT(3, _f32([0.0, -1.0, -2.0]))]
    assert large == ["int32", [1, 64], 1]
    assert writer.message(b"body") == [b"body", _i32(list(range(64)))]
    # vLLM inlines below the threshold, so exactly 256 bytes goes out of line.
    edge = vllm_arrays.ArrayWriter()
    assert edge.array("<f4", [64], [0.0] * 64)[2] == 1


def test_sim_logprobs_are_consistent_rows():
    writer = vllm_arrays.ArrayWriter()
    wire = sim_logprobs.sample_logprobs(writer, b"d" * 16, 0, 1234, 4096, -1, greedy=False)
    rows = vllm_arrays.logprob_rows(wire, writer.message(b""))
    ids, values = list(rows.token_ids), list(rows.logprobs)
    assert (rows.rows, rows.cols) == (1, 4097)
    assert ids[0] == 1234 and sorted(ids[1:]) == list(range(4096))  # every token once
    assert values[1:] == sorted(values[1:], reverse=True)  # descending
    assert values[0] == values[1 + ids[1:].index(1234)]  # the token's own value is its rank's
    assert abs(sum(2.718281828459045 ** v for v in values[1:]) - 1) < 1e-4  # a distribution
    greedy = vllm_arrays.logprob_rows(sim_logprobs.sample_logprobs(writer, b"d" * 16, 0, 77, 4096, 3, greedy=True),
                                      writer.frames)
    assert list(greedy.token_ids)[:2] == [77, 77]  # greedy: the token is the top-1


# -- against vLLM 0.32's own encoder and decoder ----------------------------------------

VLLM_SIDE = r"""
import json, sys
import msgspec, numpy as np, torch
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.outputs import LogprobsLists, LogprobsTensors
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
mode = sys.argv[1]
if mode == "encode":
    outs = []
    for k in (2, 200):  # inline and out of line
        ids = np.array([[7] + list(range(10, 10 + k))], dtype=np.int32)
        lps = np.array([[-0.5] + [-0.001 * j for j in range(k)]], dtype=np.float32)
        sample = LogprobsLists(ids, lps, np.array([3]), None)
        pids = torch.arange(3 * (k + 1), dtype=torch.int32).reshape(3, k + 1)
        plps = -torch.arange(3 * (k + 1), dtype=torch.float32).reshape(3, k + 1) / 7
        prompt = LogprobsTensors(pids, plps, torch.tensor([1, 2, 3]))
        outs.append(EngineCoreOutput(f"r{k}", [7], new_logprobs=sample, new_prompt_logprobs_tensors=prompt))
    frames = MsgpackEncoder().encode(EngineCoreOutputs(0, outs))
    sys.stdout.buffer.write(msgspec.msgpack.encode([bytes(f) for f in frames]))
else:
    frames = msgspec.msgpack.decode(sys.stdin.buffer.read())
    outputs = MsgpackDecoder(EngineCoreOutputs).decode(frames)
    result = {}
    for out in outputs.outputs:
        s, p = out.new_logprobs, out.new_prompt_logprobs_tensors
        result[out.request_id] = {
            "sample": None if s is None else [np.asarray(a).tolist() for a in s[:3]],
            "prompt": None if p is None else [p[0].tolist(), p[1].tolist(), p[2].tolist()],
        }
    print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def vllm_python() -> str:
    from tests.vllm.conftest import vllm_python_or_skip

    return vllm_python_or_skip()


@pytest.mark.vllm
def test_real_vllm_encoder_inline_and_aux_frames_decode_here(vllm_python, tmp_path):
    done = subprocess.run([vllm_python, "-c", VLLM_SIDE, "encode"], capture_output=True, timeout=300, check=True)
    frames = msgspec.msgpack.decode(done.stdout)
    assert len(frames) == 1 + 2 + 2  # k = 200: two arrays per kind out of line; k = 2 all inline
    batch = CODEC.decode_output(frames)
    for out in batch.outputs:
        k = int(out.request_id[1:])
        sample, prompt = CODEC.logprobs(out, batch.frames)
        assert (sample.rows, sample.cols) == (1, k + 1)
        assert list(sample.token_ids) == [7] + list(range(10, 10 + k))
        assert list(sample.logprobs) == pytest.approx([-0.5] + [-0.001 * j for j in range(k)], abs=1e-6)
        assert (prompt.rows, prompt.cols) == (3, k + 1)
        assert list(prompt.token_ids) == list(range(3 * (k + 1)))
        assert list(prompt.logprobs) == pytest.approx([-j / 7 for j in range(3 * (k + 1))], abs=1e-5)


@pytest.mark.vllm
def test_real_vllm_decoder_reads_what_the_sim_engine_writes(vllm_python):
    writer = vllm_arrays.ArrayWriter()
    outs = []
    for k in (2, 200):
        sample = sim_logprobs.sample_logprobs(writer, b"x" * 16, 0, 42, 4096, k, greedy=False)
        prompt = sim_logprobs.prompt_logprobs(writer, b"x" * 16, [5, 6, 7], 4096, k)
        outs.append(vllm.EngineCoreOutput(f"r{k}", [42], new_logprobs=sample, new_prompt_logprobs_tensors=prompt))
    frames = vllm.encode_outputs(vllm.EngineCoreOutputs(0, outs, timestamp=1.0), writer)
    assert len(frames) > 1  # k = 200 went out of line
    done = subprocess.run([vllm_python, "-c", VLLM_SIDE, "decode"], input=msgspec.msgpack.encode(frames),
                          capture_output=True, timeout=300, check=True)
    theirs = json.loads(done.stdout.decode().strip().splitlines()[-1])
    batch = CODEC.decode_output(frames)
    for out in batch.outputs:
        sample, prompt = CODEC.logprobs(out, batch.frames)
        ids, values, ranks = theirs[out.request_id]["sample"]
        assert [t for row in ids for t in row] == list(sample.token_ids)
        assert [v for row in values for v in row] == pytest.approx(list(sample.logprobs), abs=1e-6)
        assert len(ranks) == 1 and 1 <= ranks[0] <= 4
        pids, pvalues, pranks = theirs[out.request_id]["prompt"]
        assert [t for row in pids for t in row] == list(prompt.token_ids)
        assert [v for row in pvalues for v in row] == pytest.approx(list(prompt.logprobs), abs=1e-6)
        assert len(pranks) == 2 and [row[0] for row in pids] == [6, 7]
