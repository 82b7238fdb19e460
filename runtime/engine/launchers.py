"""Launch recipes: what every engine's shares, and the sim engine's (it speaks every wire).

Each real engine's recipe is in its contract's wing (``runtime/contracts/<wing>/launch.py``);
this file has the protocol they keep, their secrets handling and the sim engine's.

A launcher is pure: it returns the argv and extra environment for the
engine process; the link starts and supervises it. Engines run in their own
session (process group) so stopping them never leaves a worker behind.
A launcher may also say ``checked_version``: the release its launch check
verified, which the engine's ready response must name (the handshake machine,
``machines/handshake.py``, refuses another; ``check_ready`` is that check on a map).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

# Values of flags with one of these words in their name never go to the
# journal or logs verbatim (``--hf-token X``, ``--api-key=X``); whole words
# only, so ``--max-num-batched-tokens`` or ``--tokenizer`` stay readable.
SECRET_WORDS = frozenset({"token", "key", "secret", "password", "passwd", "credential", "credentials", "auth"})
# ``scheme://user:password@host``: the password goes.
URL_CREDENTIALS = re.compile(r"(://[^/\s:@]+:)([^/\s@]+)@")
REDACTED = "<redacted>"
# Credential flags of ``vllm serve`` that a headless engine takes from its
# environment instead (vLLM's model loader, huggingface_hub, reads HF_TOKEN):
# moved there, so the value is never in a command line (``ps``, /proc, an
# argument error's echo).
SECRET_FLAGS_TO_ENV = {"--hf-token": "HF_TOKEN"}
# Flags of ``vllm serve``'s API server that a headless engine core has no use
# for (and its parser refuses, echoing them): dropped, with a warning.
FRONT_END_SECRET_FLAGS = ("--api-key",)


class EngineLauncher(Protocol):
    engine: str  # the codec name, e.g. "vllm"

    def command(self, handshake_address: str) -> tuple[list[str], dict[str, str]]: ...

    def redacted(self, argv: list[str]) -> list[str]: ...


class SchedulerLauncher(Protocol):
    """A launcher for a wire with no handshake (SGLang's): the front end binds the scheduler's
    input and output addresses, and the engine reports readiness as one JSON line on ``ready_fd``
    (``runtime/engine/sglang_link.py``)."""

    engine: str

    def scheduler_command(self, input_address: str, output_address: str,
                          ready_fd: int) -> tuple[list[str], dict[str, str]]: ...

    def redacted(self, argv: list[str]) -> list[str]: ...


class LauncherError(Exception):
    """The launcher cannot be set up as configured (operator's fault)."""


def _secret_flag(flag: str) -> bool:
    name = flag.lstrip("-").split("=", 1)[0].lower()
    return any(word in SECRET_WORDS for word in re.split(r"[-_.]", name))


def _redact_json(value):
    if isinstance(value, dict):
        return {k: REDACTED if _secret_flag(str(k)) else _redact_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_json(v) for v in value]
    if isinstance(value, str):
        return URL_CREDENTIALS.sub(rf"\1{REDACTED}@", value)
    return value


def _redact_value(value: str) -> str:
    """Credentials inside a value: secret keys of a JSON object (vLLM's ``--*-config``), URL passwords."""
    if value.lstrip().startswith("{"):
        try:
            return json.dumps(_redact_json(json.loads(value)), separators=(",", ":"))
        except ValueError:
            pass
    return URL_CREDENTIALS.sub(rf"\1{REDACTED}@", value)


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


def move_secrets(argv: list[str]) -> tuple[list[str], dict[str, str], list[str]]:
    """``argv`` without the credential flags a headless engine takes otherwise:
    (argv, environment to add, warnings). ``--hf-token`` with no value (use
    the cached login) stays as it is."""
    out: list[str] = []
    env: dict[str, str] = {}
    warnings: list[str] = []
    index = 0
    while index < len(argv):
        arg = argv[index]
        flag, has_value, value = arg.partition("=")
        if flag in SECRET_FLAGS_TO_ENV or flag in FRONT_END_SECRET_FLAGS:
            if not has_value and index + 1 < len(argv) and not argv[index + 1].startswith("--"):
                value, has_value = argv[index + 1], True
                index += 1
            if flag in FRONT_END_SECRET_FLAGS:
                warnings.append(f"{flag} is a flag of vllm serve's API server; a headless engine core does not "
                                "use it: dropped (enginelink's clients reach the engine only through enginelink)")
            elif has_value:
                env[SECRET_FLAGS_TO_ENV[flag]] = value
            else:
                out.append(arg)
            index += 1
            continue
        out.append(arg)
        index += 1
    return out, env, warnings


def _json_secrets(value, found: set[str]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            if _secret_flag(str(key)) and isinstance(item, (str, int, float)) and not isinstance(item, bool):
                found.add(str(item))
            else:
                _json_secrets(item, found)
    elif isinstance(value, list):
        for item in value:
            _json_secrets(item, found)
    elif isinstance(value, str):
        found.update(match.group(2) for match in URL_CREDENTIALS.finditer(value))


def launch_secrets(argv: list[str], env: dict[str, str]) -> set[str]:
    """Every secret value in a launch: what ``redact_args`` hides in ``argv``
    (credential flags' values, secret keys of JSON values, URL passwords) and
    the values of secret-named variables in ``env``. The engine's output is
    searched for each (``runtime/engine/engine_output.py``)."""
    found: set[str] = set()
    for index, arg in enumerate(argv):
        flag, has_value, value = arg.partition("=")
        if arg.startswith("--") and _secret_flag(arg):
            if has_value:
                found.add(value)
            elif index + 1 < len(argv) and not argv[index + 1].startswith("--"):
                found.add(argv[index + 1])
            continue
        text = value if (arg.startswith("--") and has_value) else arg
        if text.lstrip().startswith("{"):
            try:
                _json_secrets(json.loads(text), found)
                continue
            except ValueError:
                pass
        _json_secrets(text, found)
    for name, value in env.items():
        if value and any(word in SECRET_WORDS for word in re.split(r"[-_.]", name.lower())):
            found.add(value)
    return found


# An engine's argument parser that refused its arguments writes this key to its facts file
# (vllm_headless.report_refused_arguments) and exits 2 (argparse's usage error).
REFUSED_ARGUMENTS_KEY = "refused_arguments"
ARGPARSE_USAGE_STATUS = 2


def refused_arguments(process, facts_path: Path | None, redact) -> str | None:
    """Why the engine refused its arguments, when it exited with argparse's status before the
    handshake; None otherwise. The engine's own words, passed through ``redact`` (the launch's
    ``engine_output.Redactor.line``: argparse echoes the arguments, secrets included)."""
    if process is None or process.returncode != ARGPARSE_USAGE_STATUS:
        return None
    try:
        said = json.loads(facts_path.read_text()).get(REFUSED_ARGUMENTS_KEY) if facts_path else None
    except (OSError, ValueError, AttributeError):
        said = None
    words = redact(str(said).strip().splitlines()[-1]) if said else "see its own error above"
    return (f"the engine refused its arguments (process {process.pid} exited with status "
            f"{ARGPARSE_USAGE_STATUS} before the handshake): {words}")


@dataclass
class SimLauncher:
    """The embedded sim engine, run as ``python -m enginelink.tools.sim_engine``."""

    model_dir: Path
    extra_args: list[str] = field(default_factory=list)
    engine: str = "vllm"  # the wire it speaks (codecs.NAMES): vllm by default, `serve --wire` picks another
    warnings: list[str] = field(default_factory=list)  # from the last ``command``
    ranks: tuple[int, ...] = (0,)  # the DP ranks it runs (kv_config.engine_ranks of its arguments)
    # What the servicer reads off the engine's arguments into its ready facts (e.g. the PD role).
    launch_facts: dict = field(default_factory=dict)

    def _base(self) -> list[str]:
        argv = [sys.executable, "-m", "enginelink.tools.sim_engine", "--model", str(self.model_dir)]
        return argv if self.engine == "vllm" else [*argv, "--wire", self.engine]

    def command(self, handshake_address: str) -> tuple[list[str], dict[str, str]]:
        argv = [*self._base(), "--handshake", handshake_address]
        extra, env, self.warnings = move_secrets(self.extra_args)
        return argv + extra, env

    def scheduler_command(self, input_address: str, output_address: str,
                          ready_fd: int) -> tuple[list[str], dict[str, str]]:
        """The SGLang personality: it connects to the addresses we bound and reports on ``ready_fd``."""
        argv = [*self._base(), "--scheduler-input-ipc", input_address, "--tokenizer-ipc", output_address,
                "--ready-fd", str(ready_fd)]
        extra, env, self.warnings = move_secrets(self.extra_args)
        return argv + extra, env

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


def flag_values(argv: list[str], flag: str) -> list[str] | None:
    """The values of the last ``--flag V [V ...]`` / ``--flag=V`` in ``argv`` (an argparse ``nargs="+"``
    flag: values run to the next ``-`` word); None if absent."""
    values = None
    for index, arg in enumerate(argv):
        if arg.startswith(flag + "="):
            values = [arg.split("=", 1)[1]]
        elif arg == flag:
            values = []
            for word in argv[index + 1:]:
                if word.startswith("-"):
                    break
                values.append(word)
    return values
