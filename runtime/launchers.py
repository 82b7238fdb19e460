"""Launch recipes: how each engine is started headless against our handshake socket.

A launcher is pure: it returns the argv and extra environment for the
engine process; the link starts and supervises it. Engines run in their own
session (process group) so stopping them never leaves a worker behind.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

# Values of these flags never go to the journal or logs verbatim.
_SECRET_FLAG = re.compile(r"(token|key|secret|password|credential)", re.IGNORECASE)


class EngineLauncher(Protocol):
    engine: str  # the codec name, e.g. "vllm"

    def command(self, handshake_address: str) -> tuple[list[str], dict[str, str]]: ...

    def redacted(self, argv: list[str]) -> list[str]: ...


def redact_args(argv: list[str]) -> list[str]:
    """Hide the values of credential-looking flags (``--hf-token X``, ``--api-key=X``)."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append("<redacted>")
            hide_next = False
            continue
        if arg.startswith("--") and _SECRET_FLAG.search(arg):
            if "=" in arg:
                out.append(arg.split("=", 1)[0] + "=<redacted>")
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(arg)
    return out


@dataclass
class SimLauncher:
    """The embedded sim engine, run as ``python -m enginelink.tools.sim_engine``."""

    model_dir: Path
    extra_args: list[str] = field(default_factory=list)
    engine: str = "vllm"  # it speaks the vLLM wire

    def command(self, handshake_address: str) -> tuple[list[str], dict[str, str]]:
        argv = [
            sys.executable,
            "-m",
            "enginelink.tools.sim_engine",
            "--handshake",
            handshake_address,
            "--model",
            str(self.model_dir),
            *self.extra_args,
        ]
        return argv, {}

    def redacted(self, argv: list[str]) -> list[str]:
        return redact_args(argv)
