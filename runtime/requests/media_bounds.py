"""The engine's media bounds, held before the engine: items per modality, and feature tokens per item.

vLLM's front end refuses, in its own words, a prompt with more items of a
modality than ``--limit-mm-per-prompt`` allows (``validate_num_items``) and
an item whose feature (embedding) tokens exceed what the encoder can place
(``InputProcessor._validate_model_input``). enginelink drives the engine
core directly, so nothing in the engine checks either: a router tensor past
the limit reaches the model runner, and an item larger than the encoder
budget is never scheduled. So the servicer holds every request to them:

- **the limits** are the engine's own, resolved by vLLM at start (the
  headless launcher's facts, ``mm_item_limits``: ``--limit-mm-per-prompt``
  within what the model supports; a modality the model takes no input of
  is 0), tightened per modality by ``--mm-max-items`` /
  ``SMG_VLLM_MM_MAX_ITEMS`` (never loosened: a worker never accepts what
  its engine would refuse). Media refs are counted before anything is
  fetched; router tensors by their placeholder ranges, before the engine;
- **the encoder budget** is vLLM's ``MultiModalBudget.get_encoder_budget()``
  over the engine's config (the facts' ``mm_encoder_budget``; 0: unknown,
  not checked): an item whose feature tokens exceed it is refused with both
  numbers, after the processor (media refs) or from its placeholder range
  (router tensors);
- both are advertised in ``GetServerInfo`` (``mm_item_limits`` as
  ``audio=1,image=2,video=1``, ``mm_encoder_budget``), so the router holds
  requests to them before it picks this worker.

Pure: the facts and the settings in, a ``ClientError`` naming the field out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from enginelink.runtime.errors import ClientError

# The modalities a vLLM worker takes, in the label's order (the router's media pipeline counts these).
MODALITIES = ("audio", "image", "video")


@dataclass(frozen=True)
class MediaBounds:
    # The engine's resolved per-prompt limits (its facts); None: the engine did not say (a sim engine, an
    # older launcher), and only the operator's cap applies.
    engine_limits: Mapping[str, int] | None = None
    items_max: int | None = None  # --mm-max-items / SMG_VLLM_MM_MAX_ITEMS: a per-modality ceiling
    encoder_budget: int = 0  # feature tokens one item may carry; 0: unknown
    limits: dict[str, int] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        limits: dict[str, int] = {}
        for modality in MODALITIES:
            engine = None if self.engine_limits is None else int(self.engine_limits.get(modality, 0))
            caps = [c for c in (engine, self.items_max) if c is not None]
            if caps:
                limits[modality] = max(min(caps), 0)
        object.__setattr__(self, "limits", limits)

    def label(self) -> str:
        """``mm_item_limits`` as the router reads it: ``<modality>=<count>`` for each positive limit."""
        return ",".join(f"{m}={self.limits[m]}" for m in MODALITIES if self.limits.get(m, 0) > 0)

    def check_counts(self, modalities: Iterable[str], where: str) -> None:
        """Refuse more items of a modality than this worker's limit (the client's error, naming ``where``)."""
        for modality, count in sorted(Counter(modalities).items()):
            limit = self.limits.get(modality)
            if limit is None or count <= limit:
                continue
            raise ClientError(where, f"{count} {modality} item(s); {self._why(modality, limit)}")

    def _why(self, modality: str, limit: int) -> str:
        engine = None if self.engine_limits is None else int(self.engine_limits.get(modality, 0))
        if engine == 0:
            return f"this model takes no {modality} input"
        if self.items_max is not None and (engine is None or self.items_max < engine):
            return f"at most {limit} per request on this worker (--mm-max-items / SMG_VLLM_MM_MAX_ITEMS)"
        return f"at most {limit} per request (the engine's limit: --limit-mm-per-prompt, within what the model takes)"

    def check_features(self, modality: str, tokens: int, where: str, at: str = "") -> None:
        """Refuse an item with more feature tokens than the engine's encoder can place."""
        if self.encoder_budget > 0 and tokens > self.encoder_budget:
            raise ClientError(where, f"the {modality} item{at} has {tokens} feature tokens, above the engine's "
                              f"encoder budget of {self.encoder_budget} tokens (mm_encoder_budget); send a "
                              "smaller item")  # fmt: skip


def media_bounds(ready: Mapping, items_max: int | None) -> MediaBounds:
    """The bounds from the engine's facts (``mm_item_limits``, ``mm_encoder_budget``) and the operator's cap."""
    limits = ready.get("mm_item_limits")
    engine = {str(k): int(v) for k, v in limits.items()} if isinstance(limits, Mapping) else None
    return MediaBounds(engine_limits=engine, items_max=items_max,
                       encoder_budget=int(ready.get("mm_encoder_budget") or 0))  # fmt: skip


def feature_tokens(feature: Mapping) -> int:
    """An ``mm_features`` entry's feature tokens (``wire/vllm_mm.py``'s layout): its placeholder's length,
    or the positions its ``is_embed`` mask selects, as vLLM's ``PlaceholderRange.get_num_embeds``."""
    position = feature["mm_position"]
    mask = position.get("is_embed")
    if mask is None:
        return int(position["length"])
    return sum(1 for byte in bytes(mask[2].data) if byte)


def check_router_features(bounds: MediaBounds, features: list[Mapping], where: str) -> None:
    """Router tensors against the bounds: items per modality, and each item's feature tokens."""
    bounds.check_counts((f["modality"] for f in features), where)
    for feature in features:
        at = f" at prompt token {feature['mm_position']['offset']}"
        bounds.check_features(feature["modality"], feature_tokens(feature), where, at)
