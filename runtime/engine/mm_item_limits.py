"""The ``mm_item_limits`` label: an engine's own per-request media counts, for the router to hold requests to.

An engine's front end checks its media limits on the requests it parses
itself; the router's precomputed media bypass it, so the router has to know
them: ``GetServerInfo`` advertises them (SGLang and TokenSpeed in
``server_args``, vLLM in its own field) as ``<modality>=<count>`` pairs in
the order audio, image, video (``image=8,video=2``), positive whole counts
only, as the reference's ``mm_item_limits.py`` writes them. SGLang's source
is ``--limit-mm-data-per-request`` (a JSON object of counts per modality).
Pure: parsed arguments in, a label out.
"""

from __future__ import annotations

import json
from typing import Any, Final, Mapping

MM_ITEM_LIMITS_KEY: Final = "mm_item_limits"
MODALITIES: Final = ("audio", "image", "video")  # the router's media pipeline's, in label order


def item_limits(raw: Any) -> dict[str, int]:
    """An engine's per-request media counts from its argument (a JSON object or its text): positive whole
    counts of the router's modalities; {} when there is none or it is not an object."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return {}
    if not isinstance(raw, Mapping):
        return {}
    out = {}
    for modality in MODALITIES:
        count = raw.get(modality)
        if isinstance(count, bool) or not isinstance(count, (int, float)) or count <= 0 or count != int(count):
            continue
        out[modality] = int(count)
    return out


def format_item_limits(limits: Mapping[str, int]) -> str:
    """The label: ``image=8,video=2``; empty for no limits."""
    return ",".join(f"{modality}={limits[modality]}" for modality in MODALITIES if modality in limits)
