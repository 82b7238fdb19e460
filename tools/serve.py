"""``enginelink serve``: the servicer in front of one engine.

With no flags it serves the embedded sim engine with the tiny test model,
built on first use under the user's state directory. Configuration comes from
flags, then ``ENGINELINK_*`` / the reference's ``SMG_*`` environment
variables, then defaults. A refused configuration exits with status 2 before
any engine starts.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import platformdirs
import trio

from enginelink.journal.journal import default_journal_path
from enginelink.runtime.launchers import (
    LauncherError,
    SimLauncher,
    VllmLauncher,
    default_vllm_python,
    flag_value,
)
from enginelink.runtime.model_dir import ModelDirError, read_model_facts


class ConfigError(Exception):
    """The operator's configuration cannot work; the message says what to change."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=["sim", "vllm"], default=os.environ.get("ENGINELINK_ENGINE", "sim"),
                   help="engine to launch headless (default: sim, the embedded deterministic engine)")
    p.add_argument("--model", type=Path, default=None,
                   help="model directory (default: the tiny test model, built on first use)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients send (default: the model directory's name)")
    p.add_argument("--host", default=os.environ.get("ENGINELINK_HOST", "127.0.0.1"), help="gRPC host (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=int(os.environ.get("ENGINELINK_PORT", "50051")),
                   help="gRPC port (default 50051)")
    p.add_argument("--journal", type=Path, default=None,
                   help="journal file (default: journal-<port>.sqlite under the user's state dir)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this port (default: none; SMG_VLLM_SERVICER_METRICS_PORT)")
    p.add_argument("--metrics-host", default=None,
                   help="metrics host (default 127.0.0.1; SMG_VLLM_SERVICER_METRICS_HOST)")
    p.add_argument("--log-level", default=os.environ.get("ENGINELINK_LOG_LEVEL", "INFO"))
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
    from enginelink.runtime.engine_process import ENGINE_NICE_DEFAULT, NICE_MAX

    levels = _env_int("ENGINELINK_ENGINE_NICE", f"a whole number of nice levels, 0 to {NICE_MAX}")
    if levels is None:
        return ENGINE_NICE_DEFAULT
    if not 0 <= levels <= NICE_MAX:
        raise ConfigError(f"ENGINELINK_ENGINE_NICE={os.environ['ENGINELINK_ENGINE_NICE']!r}: must be 0 (same priority as the servicer) to {NICE_MAX}")
    return levels


def _vllm_launcher(model_dir: Path, engine_args: list[str]) -> VllmLauncher:
    """The real vLLM engine, after checking its release speaks our codec's wire."""
    from enginelink.runtime.vllm_compat import Incompatible, check_installed

    try:
        python = default_vllm_python()
        version, warning = check_installed(python)
    except (LauncherError, Incompatible) as error:
        raise ConfigError(str(error)) from None
    if warning:
        logging.getLogger("enginelink").warning("%s", warning)
    return VllmLauncher(python=python, model_dir=model_dir, extra_args=engine_args, checked_version=version)


def default_model_dir() -> Path:
    from enginelink.tools.test_model import is_complete, make_test_model

    # Our own managed directory: a build from an older recipe is replaced.
    path = Path(platformdirs.user_state_dir("enginelink")) / "test-model"
    return make_test_model(path, force=not is_complete(path))


def _warmup():
    from enginelink.machines.warmup import WarmupKnobError, warmup_setting

    try:
        return warmup_setting(os.environ)
    except WarmupKnobError as error:
        raise ConfigError(str(error)) from None


def _metrics_port(args: argparse.Namespace) -> int | None:
    port = args.metrics_port
    if port is None:
        port = _env_int("SMG_VLLM_SERVICER_METRICS_PORT", "a port number")
        if port is None:
            return None
    if not 0 < port < 65536:
        raise ConfigError(f"metrics port {port}: expected 1..65535")
    if port == args.port:
        raise ConfigError(f"metrics port {port} is the gRPC port; pick another --metrics-port")
    return port


def _kv_events(engine: str, engine_args: list[str]):
    """The engine args with the KV-event publisher turned on (unless off or given), and the relay's plan."""
    from enginelink.runtime.engine_link import SOCKET_PREFIX, socket_dir
    from enginelink.runtime.kv_config import KvConfigError, plan_kv_events

    try:
        return plan_kv_events(engine, engine_args, os.environ, socket_dir=socket_dir(),
                              prefix=f"{SOCKET_PREFIX}{os.getpid()}-{engine}")  # fmt: skip
    except KvConfigError as error:
        raise ConfigError(str(error)) from None


def build_config(args: argparse.Namespace):
    from enginelink.runtime.engine_process import (
        PLACEMENT_CHOICES, PLACEMENT_DEFAULT, SERVICER_SCHED_CHOICES, SERVICER_SCHED_DEFAULT,
    )
    from enginelink.machines.liveness import IDLE_PROBE_INTERVAL_S, IDLE_PROBE_TIMEOUT_S
    from enginelink.runtime.engine_process import ENGINE_STOP_GRACE_S
    from enginelink.runtime.server import ServeConfig

    model_dir = args.model or default_model_dir()
    try:
        model = read_model_facts(model_dir)
    except ModelDirError as error:
        raise ConfigError(str(error)) from None
    engine_args, kv_events = _kv_events(args.engine, list(args.engine_args))
    if args.engine == "vllm":
        launcher = _vllm_launcher(model_dir, engine_args)
    else:
        launcher = SimLauncher(model_dir=model_dir, extra_args=engine_args)
    return ServeConfig(
        launcher=launcher,
        model=model,
        served_model_name=args.served_model_name or flag_value(engine_args, "--served-model-name") or model_dir.name,
        host=args.host,
        port=args.port,
        journal_path=args.journal or default_journal_path(args.port),
        startup_timeout_s=_env_seconds(
            "ENGINELINK_STARTUP_TIMEOUT_SECS", "SMG_VLLM_SERVICER_STARTUP_TIMEOUT_SECS", default=1800.0
        ),
        startup_ceiling_s=_env_seconds(
            "ENGINELINK_STARTUP_CEILING_SECS", "SMG_VLLM_SERVICER_STARTUP_CEILING_SECS", default=14400.0
        ),
        silence_timeout_s=_env_positive(
            "ENGINELINK_SILENCE_TIMEOUT_SECS", "SMG_VLLM_SERVICER_SILENCE_TIMEOUT_SECS", default=300.0
        ),
        prefill_tokens_per_s=_env_positive(
            "ENGINELINK_PREFILL_TOKENS_PER_SEC", "SMG_VLLM_SERVICER_PREFILL_TOKENS_PER_SEC", default=2000.0
        ),
        drain_s=_env_seconds("ENGINELINK_DRAIN_SECS", "SMG_VLLM_SERVICER_DRAIN_SECS", default=5.0),
        engine_stop_grace_s=_env_seconds("ENGINELINK_ENGINE_STOP_GRACE_SECS", default=ENGINE_STOP_GRACE_S),
        idle_probe_s=_env_seconds("ENGINELINK_IDLE_PROBE_SECS", default=IDLE_PROBE_INTERVAL_S),
        idle_probe_timeout_s=_env_positive("ENGINELINK_IDLE_PROBE_TIMEOUT_SECS", default=IDLE_PROBE_TIMEOUT_S),
        engine_nice=_engine_nice(),
        servicer_sched=_env_choice("ENGINELINK_SERVICER_SCHED", SERVICER_SCHED_CHOICES, SERVICER_SCHED_DEFAULT),
        placement=_env_choice("ENGINELINK_PLACEMENT", PLACEMENT_CHOICES, PLACEMENT_DEFAULT),
        warmup=_warmup(),
        metrics_host=args.metrics_host or os.environ.get("SMG_VLLM_SERVICER_METRICS_HOST") or "127.0.0.1",
        metrics_port=_metrics_port(args),
        kv_events=kv_events,
        argv=list(sys.argv),
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_config(args)
    except ConfigError as error:
        print(f"enginelink serve: {error}", file=sys.stderr)
        return 2
    from enginelink.runtime.server import serve

    return trio.run(serve, config)
