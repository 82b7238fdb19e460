"""The Redis media sidecar's wire (``wire/mm_sidecar.py``): keys, messages, results as ``mm_features`` and back.

The interop with the reference's own sidecar and worker, on real vLLM, is
``tests/vllm/test_vllm_media_sidecar.py``; here the layout, without I/O.
"""

from __future__ import annotations

import hashlib

import msgspec
import pytest
from msgspec.msgpack import Ext

from enginelink.wire import mm_sidecar as wire

FP = wire.Fingerprint(model="m", vllm_version="0.32.0", dtype="torch.bfloat16", video_backend="opencv",
                      media_io_kwargs="{}", mm_processor_kwargs="{}", limit_per_prompt='{"*": {"count": 999}}')
ITEM = {"pixel_values": {"data": ["float32", [2], Ext(3, b"\x01" * 8)], "field": ["batched", {"keep_on_cpu": False}]}}


def test_the_namespace_is_the_first_16_hex_digits_of_the_fields_joined():
    joined = "m|0.32.0|torch.bfloat16|opencv|{}|{}|" + '{"*": {"count": 999}}'
    assert FP.namespace() == hashlib.sha256(joined.encode()).hexdigest()[:16]
    keys = wire.Keys.of(FP)
    assert (keys.hello, keys.jobs, keys.result("j1")) == (
        f"smg:mm:v1:{FP.namespace()}:hello", f"smg:mm:v1:{FP.namespace()}:jobs", f"smg:mm:v1:{FP.namespace()}:res:j1")
    assert wire.Keys.of(FP, "  fleet ").prefix == "smg:mm:v1:fleet" and wire.Keys.of(FP, " ").prefix == keys.prefix
    other = msgspec.structs.replace(FP, mm_processor_kwargs='{"do_resize": false}')
    assert other.namespace() != FP.namespace() and FP.differences(other) == ["mm_processor_kwargs"]


def test_a_hello_reads_with_bytes_or_text_and_a_partial_one_is_none():
    hello = {k.encode(): v.encode() for k, v in FP.fields().items()} | {b"schema": b"1"}
    assert wire.Fingerprint.from_mapping(hello) == FP and wire.hello_text(hello, "schema") == "1"
    del hello[b"dtype"]
    assert wire.Fingerprint.from_mapping(hello) is None


def test_messages_are_maps_with_every_field_and_unknown_fields_are_ignored():
    job = wire.Job(v=1, job_id="j", request_id="r", fingerprint=FP, prompt_token_ids=[1], prompt=None,
                   items=[wire.JobItem("image", "data:,x")], enqueued_ms=1, deadline_ms=2)
    raw = msgspec.msgpack.decode(wire.encode(job))
    assert list(raw) == ["v", "job_id", "request_id", "fingerprint", "prompt_token_ids", "prompt", "items",
                         "enqueued_ms", "deadline_ms"]
    assert wire.decode_job(msgspec.msgpack.encode({**raw, "later": 1})) == job
    result = msgspec.msgpack.decode(wire.encode(wire.failure("j", "expired", "late")))
    assert (result["ok"], result["code"], result["mm_kwargs"], result["fingerprint"]) == (False, "expired", {}, None)
    assert wire.decode_result(msgspec.msgpack.encode({"v": 1, "job_id": "j", "ok": True})).mm_hashes == {}


def test_features_to_a_result_and_back_keep_each_item_its_range_and_hash():
    features = [
        {"data": ITEM, "modality": "image", "identifier": "b", "mm_hash": "b",
         "mm_position": {"offset": 9, "length": 2, "is_embed": ["bool", [2], Ext(3, b"\x01\x00")]}},
        {"data": ITEM, "modality": "image", "identifier": "a", "mm_hash": "a",
         "mm_position": {"offset": 1, "length": 3, "is_embed": None}},
    ]  # fmt: skip
    kwargs, places, hashes = wire.result_parts(features)
    assert hashes == {"image": ["a", "b"]}  # prompt order
    assert places == {"image": [wire.Placeholder(1, 3, None), wire.Placeholder(9, 2, [True, False])]}
    result = wire.JobResult(v=1, job_id="j", ok=True, prompt_token_ids=list(range(12)), mm_hashes=hashes,
                            mm_placeholders=places, mm_kwargs=kwargs)
    back = wire.features_of(wire.decode_result(wire.encode(result)))
    assert back == sorted(features, key=lambda f: f["mm_position"]["offset"])


@pytest.mark.parametrize("change, words", [
    ({"mm_hashes": {"image": []}}, "1 items, 1 placeholder ranges and 0 hashes"),
    ({"mm_placeholders": {"image": [wire.Placeholder(3, 5)]}}, "outside the 4-token prompt"),
    ({"mm_placeholders": {"image": [wire.Placeholder(0, 0)]}}, "outside"),
    ({"mm_kwargs": {"image": [b"\xc1"]}}, "an undecodable item"),
    ({"mm_kwargs": {"image": [msgspec.msgpack.encode([1])]}}, "not a map of tensors"),
    ({"mm_placeholders": {"image": [wire.Placeholder(0, 2)], "audio": [wire.Placeholder(2, 1)]}}, "no items"),
])  # fmt: skip
def test_a_result_whose_parts_do_not_fit_is_refused(change, words):
    fields = dict(v=1, job_id="j", ok=True, prompt_token_ids=[1, 2, 3, 4], mm_hashes={"image": ["h"]},
                  mm_placeholders={"image": [wire.Placeholder(0, 2)]}, mm_kwargs={"image": [msgspec.msgpack.encode(ITEM)]})
    fields.update(change)
    with pytest.raises(wire.ResultLayoutError, match=words):
        wire.features_of(wire.JobResult(**fields))
