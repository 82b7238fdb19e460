"""Launching the MLX engine: the MLX venv's python, checked before anything starts.

``enginelink serve --engine mlx`` runs ``enginelink.tools.mlx_engine`` (the
engine side of vLLM's headless wire over mlx-lm) with the interpreter of the
MLX venv (tools/setup-mlx). Before the link starts, ``check_installed`` runs
``enginelink.tools.mlx_check`` there: the mlx-lm API the engine drives must
be present (by signature), and the venv's enginelink must be this checkout's
(its wire codec is the servicer's). A mismatch is the operator's to fix:
serve exits 2 naming it, as the vLLM layout check does.

The engine speaks the vLLM wire, so the launcher's codec is ``vllm`` and the
link, request machines and journal treat it as one vLLM rank.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from enginelink.runtime.engine.launchers import LauncherError, move_secrets, redact_args
from enginelink.runtime.engine.side_venv import CHECKOUT, interpreter

MLX_ENGINE_MODULE = "enginelink.tools.mlx_engine"
MLX_CHECK_MODULE = "enginelink.tools.mlx_check"
# Importing mlx-lm takes 2-3 s on a loaded 2-core machine; a hung import is not waited for forever.
MLX_CHECK_TIMEOUT_S = 120.0


class MlxIncompatible(Exception):
    """The MLX venv cannot run this build's engine (operator's fault: exit 2)."""


def default_mlx_python() -> str:
    """``ENGINELINK_MLX_PYTHON``, then ``ENGINELINK_MLX_VENV``'s, then the checkout's ``.venv-mlx``."""
    found = interpreter("ENGINELINK_MLX", ".venv-mlx")
    if found:
        return found
    raise LauncherError("no MLX installation found: run tools/setup-mlx, or set ENGINELINK_MLX_PYTHON "
                        "(or ENGINELINK_MLX_VENV) to one with mlx[cpu]==0.32.4, mlx-lm==0.31.3 and this "
                        "checkout installed --no-deps")


def check_installed(python: str, checkout: Path = CHECKOUT) -> dict:
    """The check's report (versions); raises MlxIncompatible naming every problem."""
    try:
        done = subprocess.run([python, "-m", MLX_CHECK_MODULE], capture_output=True, text=True,
                              timeout=MLX_CHECK_TIMEOUT_S)  # fmt: skip
    except FileNotFoundError:
        raise MlxIncompatible(f"the MLX python {python} does not exist: run tools/setup-mlx") from None
    except subprocess.TimeoutExpired:
        raise MlxIncompatible(f"the mlx-lm API check with {python} took over {MLX_CHECK_TIMEOUT_S:.0f} s") from None
    try:
        report = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise MlxIncompatible(f"the mlx-lm API check could not run with {python} (status {done.returncode}): "
                              f"{tail}; run tools/setup-mlx") from None
    problems = list(report.get("problems") or [])
    installed = report.get("enginelink")
    if installed and Path(installed).resolve() != checkout.resolve():
        problems.append(f"the MLX venv runs enginelink from {installed}, this servicer is {checkout}: "
                        "run this checkout's tools/setup-mlx (or point ENGINELINK_MLX_VENV at its venv)")
    if problems:
        raise MlxIncompatible(f"the MLX engine at {python} does not match this build: " + "; ".join(problems))
    return report


@dataclass
class MlxLauncher:
    """mlx-lm behind vLLM's wire: ``python -m enginelink.tools.mlx_engine`` from the MLX venv."""

    python: str
    model_dir: Path
    extra_args: list[str] = field(default_factory=list)
    engine: str = "vllm"  # the wire it speaks
    warnings: list[str] = field(default_factory=list)
    ranks: tuple[int, ...] = (0,)  # one rank: mlx-lm has no data parallelism

    def command(self, handshake_address: str) -> tuple[list[str], dict[str, str]]:
        argv = [self.python, "-m", MLX_ENGINE_MODULE, "--handshake", handshake_address,
                "--model", str(self.model_dir)]  # fmt: skip
        extra, env, self.warnings = move_secrets(self.extra_args)
        return argv + extra, env

    def redacted(self, argv: list[str]) -> list[str]:
        return redact_args(argv)
