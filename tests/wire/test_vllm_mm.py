"""Router-preprocessed media as vLLM's ``mm_features`` (``wire/vllm_mm.py``): layout, order, refusals.

The layout is checked by hand here (batched rows, flat slices by sizes,
shared tensors, ``is_embed`` from the image token, content hashes), and
``test_real_vllm_decoder_reads_our_mm_features`` (marked ``vllm``) hands an
ADD frame with two images to vLLM 0.32's own ``MsgpackDecoder(EngineCoreRequest)``
and compares the tensors it rebuilds, and how its ``MultiModalFieldConfig``
batches them, with what was sent.
"""

from __future__ import annotations

import json
import struct
import subprocess

import msgspec
import pytest

from enginelink.wire import vllm
from enginelink.wire.engine import GenerateSpec, SamplingSpec
from enginelink.wire.vllm_mm import MmBatch, MmLayoutError, MmTensor, features

IMG = 9  # the image token in these prompts


def _f32(values) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def _i64(values) -> bytes:
    return struct.pack(f"<{len(values)}q", *values)


def two_images() -> tuple[MmBatch, list[int]]:
    """Qwen2-VL-shaped: pixel rows flat by per-image patch counts, grids batched, a shared scalar."""
    prompt = [1, 2, IMG, IMG, IMG, 3, 4, IMG, IMG, 5]
    pixels = MmTensor("float32", (5, 2), _f32([float(i) for i in range(10)]))  # 3 rows, then 2
    grid = MmTensor("int64", (2, 3), _i64([1, 1, 3, 1, 1, 2]))
    sizes = MmTensor("int64", (2,), _i64([3, 2]))
    scale = MmTensor("float32", (1,), _f32([0.5]))
    batch = MmBatch(modality="image", tensors={"pixel_values": pixels, "image_grid_thw": grid, "sizes": sizes,
                                               "scale": scale},
                    placeholders=[(7, 2), (2, 3)],  # out of prompt order on purpose
                    hashes=["h-second", "h-first"], batched_keys=frozenset({"image_grid_thw", "sizes"}),
                    flat_keys={"pixel_values": "sizes"}, keep_on_cpu_keys=frozenset({"image_grid_thw"}),
                    im_token_id=IMG)  # fmt: skip
    return batch, prompt


def test_items_are_laid_out_as_vllms_encoder_writes_them_in_prompt_order():
    batch, prompt = two_images()
    first, second = features([batch], prompt)
    assert (first["identifier"], first["mm_hash"], first["modality"]) == ("h-first", "h-first", "image")
    assert first["mm_position"] == {"offset": 2, "length": 3, "is_embed": None}
    assert second["mm_position"]["offset"] == 7
    # Flat: the second placeholder's item (listed first) has pixel rows 0-2, the other rows 3-4.
    dtype, shape, ext = second["data"]["pixel_values"]["data"]
    assert (dtype, shape, ext.code, ext.data) == ("float32", [3, 2], 3, _f32([0, 1, 2, 3, 4, 5]))
    assert first["data"]["pixel_values"]["data"][1] == [2, 2]
    assert first["data"]["pixel_values"]["data"][2].data == _f32([6, 7, 8, 9])
    assert first["data"]["pixel_values"]["field"] == ["flat", {"keep_on_cpu": False, "slices": [[0, 3, None], [3, 5, None]],
                                                               "dim": 0}]  # fmt: skip
    # Batched: one row each, the leading dimension dropped.
    assert first["data"]["image_grid_thw"]["data"][:2] == ["int64", [3]]
    assert first["data"]["image_grid_thw"]["data"][2].data == _i64([1, 1, 2])
    assert first["data"]["image_grid_thw"]["field"] == ["batched", {"keep_on_cpu": True}]
    # Shared: the whole tensor for every item.
    assert first["data"]["scale"]["field"] == ["shared", {"keep_on_cpu": False, "batch_size": 2}]
    assert first["data"]["scale"]["data"][2].data == _f32([0.5])


def test_is_embed_marks_only_image_token_positions_when_a_range_holds_others():
    batch, prompt = two_images()
    prompt[3] = 77  # a structural token inside the first range
    first = features([batch], prompt)[0]
    dtype, shape, ext = first["mm_position"]["is_embed"]
    assert (dtype, shape, ext.data) == ("bool", [3], b"\x01\x00\x01")


def test_missing_hashes_become_content_hashes():
    batch, prompt = two_images()
    unhashed = MmBatch(**{**batch.__dict__, "hashes": []})
    first, second = features([unhashed], prompt)
    assert len(first["identifier"]) == 64 and first["identifier"] != second["identifier"]
    assert features([unhashed], prompt)[0]["identifier"] == first["identifier"]


@pytest.mark.parametrize("change,key,words", [
    ({"placeholders": [(2, 3)], "hashes": ["a"]}, "sizes", "2 sizes for 1 items"),
    ({"hashes": ["a"]}, "mm_hashes", "1 hashes for 2"),
    ({"placeholders": [(7, 2), (9, 3)]}, "mm_placeholders", "outside the 10-token prompt"),
    ({"placeholders": [(2, 3), (4, 2)]}, "mm_placeholders", "overlap"),
    ({"placeholders": []}, "mm_placeholders", "one placeholder range per item"),
    ({"flat_keys": {"pixel_values": "nope"}}, "pixel_values", "'nope' is not among"),
])  # fmt: skip
def test_inconsistent_batches_are_refused_naming_the_part(change, key, words):
    batch, prompt = two_images()
    with pytest.raises(MmLayoutError) as error:
        features([MmBatch(**{**batch.__dict__, **change})], prompt)
    assert error.value.key == key and words in str(error.value)


@pytest.mark.parametrize("tensor,words", [
    (MmTensor("float64", (2,), b"\0" * 16), "dtype 'float64' is not one of"),
    (MmTensor("float32", (2, 3), b"\0" * 20), "20 bytes for dtype float32 and shape [2, 3]: expected 24"),
    (MmTensor("bfloat16", (4,), b"\0" * 16), "expected 8"),
])  # fmt: skip
def test_wrong_dtype_or_length_is_refused(tensor, words):
    with pytest.raises(MmLayoutError, match=words.replace("[", r"\[").replace("]", r"\]")):
        tensor.check("pixel_values")


def test_the_add_frame_carries_the_features():
    batch, prompt = two_images()
    spec = GenerateSpec(request_id="r", prompt_token_ids=prompt, sampling=SamplingSpec(max_tokens=2),
                        mm_features=features([batch], prompt))  # fmt: skip
    request = msgspec.msgpack.decode(msgspec.msgpack.encode(vllm.request_for(spec)))
    assert [f["identifier"] for f in request[2]] == ["h-first", "h-second"]


VLLM_SIDE = r"""
import sys, json
import msgspec
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.serial_utils import MsgpackDecoder
from vllm.multimodal.inputs import MultiModalKwargsItems
frames = msgspec.msgpack.decode(sys.stdin.buffer.read())
request = MsgpackDecoder(EngineCoreRequest).decode(frames)
out = []
for f in request.mm_features:
    item = f.data
    out.append({
        "modality": f.modality, "identifier": f.identifier, "mm_hash": f.mm_hash,
        "offset": f.mm_position.offset, "length": f.mm_position.length,
        "is_embed": None if f.mm_position.is_embed is None else f.mm_position.is_embed.tolist(),
        "tensors": {k: [str(e.data.dtype), list(e.data.shape), e.data.flatten().tolist(), type(e.field).__name__]
                    for k, e in item.items()},
    })
# Batched back the way the model runner gathers them (MultiModalKwargsItems.get_data).
items = MultiModalKwargsItems({"image": [f.data for f in request.mm_features]})
data = items.get_data()
out.append({k: [list(v.shape), v.flatten().tolist()] for k, v in data.items()})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def vllm_python() -> str:
    from tests.vllm.conftest import vllm_python_or_skip

    return vllm_python_or_skip()


@pytest.mark.vllm
def test_real_vllm_decoder_reads_our_mm_features(vllm_python):
    batch, prompt = two_images()
    prompt[3] = 77
    spec = GenerateSpec(request_id="r", prompt_token_ids=prompt, sampling=SamplingSpec(max_tokens=2),
                        mm_features=features([batch], prompt))  # fmt: skip
    payload = msgspec.msgpack.encode(vllm.request_for(spec))
    done = subprocess.run([vllm_python, "-c", VLLM_SIDE], input=msgspec.msgpack.encode([payload]),
                          capture_output=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    *items, gathered = json.loads(done.stdout.decode().strip().splitlines()[-1])
    first, second = items
    assert (first["identifier"], first["offset"], first["length"]) == ("h-first", 2, 3)
    assert first["is_embed"] == [True, False, True] and second["is_embed"] is None
    assert first["tensors"]["pixel_values"] == ["torch.float32", [2, 2], [6.0, 7.0, 8.0, 9.0], "MultiModalFlatField"]
    assert first["tensors"]["image_grid_thw"] == ["torch.int64", [3], [1, 1, 2], "MultiModalBatchedField"]
    assert first["tensors"]["scale"] == ["torch.float32", [1], [0.5], "MultiModalSharedField"]
    assert second["tensors"]["pixel_values"][1:3] == [[3, 2], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]
    # Gathered in prompt order: flat pixels concatenated, grids stacked, the shared scalar once.
    assert gathered["pixel_values"] == [[5, 2], [6.0, 7.0, 8.0, 9.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]
    assert gathered["image_grid_thw"] == [[2, 3], [1, 1, 2, 1, 1, 3]]
    assert gathered["scale"] == [[1], [0.5]]
