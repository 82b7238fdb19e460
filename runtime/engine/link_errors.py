"""How an engine link fails: errors that say the engine's fault, and which need the operator."""

from __future__ import annotations


class LinkFailed(Exception):
    """The engine link failed; the message says why (whose fault: the engine's)."""


class EngineIncompatible(LinkFailed):
    """The engine that answered is not what the launch check verified (exit 2)."""


class EngineArgsRefused(LinkFailed):
    """The engine exited 2 before the handshake: its argument parser refused its arguments (exit 2)."""
