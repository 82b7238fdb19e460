"""Launching a real TokenSpeed engine headless: ``ts serve --headless``'s module from the TokenSpeed venv.

``ts serve --headless ARGS`` runs ``tokenspeed.runtime.entrypoints.engine``'s
``run_scheduler_headless_from_cli(ARGS)``; enginelink runs that module
directly with the TokenSpeed venv's python (``runtime/engine/side_venv.py``
finds it: ``ENGINELINK_TOKENSPEED_PYTHON`` / ``_VENV``, then the checkout's
``.venv-tokenspeed`` from ``tools/setup-tokenspeed``). Keep TokenSpeed out of
enginelink's own venv: its PyPI metadata pins forks of ``smg-grpc-proto`` /
``smg-grpc-servicer`` that replace the real ones (``reference/tokenspeed.md``).

The engine's ranks dial ``tcp://{--data-parallel-address}:{--data-parallel-rpc-port}``
and nothing else, so this launcher asks the link for a TCP handshake socket
(``handshake_transport``; a free loopback port); the INIT message then names
the link's ipc data sockets. Headless mode forces ``--zmq-msgpack`` and
``--skip-tokenizer-init`` itself; they are passed anyway, so the argv says
what the engine runs. Flags enginelink owns (the model, the handshake
address) are refused in the operator's engine arguments, before anything starts.

Before launch, ``engine_compat.check_installed("tokenspeed")`` compares the
installed release's struct layouts with the codec (exit 2 on drift); the ready
response must then say ``tokenspeed-<that release>`` (the handshake machine's check).
The real engine needs a CUDA/ROCm/NPU device: on a CPU-only machine only the
argv and the release check can be exercised (``tests/test_tokenspeed_launch.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from enginelink.runtime.engine.launchers import LauncherError, flag_value, redact_args
from enginelink.wire.tokenspeed import ready_version

ENGINE_MODULE = "tokenspeed.runtime.entrypoints.engine"  # what `ts serve --headless` runs
# Flags the launcher sets from enginelink's own configuration.
OWNED_FLAGS = ("--model-path", "--model", "--data-parallel-address", "--data-parallel-rpc-port")


def check_engine_args(engine_args: list[str]) -> None:
    """Refuse engine arguments that would fight the launcher (operator's fault: exit 2)."""
    for flag in OWNED_FLAGS:
        if flag_value(engine_args, flag) is not None or flag in engine_args:
            raise LauncherError(f"{flag} is set by enginelink (the model is --model before `--`, the handshake "
                                "address is its own); remove it from the TokenSpeed arguments")


def _tcp(address: str) -> tuple[str, str]:
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or not host or not port.isdigit():
        raise LauncherError(f"TokenSpeed dials a TCP handshake address, got {address!r}")
    return host, port


@dataclass
class TokenSpeedLauncher:
    """A real TokenSpeed engine, ``python -m tokenspeed.runtime.entrypoints.engine`` (= ``ts serve --headless``)."""

    python: str
    model_dir: Path | str  # a directory, or a Hub id the engine resolves itself (model_source.py)
    extra_args: list[str] = field(default_factory=list)
    # The release the launch check verified ("0.1.1"); the ready response must say tokenspeed-<it>.
    release: str = ""
    engine: str = "tokenspeed"
    handshake_transport: str = "tcp"
    # The loopback TCP port of that handshake; None: a free one (SMG_TOKENSPEED_SERVICER_HANDSHAKE_PORT pins it).
    handshake_port: int | None = None
    warnings: list[str] = field(default_factory=list)
    ranks: tuple[int, ...] = (0,)
    # What the servicer reads off the engine's arguments into its ready facts (e.g. the PD role).
    launch_facts: dict = field(default_factory=dict)

    @property
    def output_logprobs(self) -> bool:
        """Started with ``--enable-output-logprobs``: without it TokenSpeed answers logprob requests pre-aborted."""
        return "--enable-output-logprobs" in self.extra_args

    @property
    def checked_version(self) -> str:
        return ready_version(self.release) if self.release else ""

    def command(self, handshake_address: str) -> tuple[list[str], dict[str, str]]:
        host, port = _tcp(handshake_address)
        argv = [
            self.python, "-m", ENGINE_MODULE,
            "--model-path", str(self.model_dir),
            "--data-parallel-address", host,
            "--data-parallel-rpc-port", port,
            "--zmq-msgpack", "--skip-tokenizer-init",
            *self.extra_args,
        ]
        return argv, {}

    def redacted(self, argv: list[str]) -> list[str]:
        return redact_args(argv)
