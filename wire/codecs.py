"""Engine codecs by name: the one place an engine name becomes a codec.

The journal stores raw engine frames with the link's engine name; replay and
post-mortem tools call ``get(name)`` to decode them with the same codec the
live servicer used. Rules: names are a closed vocabulary (``NAMES``); an
unknown name is a ``KeyError`` naming the known ones; each call returns a
fresh codec (codecs are cheap and hold no per-run state worth sharing).
"""

from __future__ import annotations

from typing import Callable, Final

from enginelink.wire.engine import EngineCodec, HandshakeWire
from enginelink.wire.sglang import SglangCodec
from enginelink.wire.tokenspeed import TokenSpeedCodec, TokenSpeedHandshake
from enginelink.wire.vllm import VllmCodec, VllmHandshake

_FACTORIES: Final[dict[str, Callable[[], EngineCodec]]] = {
    "vllm": VllmCodec,
    "sglang": SglangCodec,
    "tokenspeed": TokenSpeedCodec,
}

# Each wire's start-up handshake (machines/handshake.py reads it through this object).
_HANDSHAKES: Final[dict[str, Callable[[], HandshakeWire]]] = {
    "vllm": VllmHandshake,
    "tokenspeed": TokenSpeedHandshake,
    # SGLang 0.5.23 has none: its scheduler reports readiness through a spawn pipe (docs/simulation.md).
}

NAMES: Final = tuple(_FACTORIES)

# How each wire's engine says it is up: "handshake" (HELLO / INIT / READY, ``machines/handshake.py``)
# or "ready_fd" (SGLang: the front end binds, the scheduler reports one JSON line on an inherited fd,
# ``runtime/engine/sglang_link.py``).
READINESS: Final[dict[str, str]] = {"vllm": "handshake", "tokenspeed": "handshake", "sglang": "ready_fd"}


def get(name: str, release: object = None) -> EngineCodec:
    """The codec of engine wire ``name`` (one of ``NAMES``); for vLLM, speaking ``release``
    (``wire/vllm_release.py``'s ``ReleaseWire``; None: the canonical structs, vLLM 0.32.0's)."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise KeyError(f"unknown engine codec {name!r}; known: {', '.join(NAMES)}") from None
    if release is not None and name == "vllm":
        return VllmCodec(release=release)
    return factory()


def readiness(name: str) -> str:
    """How engine wire ``name`` reports readiness: ``"handshake"`` or ``"ready_fd"``."""
    try:
        return READINESS[name]
    except KeyError:
        raise KeyError(f"unknown engine wire {name!r}; known: {', '.join(NAMES)}") from None


def handshake(name: str) -> HandshakeWire:
    """The handshake codec of engine wire ``name`` (one of ``NAMES``)."""
    try:
        factory = _HANDSHAKES[name]
    except KeyError:
        raise KeyError(f"unknown engine wire {name!r} for a handshake; known: {', '.join(_HANDSHAKES)}") from None
    return factory()
