"""Router-preprocessed images on SGLang's contract: its ``MultimodalInputs`` → the scheduler's ``mm_inputs``.

The router fetches and preprocesses an image itself and sends SGLang's
``MultimodalInputs`` (``sglang_scheduler.proto``): ``pixel_values`` and
``model_specific_tensors`` as inline ``TensorData`` (little-endian bytes, a
dtype name, a shape), the image token id, and each image's placeholder
range in the already-expanded prompt. SGLang's scheduler takes a
``MultimodalProcessorOutput`` (``sglang/srt/managers/schedule_batch.py``):
one ``MultimodalDataItem`` of modality IMAGE holding the pixels as its
``feature``, the other tensors as ``model_specific_data``, the placeholder
ranges as inclusive ``offsets``, and ``im_token_id`` beside it; the
scheduler hashes the item and pads the prompt itself
(``MultimodalInputs.from_processor_output``, then the model's
``pad_input_ids``). That is exactly what the reference servicer builds
(``sglang/servicer.py`` ``_parse_mm_inputs``), with the tensors as torch
tensors: on the msgpack wire that is SGLang's extension 2, whose payload is
the router's bytes behind a small header (``sglang_structs.pack_tensor``),
so no tensor library is needed here.

Refused before the scheduler, naming the field (``ClientError``):
- any multimodal input when the model takes none (``supports_vision``
  false: SGLang's own ``is_image_understandable_model``, as the engine's
  ready report says);
- media the worker would have to fetch or decode (URLs, raw bytes): the
  router preprocesses them (the reference reads URLs only for its EPD
  encoder, which this worker is not), and a modality other than image;
- no ``pixel_values`` (the reference silently drops such an input: here the
  caller is told);
- a tensor whose dtype is unknown or whose bytes do not fit its shape (the
  reference's ``tensor_from_parts``), tensors past
  ``ENGINELINK_MM_MAX_TENSOR_BYTES`` together;
- placeholder ranges that are empty, overlap, or run past the prompt (the
  scheduler's ``build_token_modalities`` raises on them), more images than
  the engine's ``--limit-mm-data-per-request`` allows (its front end checks
  that on the requests it parses itself; the router's precomputed input
  bypasses it, so it is held to it here too), an image token id outside
  the vocabulary.
"""

from __future__ import annotations

from typing import Mapping

from enginelink.runtime.errors import ClientError
from enginelink.runtime.contracts.shared.media import media_settings
from enginelink.wire import sglang_structs as s
from enginelink.wire.vllm_mm import MmLayoutError, MmTensor

_FETCHED = ("image_urls", "video_urls", "audio_urls", "image_data", "video_data", "audio_data")


def mm_inputs_of(request, prompt_len: int, *, supports_vision: bool, item_limits: Mapping[str, int],
                 vocab_size: int) -> s.MultimodalProcessorOutput | None:
    """The request's ``mm_inputs`` as the scheduler takes them, None without any; ``ClientError`` otherwise."""
    if not request.HasField("mm_inputs"):
        return None
    mm = request.mm_inputs
    if not supports_vision:
        raise ClientError("mm_inputs", "this worker's model takes no images (GetModelInfo supports_vision is false)")
    for name in _FETCHED:
        if len(getattr(mm, name)):
            raise ClientError(f"mm_inputs.{name}", "media to fetch or decode is not taken by this worker: the router "
                              "preprocesses it and sends pixel_values")  # fmt: skip
    others = sorted({m for m in mm.modalities if m.lower() != "image"})
    if others:
        raise ClientError("mm_inputs.modalities", f"only images are taken by this worker, got {', '.join(others)}")
    if not mm.HasField("pixel_values"):
        raise ClientError("mm_inputs.pixel_values", "is required: the router's preprocessed image")
    budget = [media_settings().tensor_bytes_max]
    feature = _tensor("mm_inputs.pixel_values", mm.pixel_values, budget)
    extra = {key: _tensor(f"mm_inputs.model_specific_tensors[{key!r}]", data, budget)
             for key, data in mm.model_specific_tensors.items()}
    offsets = _offsets(mm.mm_placeholders, prompt_len)
    limit = item_limits.get("image")
    if limit is not None and offsets is not None and len(offsets) > limit:
        raise ClientError("mm_inputs.mm_placeholders", f"{len(offsets)} images; this worker's engine takes at most "
                          f"{limit} a request (--limit-mm-data-per-request)")  # fmt: skip
    im_token_id = mm.im_token_id if mm.HasField("im_token_id") else None
    if im_token_id is not None and im_token_id >= vocab_size:
        raise ClientError("mm_inputs.im_token_id", f"{im_token_id} is outside the vocabulary ({vocab_size} ids)")
    item = s.MultimodalDataItem(modality=s.MODALITY_IMAGE, feature=feature, model_specific_data=extra, offsets=offsets)
    return s.MultimodalProcessorOutput(mm_items=[item], im_token_id=im_token_id)


def _tensor(name: str, data, budget: list[int]):
    tensor = MmTensor(data.dtype, tuple(data.shape), data.data)
    try:
        tensor.check(name)  # a known dtype, and exactly the bytes its shape holds
    except MmLayoutError as error:
        raise ClientError(name, str(error)) from None
    budget[0] -= len(data.data)
    if budget[0] < 0:
        raise ClientError(name, f"the request's tensors pass {media_settings().tensor_bytes_max} bytes "
                          "(ENGINELINK_MM_MAX_TENSOR_BYTES)")  # fmt: skip
    return s.pack_tensor(data.dtype, tuple(data.shape), data.data)


def _offsets(placeholders, prompt_len: int) -> list[tuple[int, int]] | None:
    """The placeholder ranges as SGLang's inclusive ``(start, end)`` offsets, in prompt order; None for none
    (the model's own ``pad_input_ids`` then finds the image tokens, as the reference leaves it)."""
    ranges = sorted((p.offset, p.length) for p in placeholders)
    if not ranges:
        return None
    end = 0
    for offset, length in ranges:
        if length < 1 or offset + length > prompt_len:
            raise ClientError("mm_inputs.mm_placeholders", f"range at {offset} of {length} tokens does not lie in "
                              f"the prompt's {prompt_len} tokens")  # fmt: skip
        if offset < end:
            raise ClientError("mm_inputs.mm_placeholders", f"range at {offset} overlaps the one before it")
        end = offset + length
    return [(offset, offset + length - 1) for offset, length in ranges]
