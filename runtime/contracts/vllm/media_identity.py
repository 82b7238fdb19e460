"""The PD prefill side's account of the media it processed, for the decode side (``GenerateComplete.media_identity``).

Under prefill/decode disaggregation only the prefill worker fetches and
processes ``media_refs``. The decode worker gets the KV, but to place the
media in its own prompt (M-RoPE positions, block hashes) it needs what the
processor decided: the expanded prompt ids and, per modality, the items'
hashes, placeholder ranges, the embed token where a range mixes tokens, and
the grid tensors (never pixels). The prefill side answers with them on its
completion, in the shape a router-preprocessed decode leg already sends
(``MultimodalInputs`` without ``pixel_values``: ``mm_tensors.py`` takes it
with ``kv_transfer_params``); the router forwards it to the decode side.

An optimisation with a fallback: without an identity (the processor could
not lay a grid out one row per item) the decode side processes the media
itself, so nothing here fails a request. The helper child builds the parts
(``media_processor_child.py`` ``identity``); this module makes them the
proto, serialized, so the request machine carries opaque bytes.
"""

from __future__ import annotations

from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb

MODALITIES = {"image": common_pb2.IMAGE, "video": common_pb2.VIDEO, "audio": common_pb2.AUDIO}


def identity_bytes(prompt: list[int], parts: list[dict] | None) -> bytes | None:
    """``MediaIdentity`` serialized, from the child's per-modality parts; None when there is none to give."""
    if not parts:
        return None
    batches = []
    for part in parts:
        mm = pb.MultimodalInputs(modality=MODALITIES.get(str(part["modality"]), common_pb2.MODALITY_UNSPECIFIED),
                                 mm_hashes=[str(h) for h in part["hashes"]])  # fmt: skip
        mm.mm_placeholders.extend(pb.PlaceholderRange(offset=int(o), length=int(n)) for o, n in part["placeholders"])
        if part.get("im_token_id") is not None:
            mm.im_token_id = int(part["im_token_id"])
        for key, (dtype, shape, data) in sorted(part.get("tensors", {}).items()):
            tensor = mm.model_specific_tensors[key]
            tensor.dtype = str(dtype)
            tensor.shape.extend(int(d) for d in shape)
            tensor.inline = bytes(data)
            mm.batched_keys.append(key)  # one row per item (the child gives no identity otherwise)
        mm.keep_on_cpu_keys.extend(str(k) for k in part.get("keep_on_cpu", ()))
        batches.append(mm)
    identity = pb.MediaIdentity(prompt_token_ids=prompt)
    identity.mm_inputs.CopyFrom(batches[0])
    identity.extra_mm_inputs.extend(batches[1:])
    return identity.SerializeToString()
