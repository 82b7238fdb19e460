"""``enginelink serve``: the servicer in front of one engine.

With no flags it serves the embedded sim engine with the tiny test model,
built on first use under the user's state directory. Configuration comes from
flags, then ``ENGINELINK_*`` / the reference's ``SMG_*`` environment
variables, then defaults. A refused configuration exits with status 2 before
any engine starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import msgspec
import trio

from enginelink.journal.files import default_journal_path, journal_keep
from enginelink.runtime.contracts.vllm.launch import VllmLauncher, default_vllm_python
from enginelink.runtime.engine.launchers import LauncherError, SimLauncher, flag_value, flag_values
from enginelink.runtime.engine.model_dir import ModelDirError, read_model_facts
from enginelink.runtime.requests.inputs import InputKnobError, input_limits
from enginelink.runtime.contracts.shared.media import MediaKnobError, media_settings
from enginelink.tools import knobs, ref_flags, ref_settings


class ConfigError(Exception):
    """The operator's configuration cannot work; the message says what to change."""


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

DESCRIPTION = """\
Run the servicer in front of one engine, serving the engine's smg gRPC contract: VllmEngine
(sim, vllm), MlxEngine (mlx), SglangScheduler (sglang, or sim --wire sglang), TokenSpeedScheduler
(tokenspeed, or sim --wire tokenspeed); runtime/lifetime/engines.py is the table.
With no flags: the embedded sim engine and the tiny test model (built on first use;
`enginelink make-test-model --print-path` says where), on 127.0.0.1:50051.

Arguments after `--` go to the engine and nowhere else: for --engine vllm, vLLM's own
engine arguments (e.g. -- --max-model-len 1024 --enforce-eager); for the sim engine,
its flags (`enginelink sim-engine --help`). An unknown flag before `--` is refused.

Exit status: 0 after a drain (SIGTERM/SIGINT), 1 when the engine died or failed its
wire, 2 for a configuration it refuses (a bad flag or knob, a port in use, a journal
another servicer holds, engine arguments the engine rejects)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = DESCRIPTION
    p.formatter_class = argparse.RawDescriptionHelpFormatter  # the description's lines are written as shown
    p.epilog = ("Every setting, flags and environment variables (ENGINELINK_*, SMG_*), with its default: "
                "docs/running.md, \"Settings\".")
    from enginelink.runtime.lifetime.engines import ENGINES, WIRES

    p.add_argument("--engine", choices=list(ENGINES), default=os.environ.get("ENGINELINK_ENGINE", "sim"),
                   help="engine to launch headless: sim, the embedded deterministic engine, vllm, a real "
                        "vLLM 0.28.0-0.34.0 from its own venv, mlx, mlx-lm 0.31.3 from its own venv (tools/setup-mlx) "
                        "behind the same wire (served as mlx.grpc.engine.MlxEngine), sglang, an SGLang 0.5.23 scheduler from its own venv "
                        "(tools/setup-sglang; needs a GPU), or tokenspeed, TokenSpeed 0.1.1 (`ts serve --headless`) "
                        "from its own venv (tools/setup-tokenspeed; needs a GPU) (default sim; ENGINELINK_ENGINE)")
    p.add_argument("--wire", choices=list(WIRES), default=os.environ.get("ENGINELINK_WIRE") or None,
                   help="the engine wire, and with it the gRPC contract served: vllm (VllmEngine), sglang "
                        "(SglangScheduler) or tokenspeed (TokenSpeedScheduler); default: the engine's own (sim: vllm; ENGINELINK_WIRE). "
                        "The sim engine speaks every wire")
    p.add_argument("--model", type=Path, default=None,
                   help="model directory, or Hugging Face model id (ORG/NAME, resolved as vLLM does: HF_HOME, "
                        "HF_HUB_CACHE, HF_HUB_OFFLINE, HF_TOKEN) (default: the tiny test model, built on first use "
                        "under the state dir)")
    p.add_argument("--revision", default=None,
                   help="the Hub id's branch, tag or commit (default: the engine's --revision, else main)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory or Hub id, when not the model's (default: the engine's --tokenizer, "
                        "else the model's)")
    p.add_argument("--download-dir", default=None, metavar="DIR",
                   help="the Hugging Face cache to read and fetch into (default: the engine's --download-dir, else "
                        "HF_HUB_CACHE, else HF_HOME/hub)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients send (default: the engine's --served-model-name, else the Hub id, else the "
                        "directory's name)")
    p.add_argument("--host", default=os.environ.get("ENGINELINK_HOST", "127.0.0.1"),
                   help="gRPC host, the first address it resolves to (default 127.0.0.1; ENGINELINK_HOST)")
    p.add_argument("--port", type=int, default=int(os.environ.get("ENGINELINK_PORT", "50051")),
                   help="gRPC port (default 50051; ENGINELINK_PORT)")
    p.add_argument("--journal", type=Path, default=None,
                   help="journal file (default: journal-<port>.sqlite under the state dir); the last "
                        "ENGINELINK_JOURNAL_KEEP runs' files are kept beside it as .prev, .prev2, ...")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this port (default: SMG_<ENGINE>_SERVICER_METRICS_PORT of the "
                        "served contract, else SMG_VLLM_SERVICER_METRICS_PORT, else none)")
    p.add_argument("--metrics-host", default=None,
                   help="metrics host (default: SMG_<ENGINE>_SERVICER_METRICS_HOST, else "
                        "SMG_VLLM_SERVICER_METRICS_HOST, else the gRPC --host, as the reference's)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="continue the router's trace (its traceparent) with a span per Generate call, exported by "
                        "OTLP/gRPC to this collector (vLLM's flag; OTEL_* variables as the OpenTelemetry SDK reads "
                        "them; docs/tracing.md) (default: off; under --engine vllm, vLLM's own among the engine "
                        "arguments)")
    p.add_argument("--log-level", default=os.environ.get("ENGINELINK_LOG_LEVEL", "INFO"), metavar="LEVEL",
                   help=f"one of {', '.join(LOG_LEVELS)} (default INFO; ENGINELINK_LOG_LEVEL)")
    # The reference servicer's media flags, and vLLM's own (docs/compatibility.md says what each does here).
    ref_flags.add_mm_arguments(p)
    ref_flags.add_media_arguments(p)
    p.add_argument("--allow-untested-vllm", action="store_true",
                   help="--engine vllm: run a vLLM release outside 0.28.0-0.34.0 when its wire layout matches "
                        "enginelink's codec (default: refused; ENGINELINK_ALLOW_UNTESTED_VLLM=1; docs/vllm-releases.md)")
    # Engine restarts and resuming the open streams (docs/resume.md); off by default.
    p.add_argument("--engine-restarts", type=int, default=None, metavar="N",
                   help="when the engine dies, start it again and resume every open stream, up to N times within "
                        "--engine-restart-window (default 0: off, every open call fails and the servicer exits 1; "
                        "ENGINELINK_ENGINE_RESTARTS)")
    p.add_argument("--engine-restart-window", type=float, default=None, metavar="SECONDS",
                   help="the window the --engine-restarts count is kept over (default 600; "
                        "ENGINELINK_ENGINE_RESTART_WINDOW_SECS)")
    p.add_argument("--resume-timeout", type=float, default=None, metavar="SECONDS",
                   help="how long a held stream waits for the restarted engine before it fails (default 300; "
                        "ENGINELINK_RESUME_TIMEOUT_SECS)")
    # Which launcher selected enginelink, and how (flag, env, module): its start-up line (docs/launchers.md).
    p.add_argument("--servicer-impl-source", default=None, help=argparse.SUPPRESS)
    p.set_defaults(engine_args=[])


def _env_seconds(*names: str, default: float) -> float:
    for name in names:
        value = os.environ.get(name)
        if value:
            try:
                seconds = float(value)
            except ValueError:
                raise ConfigError(f"{name}={value!r}: expected a number of seconds") from None
            if seconds < 0:
                raise ConfigError(f"{name}={value!r}: must not be negative")
            return seconds
    return default


def _env_positive(*names: str, default: float) -> float:
    value = _env_seconds(*names, default=default)
    if value <= 0:
        raise ConfigError(f"{'/'.join(names)}: must be greater than 0")
    return value


def _env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """The value of environment variable ``name``, one of ``choices`` (any case); ``default`` when unset or empty."""
    value = os.environ.get(name, "")
    choice = value.strip().lower() or default
    if choice not in choices:
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return choice


def _env_int(name: str, expected: str) -> int | None:
    """The whole number in environment variable ``name``; None when unset or empty."""
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r}: expected {expected}") from None


def _engine_nice() -> int:
    from enginelink.runtime.engine.placement import ENGINE_NICE_DEFAULT, NICE_MAX

    levels = _env_int("ENGINELINK_ENGINE_NICE", f"a whole number of nice levels, 0 to {NICE_MAX}")
    if levels is None:
        return ENGINE_NICE_DEFAULT
    if not 0 <= levels <= NICE_MAX:
        raise ConfigError(f"ENGINELINK_ENGINE_NICE={os.environ['ENGINELINK_ENGINE_NICE']!r}: must be 0 (same priority as the servicer) to {NICE_MAX}")
    return levels


def _vllm_launcher(model_dir: Path | str, engine_args: list[str], allow_untested: bool = False) -> VllmLauncher:
    """The real vLLM engine, after checking its release is one enginelink speaks (docs/vllm-releases.md)."""
    from enginelink.runtime.contracts.vllm.compat import Incompatible, allow_untested_from_env, check_installed

    try:
        python = default_vllm_python()
        checked = check_installed(python, allow_untested=allow_untested or allow_untested_from_env())
    except (LauncherError, Incompatible) as error:
        raise ConfigError(str(error)) from None
    if checked.warning:
        logging.getLogger("enginelink").warning("%s", checked.warning)
    return VllmLauncher(python=python, model_dir=model_dir, extra_args=engine_args, checked_version=checked.version,
                        wire_release=checked.release)


def _mlx_launcher(model_dir: Path, engine_args: list[str]):
    """The MLX engine, after checking the MLX venv has the mlx-lm API it drives (runtime/contracts/mlx/launch.py)."""
    from enginelink.runtime.contracts.mlx.launch import MlxIncompatible, MlxLauncher, check_installed, default_mlx_python

    try:
        python = default_mlx_python()
        report = check_installed(python)
    except (LauncherError, MlxIncompatible) as error:
        raise ConfigError(str(error)) from None
    logging.getLogger("enginelink").info("MLX engine: mlx %s, mlx-lm %s (%s)", report.get("mlx"),
                                         report.get("mlx_lm"), python)  # fmt: skip
    return MlxLauncher(python=python, model_dir=model_dir, extra_args=engine_args)


def _sglang_launcher(model_dir: Path, engine_args: list[str]):
    """A real SGLang scheduler, after the release check (its structs against our codec)."""
    from enginelink.runtime.contracts.shared.engine_compat import Incompatible
    from enginelink.runtime.contracts.sglang.launch import SglangLauncher, check_sglang

    try:
        python, version, warning = check_sglang()
        launcher = SglangLauncher(python=python, model_dir=model_dir, extra_args=engine_args,
                                  checked_version=version)
        launcher.check_args()
    except (LauncherError, Incompatible) as error:
        raise ConfigError(str(error)) from None
    if warning:
        logging.getLogger("enginelink").warning("%s", warning)
    return launcher


def _tokenspeed_launcher(model_dir: Path, engine_args: list[str]):
    """The real TokenSpeed engine, after checking its release's structs match our codec (engine_compat)."""
    from enginelink.runtime.contracts.shared.engine_compat import Incompatible, check_installed, default_python
    from enginelink.runtime.contracts.tokenspeed.launch import TokenSpeedLauncher, check_engine_args

    try:
        check_engine_args(engine_args)
        python = default_python("tokenspeed")
        version, warning = check_installed("tokenspeed", python)
    except (LauncherError, Incompatible) as error:
        raise ConfigError(str(error)) from None
    if warning:
        logging.getLogger("enginelink").warning("%s", warning)
    return TokenSpeedLauncher(python=python, model_dir=model_dir, extra_args=engine_args, release=version)


def default_model_dir() -> Path:
    from enginelink.tools.test_model import default_test_model_path, is_complete, make_test_model

    # Our own managed directory: a build from an older recipe is replaced.
    path = default_test_model_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # journals (prompts' token ids) live here too
    if not is_complete(path):
        logging.getLogger("enginelink").info("building the tiny test model at %s (first run only)", path)
    path = make_test_model(path, force=not is_complete(path))
    logging.getLogger("enginelink").info("model: the tiny test model at %s (give it to the router's --model-path)", path)
    return path


def _resume_policy(args: argparse.Namespace):
    """Engine restarts (docs/resume.md): each flag, else its ENGINELINK_* variable, else the default (off)."""
    from enginelink.machines.resume import (
        RESTART_WINDOW_S_DEFAULT,
        RESUME_MEDIA_ITEMS_MAX_DEFAULT,
        RESUME_TIMEOUT_S_DEFAULT,
        ResumePolicy,
    )

    restarts = getattr(args, "engine_restarts", None)
    if restarts is None:
        restarts = _env_int("ENGINELINK_ENGINE_RESTARTS", "a whole number of restarts (0: off)") or 0
    window = getattr(args, "engine_restart_window", None)
    if window is None:
        window = _env_positive("ENGINELINK_ENGINE_RESTART_WINDOW_SECS", default=RESTART_WINDOW_S_DEFAULT)
    timeout = getattr(args, "resume_timeout", None)
    if timeout is None:
        timeout = _env_positive("ENGINELINK_RESUME_TIMEOUT_SECS", default=RESUME_TIMEOUT_S_DEFAULT)
    media = _env_int("ENGINELINK_RESUME_MEDIA_ITEMS_MAX", "a whole number of media items")
    try:
        return ResumePolicy(restarts_max=restarts, window_s=window, resume_timeout_s=timeout,
                            media_items_max=RESUME_MEDIA_ITEMS_MAX_DEFAULT if media is None else media)
    except ValueError as error:
        raise ConfigError(f"engine restarts (--engine-restarts, --engine-restart-window, --resume-timeout, "
                          f"ENGINELINK_RESUME_MEDIA_ITEMS_MAX): {error}") from None


def _journal_ring_records() -> int:
    """``ENGINELINK_JOURNAL_RING_RECORDS``: records the journal's in-memory ring keeps (its memory bound
    with the ring's bytes budget; a soak sets it low so the ring is full within its warm-up)."""
    from enginelink.journal.ring import RING_RECORDS_MAX

    records = _env_int("ENGINELINK_JOURNAL_RING_RECORDS", "a whole number of records, at least 1000")
    if records is None:
        return RING_RECORDS_MAX
    if records < 1000:
        raise ConfigError(f"ENGINELINK_JOURNAL_RING_RECORDS={records}: must be at least 1000 (a fold needs history)")
    return records


def _journal_keep() -> int:
    try:
        return journal_keep()
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _warmup(contract: str):
    from enginelink.machines.warmup import DEFAULT_BUDGET_S, TOKENSPEED_BUDGET_S, WarmupKnobError, warmup_setting

    # TokenSpeed's pass includes the chunk remainders (machines/warmup.py): its own default budget.
    budget_s = TOKENSPEED_BUDGET_S if contract == "tokenspeed" else DEFAULT_BUDGET_S
    try:
        return warmup_setting(os.environ, budget_s, knobs=knobs.names("warmup", contract))
    except WarmupKnobError as error:
        raise ConfigError(str(error)) from None


def _port(setting: ref_settings.Value, what: str) -> int | None:
    """A port setting (a flag's int, or a variable's text), 1..65535; None when unset."""
    if setting.value is None:
        return None
    try:
        port = int(setting.value)
    except ValueError:
        raise ConfigError(f"{setting.label}={setting.value!r}: expected a port number") from None
    if not 0 < port < 65536:
        raise ConfigError(f"{what} {port} ({setting.label}): expected 1..65535")
    return port


def _handshake_port(ref: ref_settings.Resolved) -> int | None:
    """TokenSpeed's TCP handshake port when pinned (SMG_TOKENSPEED_SERVICER_HANDSHAKE_PORT; 0: a free one),
    checked free now: a port in use is the operator's to change, exit 2 before anything starts."""
    import socket

    setting = ref.values.get("handshake_port")
    if setting is None or str(setting.value).strip() == "0":
        return None
    port = _port(setting, "handshake port")
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as error:
            raise ConfigError(f"{setting.label}={port}: the handshake port is not free ({error.strerror})") from None
    return port


def _metrics_port(args: argparse.Namespace, ref: ref_settings.Resolved) -> int | None:
    port = _port(ref.values["metrics_port"], "metrics port")
    if port is not None and port == args.port:
        raise ConfigError(f"metrics port {port} is the gRPC port; pick another --metrics-port")
    return port


def _seconds(setting: str, contract: str, default: float, positive: bool = False) -> float:
    """A seconds setting from its variables (``knobs.names``: ENGINELINK_* first, then the contract's SMG_*)."""
    names = knobs.names(setting, contract)
    return (_env_positive if positive else _env_seconds)(*names, default=default)


def _kv_events(engine: str, engine_args: list[str], contract: str, dialect: str):
    """The engine args with the KV-event publisher turned on (unless off or given), and the relay's plan;
    ``dialect`` is the engine wire's (``wire/kv_engines.py``: how it reads ``--kv-events-config``)."""
    from enginelink.runtime.engine.socket_files import SOCKET_PREFIX, socket_dir
    from enginelink.runtime.engine.socket_files import SocketDirError
    from enginelink.runtime.kv.kv_config import KvConfigError, plan_kv_events

    try:
        directory = socket_dir()  # checked here, before anything starts: exit 2 if not private
    except SocketDirError as error:
        raise ConfigError(str(error)) from None
    try:
        return plan_kv_events(engine, engine_args, os.environ, socket_dir=directory,
                              prefix=f"{SOCKET_PREFIX}{os.getpid()}-{engine}",
                              knobs=knobs.names("kv_events", contract), dialect=dialect)  # fmt: skip
    except KvConfigError as error:
        raise ConfigError(str(error)) from None


def _engine_ranks(engine: str, engine_args: list[str]) -> tuple[int, ...]:
    """The DP ranks the engine runs, each a handshake to wait for; a front end fronts ranks 0..N-1."""
    from enginelink.runtime.kv.kv_config import KvConfigError, engine_ranks

    try:
        ranks = engine_ranks(engine, engine_args)
    except KvConfigError as error:
        raise ConfigError(str(error)) from None
    size = flag_value(engine_args, "--data-parallel-size") or flag_value(engine_args, "-dp")
    if engine == "vllm" and size is not None and size != str(len(ranks)):
        # The head node of a multi-node engine: the other nodes' ranks dial their own front ends.
        raise ConfigError(f"--data-parallel-size {size} with {len(ranks)} local ranks (--data-parallel-size-local): "
                          "enginelink fronts a whole engine, ranks 0..N-1, on one node")
    if engine == "vllm" and ranks[0] != 0:
        # A node of a multi-node DP engine whose ranks start past 0: its front end is the head node's.
        raise ConfigError(f"the engine's DP ranks start at {ranks[0]} (--data-parallel-start-rank / "
                          "--data-parallel-rank): enginelink fronts a whole engine, ranks 0..N-1, on one node")
    return ranks


def _capture_cap(engine_args: list[str]) -> list[str]:
    """The engine args with the CUDA-graph capture cap derived from the admission step
    (SMG_VLLM_CUDAGRAPH_CAPTURE_CAP; runtime/contracts/vllm/capture_cap.py), the decision logged once."""
    from enginelink.runtime.contracts.vllm.capture_cap import apply_to_argv, log_capture_cap

    try:
        engine_args, decision = apply_to_argv(engine_args, os.environ)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    log_capture_cap(decision)
    return engine_args


def _node_rank(engine_args: list[str]) -> None:
    """A multi-node vLLM engine (``--nnodes N``): enginelink runs on the leader, node rank 0;
    the other nodes run ``vllm serve --headless --node-rank K`` (docs/running.md, "Multi-node engines")."""
    rank = flag_value(engine_args, "--node-rank") or flag_value(engine_args, "-r")
    if rank not in (None, "0"):
        raise ConfigError(f"--node-rank {rank}: enginelink fronts the leader, node rank 0; the other nodes run "
                          f"`vllm serve MODEL --headless --nnodes N --node-rank {rank} --master-addr LEADER` "
                          "with the leader's engine flags")


def _grpc_limits():
    from enginelink.runtime.rpc.grpc_limits import GrpcLimits

    try:
        return GrpcLimits.from_env(os.environ)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _fast_path() -> bool:
    from enginelink.runtime.rpc.fastpath import fast_path_from_env

    try:
        return fast_path_from_env(os.environ)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _check_held_writes_budget() -> None:
    """``ENGINELINK_HELD_WRITES_BUDGET_MS`` checked at start (exit 2 naming it); the engine link's receive
    loops read it themselves (``zmq_transport.HELD_WRITES_BUDGET_S``), whatever started the servicer."""
    from enginelink.runtime.engine.zmq_transport import held_writes_budget_s

    try:
        held_writes_budget_s(os.environ)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _gc_policy():
    from enginelink.runtime.lifetime.gc_policy import GcPolicy

    try:
        return GcPolicy.from_env(os.environ)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _hub_setting(args: argparse.Namespace, setting: str) -> str | None:
    """enginelink's own flag for a Hub setting, else the engine's argument of the same meaning (``vllm serve ID
    --revision R`` hands its flags over as engine arguments)."""
    from enginelink.runtime.engine.model_source import engine_setting

    ours = getattr(args, setting, None)
    value = ours if ours is not None else engine_setting(args.engine, list(args.engine_args), setting)
    # ``--hf-token`` alone means the stored login (huggingface_hub's default), not the next flag.
    return None if value is None or value.startswith("--") else value


def _model(args: argparse.Namespace):
    """(the model's source, the tokenizer's source or None, the model's facts), or ConfigError."""
    from enginelink.runtime.engine.model_dir import TOKENIZER_FILES
    from enginelink.runtime.engine.model_source import ModelSource, ModelSourceError, resolve_model

    download_dir, token = _hub_setting(args, "download_dir"), _hub_setting(args, "token")
    revision = _hub_setting(args, "revision")
    try:
        if args.model is None:
            local = default_model_dir()
            source = ModelSource(given=str(local), local_dir=local)
        else:
            source = resolve_model(args.model, revision=revision, download_dir=download_dir, token=token,
                                   mlx=args.engine == "mlx")
        name = _hub_setting(args, "tokenizer")
        tokenizer = None if name is None else resolve_model(
            name, revision=_hub_setting(args, "tokenizer_revision") or revision, download_dir=download_dir,
            token=token)  # as vLLM: the tokenizer's revision defaults to the model's
        model = read_model_facts(source.local_dir)
    except (ModelSourceError, ModelDirError) as error:
        raise ConfigError(str(error)) from None
    changes = {"model_path": source.name} if source.repo_id else {}
    if tokenizer is not None:
        if not any((tokenizer.local_dir / file).is_file() for file in TOKENIZER_FILES):
            raise ConfigError(f"--tokenizer {name}: {tokenizer.local_dir} holds none of {', '.join(TOKENIZER_FILES)}")
        changes["tokenizer_path"] = str(tokenizer.local_dir)
    return source, tokenizer, msgspec.structs.replace(model, **changes) if changes else model


def _engine_model(args: argparse.Namespace, source, tokenizer, engine_args: list[str]) -> tuple[str, list[str]]:
    """The model argument the engine is launched with (``ModelSource.for_engine``: the Hub id, or the local
    snapshot), and its arguments with enginelink's own Hub flags added where the engine lacks them."""
    from enginelink.runtime.engine.model_source import engine_flags

    engine_model = source.for_engine(args.engine)
    settings = {"tokenizer": tokenizer.for_engine(args.engine) if tokenizer is not None and
                getattr(args, "tokenizer", None) is not None else None}
    if engine_model == source.repo_id:  # the engine resolves the id itself: the same revision, the same cache
        settings.update(revision=getattr(args, "revision", None), download_dir=getattr(args, "download_dir", None))
    return engine_model, engine_args + engine_flags(args.engine, engine_args, settings)


def build_config(args: argparse.Namespace, ref: ref_settings.Resolved | None = None):
    from enginelink.runtime.engine.placement import (
        PLACEMENT_CHOICES,
        PLACEMENT_DEFAULT,
        SERVICER_SCHED_CHOICES,
        SERVICER_SCHED_DEFAULT,
    )
    from enginelink.machines.liveness import IDLE_PROBE_INTERVAL_S, IDLE_PROBE_TIMEOUT_S
    from enginelink.runtime.engine.engine_processes import ENGINE_STOP_GRACE_S
    from enginelink.runtime.lifetime.server import ServeConfig

    from enginelink.runtime.lifetime.engines import choose

    try:
        choice = choose(args.engine, getattr(args, "wire", None))
    except KeyError as error:
        raise ConfigError(error.args[0]) from None
    if ref is None:
        ref = ref_settings.resolve(args, os.environ, choice.contract, args.engine)
    source, tokenizer, model = _model(args)
    model_dir = source.local_dir
    if args.engine == "mlx":  # one rank, no KV-event publisher (mlx-lm has neither)
        engine_args, kv_events, ranks = list(args.engine_args), None, (0,)
    else:  # each engine's publisher, read in its own dialect (the sim's: its wire's)
        engine_args, kv_events = _kv_events(args.engine, list(args.engine_args), choice.contract, choice.codec)
        ranks = _engine_ranks(args.engine, engine_args)  # before the vLLM check: a refusal costs no vLLM import
    if choice.contract == "sglang":
        from enginelink.runtime.contracts.sglang.service import health_check_timeout_s

        try:
            health_check_timeout_s(os.environ)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    _check_held_writes_budget()
    engine_model, engine_args = _engine_model(args, source, tokenizer, engine_args)
    if args.engine == "mlx":
        launcher = _mlx_launcher(model_dir, engine_args)
    elif args.engine == "sglang":
        launcher = _sglang_launcher(engine_model, engine_args)
    elif args.engine == "vllm":
        _node_rank(engine_args)
        engine_args = _capture_cap(_media_io_kwargs(args, engine_args))
        launcher = _vllm_launcher(engine_model, engine_args, getattr(args, "allow_untested_vllm", False))
    elif args.engine == "tokenspeed":
        launcher = _tokenspeed_launcher(engine_model, engine_args)
        launcher.handshake_port = _handshake_port(ref)
    else:
        launcher = SimLauncher(model_dir=model_dir, extra_args=engine_args, engine=choice.codec)
    launcher.ranks = ranks
    if choice.codec in ("sglang", "tokenspeed"):
        from enginelink.runtime.requests.pd_bootstrap import launch_facts

        launcher.launch_facts = launch_facts(choice.codec, engine_args)  # the PD role (--disaggregation-mode)
    return ServeConfig(
        launcher=launcher,
        model=model,
        model_dir=model_dir,
        served_model_name=args.served_model_name or flag_value(engine_args, "--served-model-name")
        or source.repo_id or model_dir.name,
        host=args.host,
        port=args.port,
        journal_path=args.journal or default_journal_path(args.port),
        journal_keep=_journal_keep(),
        journal_ring_records=_journal_ring_records(),
        # ENGINELINK_* first, then the served contract's SMG_<ENGINE>_SERVICER_*, then SMG_VLLM_SERVICER_*.
        startup_timeout_s=_seconds("startup_timeout_s", choice.contract, 1800.0),
        startup_ceiling_s=_seconds("startup_ceiling_s", choice.contract, 14400.0),
        silence_timeout_s=_seconds("silence_timeout_s", choice.contract, 300.0, positive=True),
        prefill_tokens_per_s=_seconds("prefill_tokens_per_s", choice.contract, 2000.0, positive=True),
        drain_s=_seconds("drain_s", choice.contract, 5.0),
        engine_stop_grace_s=_env_seconds("ENGINELINK_ENGINE_STOP_GRACE_SECS", default=ENGINE_STOP_GRACE_S),
        idle_probe_s=_env_seconds("ENGINELINK_IDLE_PROBE_SECS", default=IDLE_PROBE_INTERVAL_S),
        idle_probe_timeout_s=_env_positive("ENGINELINK_IDLE_PROBE_TIMEOUT_SECS", default=IDLE_PROBE_TIMEOUT_S),
        engine_nice=_engine_nice(),
        servicer_sched=_env_choice("ENGINELINK_SERVICER_SCHED", SERVICER_SCHED_CHOICES, SERVICER_SCHED_DEFAULT),
        placement=_env_choice("ENGINELINK_PLACEMENT", PLACEMENT_CHOICES, PLACEMENT_DEFAULT),
        warmup=_warmup(choice.contract),
        # As the reference's: --metrics-host, else the contract's SMG_*_METRICS_HOST, else SMG_VLLM_*'s, else
        # the gRPC listener's host (a scraper reaches /metrics wherever it reaches the gRPC port, e.g. under
        # `vllm serve --grpc`, which binds 0.0.0.0).
        metrics_host=ref.get("metrics_host") or args.host,
        metrics_port=_metrics_port(args, ref),
        kv_events=kv_events,
        grpc_limits=_grpc_limits(),
        fast_path=_fast_path(),
        gc_policy=_gc_policy(),
        argv=list(sys.argv),
        codec=choice.codec,
        contract=choice.contract,
        resume=_resume_policy(args),
        otlp_traces_endpoint=_traces_endpoint(args),
        # GetServerInfo's mm_processor_source: a flag's value reaches the media settings as its variable.
        media_source="flag" if ref.source("mm_processor") == "flag" else None,
    )


def _traces_endpoint(args: argparse.Namespace) -> str | None:
    """``--otlp-traces-endpoint``: enginelink's flag, else vLLM's among a vLLM engine's arguments (``vllm serve
    --grpc ... --otlp-traces-endpoint``), as ``--allowed-media-domains``; two different ones are refused. On,
    the SDK's variables that would fail later are checked now (exit 2)."""
    ours = getattr(args, "otlp_traces_endpoint", None)
    engines = flag_value(list(getattr(args, "engine_args", [])), "--otlp-traces-endpoint") \
        if args.engine == "vllm" else None
    if ours is not None and engines is not None and ours != engines:
        raise ConfigError(f"--otlp-traces-endpoint {ours} and the engine argument --otlp-traces-endpoint {engines} "
                          "differ; give one")
    endpoint = ours if ours is not None else engines
    if endpoint is None:
        return None
    if not endpoint.strip():
        raise ConfigError("--otlp-traces-endpoint: no collector given")
    from enginelink.runtime.lifetime.tracing import TracingError, check_settings

    try:
        check_settings(os.environ)
    except TracingError as error:
        raise ConfigError(str(error)) from None
    return endpoint.strip()


def _media_io_kwargs(args: argparse.Namespace, engine_args: list[str]) -> list[str]:
    """``--media-io-kwargs`` (vLLM's media loaders' options) is a vLLM engine argument: enginelink's own flag
    is handed to the engine, whose arguments the media processor helper builds its loaders from; the same
    options given both ways are one, different ones are refused rather than one silently dropped."""
    ours = getattr(args, "media_io_kwargs", None)
    if not ours:
        return engine_args
    engines = flag_value(engine_args, "--media-io-kwargs")

    def parsed(text, where: str):
        try:
            value = json.loads(text) if isinstance(text, str) else text
        except ValueError as error:
            raise ConfigError(f"{where}: not JSON ({error})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a JSON object of options per modality")
        return value

    mine = parsed(ours, "--media-io-kwargs")
    if engines is not None:
        if parsed(engines, "the engine argument --media-io-kwargs") != mine:
            raise ConfigError(f"--media-io-kwargs {ours} and the engine argument --media-io-kwargs {engines} "
                              "differ; give one")
        return engine_args
    return [*engine_args, "--media-io-kwargs", json.dumps(mine)]


def _allowed_media_domains(args: argparse.Namespace) -> None:
    """``--allowed-media-domains`` for the servicer's own fetcher: enginelink's flag, else vLLM's among the
    engine arguments (``vllm serve ... --allowed-media-domains``), as ``ENGINELINK_ALLOWED_MEDIA_DOMAINS``;
    two different lists are refused rather than one silently dropped."""
    from enginelink.runtime.contracts.shared.media import ALLOWED_DOMAINS_ENV, allowed_domains

    ours = getattr(args, "allowed_media_domains", None)
    engines = flag_values(list(getattr(args, "engine_args", [])), "--allowed-media-domains")
    if ours is not None and engines is not None and \
            allowed_domains(" ".join(ours), "--allowed-media-domains") != allowed_domains(" ".join(engines)):
        raise ConfigError(f"--allowed-media-domains {' '.join(ours)} and the engine argument "
                          f"--allowed-media-domains {' '.join(engines)} differ; give one list")
    chosen = ours if ours is not None else engines
    if chosen is not None:
        if not allowed_domains(" ".join(chosen), "--allowed-media-domains"):
            raise ConfigError("--allowed-media-domains: no domain given")
        os.environ[ALLOWED_DOMAINS_ENV] = ",".join(chosen)


def reference_settings(args: argparse.Namespace) -> ref_settings.Resolved:
    """The reference's flags and variables for this start (``tools/ref_settings.py``)."""
    from enginelink.runtime.lifetime.engines import choose

    try:
        choice = choose(args.engine, getattr(args, "wire", None))
    except KeyError as error:
        raise ConfigError(error.args[0]) from None
    return ref_settings.resolve(args, os.environ, choice.contract, args.engine)


def log_reference_settings(args: argparse.Namespace, ref: ref_settings.Resolved) -> None:
    """The start-up lines, once the configuration is accepted (a refused one prints only its refusal): which
    implementation (under a launcher), worker-side media processing, every setting a flag or a variable
    decided (and which), then one WARNING per variable that cannot apply here (``tools/knobs.py``)."""
    log = logging.getLogger("enginelink")
    if getattr(args, "servicer_impl_source", None):
        log.info("servicer implementation: %s (source=%s)", ref_flags.IMPL, args.servicer_impl_source)
    log.info("%s", ref.media_line())
    log.info("%s", ref.line())
    for line in ref.warnings:
        log.warning("%s", line)


def _named_by_flag(message: str, ref: ref_settings.Resolved) -> str:
    """A media setting's refusal names the flag where a flag gave the value (it reached the settings as its
    variable): ``--mm-sidecar-timeout-ms (SMG_VLLM_MM_SIDECAR_TIMEOUT_MS)='0': ...``."""
    for spec in ref_flags.MM_FLAGS:
        if message.startswith(spec.env) and ref.source(f"mm_{spec.setting}") == "flag":
            return f"{spec.flag} ({spec.env}){message[len(spec.env):]}"
    return message


def prepare(args: argparse.Namespace, prog: str = "enginelink serve"):
    """The checked configuration, or the exit status (2) of a refused one, said on stderr; logging set up.
    ``serve`` runs it on a gRPC port, ``headless`` (tools/headless.py) on the router's ZMQ lane."""
    level = str(args.log_level).strip().upper()
    if level not in LOG_LEVELS:
        print(f"{prog}: log level {args.log_level!r}: expected one of {', '.join(LOG_LEVELS)}"
              " (--log-level, ENGINELINK_LOG_LEVEL)", file=sys.stderr)
        return 2
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        ref = reference_settings(args)
        if ref.refusals:  # a feature enginelink does not have: one line each, before anything starts
            for line in ref.refusals:
                print(f"{prog}: {line}", file=sys.stderr)
            return 2
        # The flags of the media knobs stand for their variables, which the media settings read.
        os.environ.update(ref.exports)
        _allowed_media_domains(args)
        # SMG_VLLM_MM_* (every one, the reference's unread ones too), vLLM's fetch deadlines and the media-host
        # knobs: a bad one is refused here, before anything is made.
        settings = media_settings()
        config = build_config(args, ref)
        input_limits()  # the ENGINELINK_MAX_* request-input knobs: a bad one is refused here
        if settings.enabled and not settings.allowed_domains:
            logging.getLogger("enginelink").warning(
                "--mm-processor %s with no --allowed-media-domains: this worker fetches media from any public "
                "host the router forwards", settings.processor)
    except MediaKnobError as error:
        print(f"{prog}: {_named_by_flag(str(error), ref)}", file=sys.stderr)
        return 2
    except (ConfigError, InputKnobError) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    log_reference_settings(args, ref)
    return config


def run(args: argparse.Namespace) -> int:
    config = prepare(args)
    if isinstance(config, int):
        return config
    from enginelink.runtime.lifetime import core
    from enginelink.runtime.lifetime.server import serve

    try:
        return trio.run(serve, config)
    except core.Exit as refused:  # refused before the engine started: a port in use, a journal in use
        print(f"enginelink serve: {refused.reason}", file=sys.stderr)
        return refused.status
