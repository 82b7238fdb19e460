"""The PD prefill side's media identity (runtime/contracts/vllm/media_identity.py) on the completion."""

from __future__ import annotations

from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb

from enginelink.machines.request_api import Complete
from enginelink.runtime.contracts.vllm.edge import encode_complete
from enginelink.runtime.contracts.vllm.media_identity import identity_bytes

GRID = (2).to_bytes(8, "little") + (4).to_bytes(8, "little") * 2  # [[2, 4, 4]] as int64


def test_the_identity_is_the_decode_sides_pixel_less_batches_on_every_complete():
    parts = [{"modality": "video", "hashes": ["h0"], "placeholders": [[4, 8]], "im_token_id": None,
              "tensors": {"video_grid_thw": ["int64", [1, 3], GRID]}, "keep_on_cpu": ["video_grid_thw"]},
             {"modality": "image", "hashes": ["h1"], "placeholders": [[14, 4]], "im_token_id": 7, "tensors": {},
              "keep_on_cpu": []}]  # fmt: skip
    raw = identity_bytes([1, 2, 3], parts)
    complete = encode_complete(Complete(0, [5], "length", 20, 0, media_identity=raw)).complete
    identity = complete.media_identity
    assert list(identity.prompt_token_ids) == [1, 2, 3]
    video = identity.mm_inputs
    assert video.modality == common_pb2.VIDEO and list(video.mm_hashes) == ["h0"]
    assert [(p.offset, p.length) for p in video.mm_placeholders] == [(4, 8)] and not video.HasField("pixel_values")
    grid = video.model_specific_tensors["video_grid_thw"]
    assert (grid.dtype, list(grid.shape), grid.inline) == ("int64", [1, 3], GRID)
    assert list(video.batched_keys) == ["video_grid_thw"] and list(video.keep_on_cpu_keys) == ["video_grid_thw"]
    [image] = identity.extra_mm_inputs
    assert image.modality == common_pb2.IMAGE and image.im_token_id == 7
    # No media processed here (or a grid the child could not lay out one row per item): no identity, and a
    # complete without one.
    assert identity_bytes([1], None) is None and identity_bytes([1], []) is None
    assert not encode_complete(Complete(0, [5], "length", 20, 0)).complete.HasField("media_identity")
    assert isinstance(pb.GenerateComplete().media_identity, pb.MediaIdentity)
