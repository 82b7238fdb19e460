"""The served model's facts, contract-neutral: what every contract's ``GetModelInfoResponse`` starts from.

Facts come from two places: the model directory (vocab, EOS ids,
architecture, sampling defaults, tokenizer; ``runtime/engine/model_dir.py``)
and the engine's ready response (context length, block size, dtype, DP size,
scheduler limits; ``App.ready``). ``ServedModel`` holds the first kind under
the names the protos give them, so each contract's wing fills its message
with them (``contracts/shared/facts.py``) and adds what is its own; the
context length is the engine's once it is up, the model's config before.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The model directory's facts every contract's model info carries, under the protos' field names."""

    model_path: str
    served_model_name: str
    vocab_size: int
    model_type: str
    architectures: tuple[str, ...]
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    bos_token_id: int


def served_model(app) -> ServedModel:
    model = app.model
    return ServedModel(
        model_path=str(model.model_path),
        served_model_name=app.served_model_name,
        vocab_size=model.vocab_size,
        model_type=model.model_type or "",
        architectures=tuple(model.architectures),
        eos_token_ids=tuple(model.eos_token_ids),
        pad_token_id=model.pad_token_id or 0,
        bos_token_id=model.bos_token_id or 0,
    )


def context_len(app) -> int:
    """The context in tokens: the engine's once it is up, the model's config before."""
    return int(app.ready.get("max_model_len") or app.model.max_position_embeddings or 0)
