"""On/off knobs read from the environment, one spelling for all of them."""

from __future__ import annotations

from collections.abc import Mapping

ON = frozenset({"", "1", "on", "true", "yes"})  # unset or empty: on
OFF = frozenset({"0", "off", "false", "no"})


def on_off(env: Mapping[str, str], name: str) -> bool:
    """``name``'s value as on (the default) or off; ValueError names the knob for anything else."""
    raw = env.get(name, "").strip().lower()
    if raw in ON:
        return True
    if raw in OFF:
        return False
    raise ValueError(f"{name}={raw!r}: expected 1/on or 0/off")
