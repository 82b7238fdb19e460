"""The engine's media bounds before the engine (runtime/requests/media_bounds.py): limits, budget, label."""

from __future__ import annotations

import pytest
from msgspec.msgpack import Ext

from enginelink.runtime.errors import ClientError
from enginelink.runtime.requests.media_bounds import MediaBounds, check_router_features, media_bounds

ENGINE = {"mm_item_limits": {"image": 2, "video": 1}, "mm_encoder_budget": 100}


def test_the_operators_cap_tightens_the_engines_limits_per_modality_and_never_loosens_them():
    assert media_bounds(ENGINE, None).limits == {"audio": 0, "image": 2, "video": 1}
    assert media_bounds(ENGINE, 1).limits == {"audio": 0, "image": 1, "video": 1}
    assert media_bounds(ENGINE, 5).limits == {"audio": 0, "image": 2, "video": 1}  # never loosened
    assert media_bounds({}, 3).limits == {"audio": 3, "image": 3, "video": 3}  # an engine that did not say
    assert media_bounds({}, None).limits == {} and media_bounds({}, None).label() == ""
    assert media_bounds(ENGINE, None).label() == "image=2,video=1"
    assert media_bounds(ENGINE, 1).label() == "image=1,video=1"


@pytest.mark.parametrize("items_max, modalities, words", [
    (None, ["image"] * 3, "media_refs: 3 image item(s); at most 2 per request (the engine's limit: --limit-mm-per-prompt, within what the model takes)"),
    (1, ["image"] * 2, "2 image item(s); at most 1 per request on this worker (--mm-max-items / SMG_VLLM_MM_MAX_ITEMS)"),
    (None, ["audio"], "1 audio item(s); this model takes no audio input"),
    (9, ["video", "video"], "2 video item(s); at most 1 per request (the engine's limit: --limit-mm-per-prompt, within what the model takes)"),
])  # fmt: skip
def test_too_many_items_of_a_modality_are_the_clients_error_in_words_that_name_the_bound(items_max, modalities, words):
    bounds = media_bounds(ENGINE, items_max)
    with pytest.raises(ClientError) as error:
        bounds.check_counts(modalities, "media_refs")
    assert str(error.value) == words if words.startswith("media_refs") else words in str(error.value)
    bounds.check_counts(["image", "video"], "media_refs")  # within: nothing said


def _feature(modality: str, offset: int, length: int, mask: bytes | None = None) -> dict:
    is_embed = None if mask is None else ["bool", [len(mask)], Ext(3, mask)]
    return {"modality": modality, "mm_position": {"offset": offset, "length": length, "is_embed": is_embed}}


def test_an_item_over_the_encoder_budget_is_refused_with_its_feature_tokens_and_the_budget():
    bounds = media_bounds(ENGINE, None)
    check_router_features(bounds, [_feature("image", 0, 100), _feature("video", 120, 40)], "mm_inputs")
    # A range whose is_embed mask selects 100 of 150 positions carries 100 feature tokens: within.
    check_router_features(bounds, [_feature("image", 0, 150, b"\x01\x00" * 50 + b"\x01" * 50)], "mm_inputs")
    with pytest.raises(ClientError) as error:
        check_router_features(bounds, [_feature("image", 3, 101)], "mm_inputs")
    assert str(error.value) == ("mm_inputs: the image item at prompt token 3 has 101 feature tokens, above the "
                                "engine's encoder budget of 100 tokens (mm_encoder_budget); send a smaller item")
    with pytest.raises(ClientError, match="3 image item"):
        check_router_features(bounds, [_feature("image", i * 10, 5) for i in range(3)], "mm_inputs")
    MediaBounds(encoder_budget=0).check_features("video", 10**9, "x")  # unknown budget: not checked
