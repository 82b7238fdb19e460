"""The helper child's pure parts (runtime/requests/media_processor_child.py), without vLLM: the video frame cap."""

from __future__ import annotations

import pytest

from enginelink.runtime.requests.media_processor_child import capped_video_kwargs


@pytest.mark.parametrize("video, cap, default, expected", [
    ({}, 0, 32, {}),  # SMG_VLLM_MM_MAX_VIDEO_FRAMES unset: vLLM decides
    ({}, 4, 32, {"num_frames": 4, "max_frames": 4}),  # the loader's default count, and Qwen2-VL's maximum, capped
    ({"num_frames": 2}, 4, 32, {"num_frames": 2, "max_frames": 4}),  # never raised
    ({"num_frames": -1}, 4, 32, {"num_frames": 4, "max_frames": 4}),  # every frame, capped
    ({"max_frames": 3, "fps": 1}, 8, None, {"max_frames": 3, "fps": 1}),  # unknown default: the count is left alone
    ({"max_frames": 16}, 8, None, {"max_frames": 8}),
])  # fmt: skip
def test_the_frame_cap_lowers_the_loaders_sampling_and_never_raises_it(video, cap, default, expected):
    assert capped_video_kwargs(video, cap, default) == expected
    assert capped_video_kwargs(video, cap, default) is not video or cap == 0  # the engine's kwargs stay its own
