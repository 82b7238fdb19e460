"""Launching a real SGLang 0.5.23 scheduler headless: ``serve --engine sglang --model DIR -- <sglang args>``.

The SGLang venv's python runs ``runtime/contracts/sglang/sglang_headless.py`` by path
(enginelink is not installed there). That script builds SGLang's own
``ServerArgs`` from the arguments after ``--`` plus what enginelink needs
(``--model-path DIR``, msgpack IPC through ``SGLANG_USE_PICKLE_IPC=0``), a
``PortArgs`` whose scheduler input and
tokenizer addresses are the ipc sockets the link bound, spawns the scheduler
ranks (TP x PP on this node) as SGLang's own launcher does, and forwards the
first rank's ready dict as one JSON line on the fd the link gave it
(``runtime/engine/sglang_link.py``).

The scheduler keeps its tokenizer, as the reference's headless path does:
SGLang 0.5.23 builds its grammar backend only then
(``constrained/grammar_manager.py``: none under ``--skip-tokenizer-init``),
so structured outputs are enforced; enginelink still sends token ids and
reads ``output_ids`` (filled whether or not a tokenizer runs), and still
matches stop strings itself. An operator's ``--skip-tokenizer-init`` is
passed on: the scheduler then has no grammar backend, which GetServerInfo
says (``grammar_backend: none``) and every constraint is refused ahead of it.
``SMG_SGLANG_ATTRIBUTE_GRAMMAR_ABORTS=1`` (unless the operator set it) turns
on the ranks' grammar attribution (``tools/sglang_grammar_attribution.py``).

Checked before anything starts (exit 2, ``tools/serve.py``):
- the release check (``engine_compat``): the installed structs against our codec;
- the arguments: no flags enginelink sets itself; ``--dp-size`` a positive
  count (N > 1 runs SGLang's own DP controller in front of N scheduler ranks,
  ``runtime/engine/sglang_link.py``);
- a CUDA device: SGLang's scheduler cannot run without one (``sglang-kernel``
  ships CUDA binaries only; ``reference/sglang-wire.md`` §7), so on a
  machine without ``/dev/nvidia*`` the launch is refused in those words
  instead of failing minutes later inside the engine.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from pathlib import Path

from enginelink.runtime.contracts.shared.engine_compat import check_installed, default_python
from enginelink.runtime.engine.launchers import LauncherError, flag_value, move_secrets, redact_args

SGLANG_HEADLESS_SCRIPT = Path(__file__).with_name("sglang_headless.py")
# Set by enginelink: the operator may not give them (the link owns the addresses and the encoding).
OWNED_FLAGS = ("--model-path", "--model", "--port", "--host", "--grpc-mode",
               "--smg-grpc-mode", "--tokenizer-worker-num")
# The reference's switch (scheduler_launcher.py sets it with setdefault) for the ranks' grammar attribution.
GRAMMAR_ATTRIBUTION_ENV = "SMG_SGLANG_ATTRIBUTE_GRAMMAR_ABORTS"
DP_FLAGS = ("--dp-size", "--dp", "--data-parallel-size")
# Where CUDA devices show up; a test may point it elsewhere (ENGINELINK_SGLANG_GPU_GLOB).
GPU_GLOB_DEFAULT = "/dev/nvidia[0-9]*"


def check_sglang() -> tuple[str, str, str | None]:
    """(python, installed version, warning or None) of the SGLang venv; LauncherError / Incompatible."""
    python = default_python("sglang")
    if not Path(python).exists():
        raise LauncherError(f"no SGLang installation at {python}: run tools/setup-sglang, or set "
                            "ENGINELINK_SGLANG_PYTHON (or ENGINELINK_SGLANG_VENV) to one with sglang==0.5.23")
    version, warning = check_installed("sglang", python)
    return python, version, warning


@dataclass
class SglangLauncher:
    python: str
    model_dir: Path | str  # a directory, or a Hub id the engine resolves itself (model_source.py)
    extra_args: list[str] = field(default_factory=list)
    checked_version: str = ""
    engine: str = "sglang"
    warnings: list[str] = field(default_factory=list)
    ranks: tuple[int, ...] = (0,)
    # What the servicer reads off the engine's arguments into its ready facts (e.g. the PD role).
    launch_facts: dict = field(default_factory=dict)

    def check_args(self, environ=os.environ) -> None:
        """Refuse what cannot work, naming it (LauncherError → exit 2)."""
        for flag in OWNED_FLAGS:
            if flag_value(self.extra_args, flag) is not None or flag in self.extra_args:
                raise LauncherError(f"{flag}: enginelink sets it itself for the SGLang scheduler "
                                    "(--model DIR before `--`; the addresses and encoding are the link's)")
        for flag in DP_FLAGS:
            size = flag_value(self.extra_args, flag)
            if size is not None and not (size.isdigit() and int(size) >= 1):
                raise LauncherError(f"{flag} {size}: expected a count of data-parallel ranks (>= 1)")
        pattern = environ.get("ENGINELINK_SGLANG_GPU_GLOB") or GPU_GLOB_DEFAULT
        if not glob.glob(pattern):
            raise LauncherError(
                "the SGLang scheduler needs a CUDA GPU (sglang-kernel ships CUDA binaries only) and this "
                f"machine has none ({pattern} matches nothing); on a CPU-only machine use "
                "`enginelink serve --engine sim --wire sglang`")

    def scheduler_command(self, input_address: str, output_address: str, ready_fd: int,
                          environ=os.environ) -> tuple[list[str], dict[str, str]]:
        extra, env, self.warnings = move_secrets(self.extra_args)
        # No --skip-tokenizer-init: the scheduler's tokenizer is what its grammar backend is built from.
        argv = [self.python, str(SGLANG_HEADLESS_SCRIPT), "--scheduler-input-ipc", input_address,
                "--tokenizer-ipc", output_address, "--ready-fd", str(ready_fd), "--",
                "--model-path", str(self.model_dir), *extra]
        # msgpack IPC (the codec's encoding), not pickle: SGLang's sock_send reads this.
        env["SGLANG_USE_PICKLE_IPC"] = "0"
        env[GRAMMAR_ATTRIBUTION_ENV] = environ.get(GRAMMAR_ATTRIBUTION_ENV, "1")
        return argv, env

    def redacted(self, argv: list[str]) -> list[str]:
        return redact_args(argv)
