"""A validated call refitted to its processed media: the prompt grows by the image's placeholders.

``validate_generate`` checks a ``media_refs`` request against the prompt the
router tokenized, which has no room yet for the image: the model's processor
(``media_processor.py``) inserts or expands its placeholder tokens (BLIP-2:
``num_query_tokens`` image tokens in front; LLaVA: one ``<image>`` becomes
hundreds). So the context checks run again on the processed prompt, with the
same words, before the engine sees it: a prompt that no longer leaves room to
generate, or a ``max_tokens`` that no longer fits, is the client's error; an
unset ``max_tokens`` is the rest of the (smaller) room, as vLLM sets it.
"""

from __future__ import annotations

import msgspec

from enginelink.machines.request_api import GenerateCall
from enginelink.runtime.errors import ClientError
from enginelink.runtime.contracts.shared.pb_fields import check_max_tokens
from enginelink.runtime.requests.validate import EngineLimits


def with_processed_media(call: GenerateCall, sp, prompt: list[int], mm_features: list,
                         limits: EngineLimits) -> GenerateCall:  # fmt: skip
    """``call`` with the processed prompt and features on every choice, its bounds checked again."""
    if len(prompt) >= limits.max_model_len:
        raise ClientError("media_refs", f"the prompt with its media placeholders has {len(prompt)} tokens; the "
                          f"context is {limits.max_model_len}, which leaves no room for output")  # fmt: skip
    max_tokens = check_max_tokens(sp, "max_tokens", prompt, limits)
    if sp.min_tokens > max_tokens:
        raise ClientError("sampling_params.min_tokens", f"{sp.min_tokens} exceeds max_tokens {max_tokens} left "
                          "beside the prompt with its media placeholders")  # fmt: skip
    call.prompt_token_ids = prompt
    call.max_tokens = max_tokens
    call.specs = [
        msgspec.structs.replace(spec, prompt_token_ids=prompt, mm_features=mm_features,
                                sampling=msgspec.structs.replace(spec.sampling, max_tokens=max_tokens))
        for spec in call.specs
    ]  # fmt: skip
    return call
