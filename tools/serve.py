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
from enginelink.runtime.launchers import SimLauncher
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


def default_model_dir() -> Path:
    from enginelink.tools.test_model import make_test_model

    path = Path(platformdirs.user_state_dir("enginelink")) / "test-model"
    return make_test_model(path)


def _metrics_port(args: argparse.Namespace) -> int | None:
    port = args.metrics_port
    if port is None:
        value = os.environ.get("SMG_VLLM_SERVICER_METRICS_PORT")
        if not value:
            return None
        try:
            port = int(value)
        except ValueError:
            raise ConfigError(f"SMG_VLLM_SERVICER_METRICS_PORT={value!r}: expected a port number") from None
    if not 0 < port < 65536:
        raise ConfigError(f"metrics port {port}: expected 1..65535")
    if port == args.port:
        raise ConfigError(f"metrics port {port} is the gRPC port; pick another --metrics-port")
    return port


def build_config(args: argparse.Namespace):
    from enginelink.runtime.server import ServeConfig

    if args.engine == "vllm":
        raise ConfigError("--engine vllm: the real-engine launcher is not in this build yet; use --engine sim")
    model_dir = args.model or default_model_dir()
    try:
        model = read_model_facts(model_dir)
    except ModelDirError as error:
        raise ConfigError(str(error)) from None
    launcher = SimLauncher(model_dir=model_dir, extra_args=list(args.engine_args))
    return ServeConfig(
        launcher=launcher,
        model=model,
        served_model_name=args.served_model_name or model_dir.name,
        host=args.host,
        port=args.port,
        journal_path=args.journal or default_journal_path(args.port),
        startup_timeout_s=_env_seconds(
            "ENGINELINK_STARTUP_TIMEOUT_SECS", "SMG_VLLM_SERVICER_STARTUP_TIMEOUT_SECS", default=1800.0
        ),
        drain_s=_env_seconds("ENGINELINK_DRAIN_SECS", "SMG_VLLM_SERVICER_DRAIN_SECS", default=5.0),
        metrics_host=args.metrics_host or os.environ.get("SMG_VLLM_SERVICER_METRICS_HOST") or "127.0.0.1",
        metrics_port=_metrics_port(args),
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
