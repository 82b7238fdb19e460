"""An engine's own venv, beside enginelink's: which interpreter, and asking it something.

Every engine runs from a venv of its own (vLLM, MLX, SGLang's and TokenSpeed's
struct-only ones), chosen the same way: ``ENGINELINK_<ENGINE>_PYTHON``, then
``ENGINELINK_<ENGINE>_VENV``'s interpreter, then the checkout's default folder
(what its ``tools/setup-*`` script builds). Launch-time checks ask that
interpreter about its release in a subprocess, bounded in time; each failure
says what to do.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]


class Incompatible(Exception):
    """The installed engine does not speak the wire this codec encodes (operator's fault)."""


def interpreter(env_prefix: str, venv_dir: str, *, must_exist: bool = True) -> str | None:
    """``<env_prefix>_PYTHON``, else ``<env_prefix>_VENV``'s python, else the checkout's ``venv_dir``'s.

    The checkout's is returned only when it exists, unless ``must_exist`` is false; None otherwise."""
    explicit = os.environ.get(f"{env_prefix}_PYTHON")
    if explicit:
        return explicit
    venv = os.environ.get(f"{env_prefix}_VENV")
    if venv:
        return str(Path(venv) / "bin" / "python")
    candidate = CHECKOUT / venv_dir / "bin" / "python"
    return str(candidate) if candidate.exists() or not must_exist else None


def ask(argv: list[str], *, timeout_s: float, setup: str, env_prefix: str, what: str) -> str:
    """Run ``argv`` (an engine venv's python and its arguments) and return its stdout.

    Raises ``Incompatible`` saying what to do: no such interpreter (run ``setup``,
    or set ``<env_prefix>_PYTHON``), no answer in time, or it could not import ``what``.
    """
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        raise Incompatible(f"{argv[0]}: no such interpreter (run {setup}, or set {env_prefix}_PYTHON)") from None
    except subprocess.TimeoutExpired:
        raise Incompatible(f"{argv[0]} did not answer within {timeout_s:g} s") from None
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise Incompatible(f"{argv[0]} cannot import {what}:\n{tail}")
    return done.stdout
