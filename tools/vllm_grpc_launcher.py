"""vLLM's gRPC launcher, as enginelink answers it once ``--servicer-impl enginelink`` selected it.

``vllm serve MODEL --grpc`` parses its arguments, then imports
``vllm.entrypoints.launchers.grpc_server`` and runs ``uvloop.run(serve_grpc(args))``.
With enginelink selected, that import yields this module (tools/vllm_plugin.py),
and :func:`serve_grpc` runs ``enginelink serve --engine vllm`` in this process:
enginelink's runtime (trio) serves the gRPC contract, the engine core runs
headless beside it from this same vLLM installation, exactly as ``enginelink
serve`` launches it. ``serve_grpc`` is an ordinary function, called while the
CLI evaluates ``serve_grpc(args)``: it runs to the end of the servicer and
leaves with its exit status (0 after a drain, 1 when the engine died, 2 for a
configuration it refuses), so vLLM's event loop never starts and trio owns
the main thread and its signals.

What goes where: ``--host`` (default 0.0.0.0, as vLLM's launcher binds) and
``--port`` are the gRPC listener; ``--metrics-port``/``--metrics-host`` (else
``SMG_VLLM_SERVICER_METRICS_*``) the Prometheus endpoint; the model and every
engine argument go to the headless engine; ``vllm serve`` flags that only
vLLM's HTTP front end reads are not used, and named once in a warning.
Every other setting is enginelink's environment (README, "Running").
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["serve_grpc", "main"]

LISTEN_HOST_DEFAULT = "0.0.0.0"  # vLLM's gRPC launcher binds all interfaces unless --host says otherwise
# Destinations of vllm serve's flags that enginelink reads itself (not engine arguments, not unused).
CONSUMED = frozenset({"host", "port", "grpc", "servicer_impl", "metrics_port", "metrics_host", "model_tag",
                      "headless"})

# Before enginelink configures logging, only vLLM's logger tree has handlers in this process.
log = logging.getLogger("vllm.enginelink.launcher")


def engine_dests() -> set[str]:
    """The destinations of vLLM's engine arguments: what its headless engine core parses."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(add_help=False))
    return {action.dest for action in parser._actions}


def _takes_value(token: str) -> bool:
    if not token.startswith("-"):
        return True
    try:
        float(token)  # a negative number is a value (--max-logprobs -1)
    except ValueError:
        return False
    return True


def split_engine_args(parser: Any, args: list[str], engine: set[str]) -> tuple[list[str], list[str]]:
    """(engine arguments, unused flags) of a ``vllm serve`` argument list as its parser saw it
    (preprocessed: ``--flag=value`` or ``--flag value``, dashed names). Positionals (the model)
    and the flags enginelink reads itself are in neither."""
    actions = parser._option_string_actions
    kept: list[str] = []
    unused: list[str] = []
    index = 0
    while index < len(args):
        token = args[index]
        index += 1
        if not token.startswith("-") or token == "--":
            continue
        flag = token.split("=", 1)[0]
        action = actions.get(flag)
        words = [token]
        if action is not None and "=" not in token:
            nargs = action.nargs
            if nargs is None or (isinstance(nargs, int) and nargs > 0):
                count = 1 if nargs is None else nargs
                while count and index < len(args) and _takes_value(args[index]):
                    words.append(args[index])
                    index += 1
                    count -= 1
            elif nargs in ("?", "*", "+"):
                while index < len(args) and _takes_value(args[index]):
                    words.append(args[index])
                    index += 1
                    if nargs == "?":
                        break
        dest = action.dest if action is not None else None
        if dest in CONSUMED:
            continue
        if dest is not None and dest in engine and dest != "model":
            kept.extend(words)
        else:
            unused.append(flag)
    return kept, unused


def serve_namespace(args: Any, engine_args: list[str], engine: str = "vllm") -> argparse.Namespace:
    """``enginelink serve``'s arguments for a launch (engine-neutral: docs/launchers.md)."""
    return argparse.Namespace(
        engine=engine,
        model=Path(args.model),
        served_model_name=None,  # the engine's --served-model-name, else the directory's name
        host=getattr(args, "host", None) or LISTEN_HOST_DEFAULT,
        port=int(args.port),
        journal=None,
        metrics_port=getattr(args, "metrics_port", None),
        metrics_host=getattr(args, "metrics_host", None),
        log_level=os.environ.get("ENGINELINK_LOG_LEVEL", "INFO"),
        engine_args=engine_args,
    )


def run(args: Any) -> int:
    """enginelink serving this launch; its exit status."""
    from enginelink.tools import serve, vllm_plugin

    plan = vllm_plugin.handover()
    raw = plan.args if plan is not None else []
    parser = plan.parser if plan is not None else None
    engine_args, unused = split_engine_args(parser, raw, engine_dests()) if parser is not None else ([], [])
    if unused:
        log.warning("vllm serve flags that enginelink's servicer does not use: %s (vLLM's HTTP front end reads "
                    "them; enginelink's settings are ENGINELINK_* / SMG_* variables, README \"Running\")",
                    " ".join(unused))
    # The engine core runs from this launcher's own vLLM, unless the operator named another interpreter.
    os.environ["ENGINELINK_VLLM_PYTHON"] = os.environ.get("ENGINELINK_VLLM_PYTHON") or sys.executable
    return serve.run(serve_namespace(args, engine_args))


def serve_grpc(args: Any, *_rest: Any, **_kwargs: Any):
    """vLLM's ``serve_grpc(args)``: runs enginelink to its end, then leaves with its exit status."""
    raise SystemExit(run(args))


def main() -> None:
    raise SystemExit("enginelink answers vLLM's gRPC launcher only through `vllm serve MODEL --grpc "
                     "--servicer-impl enginelink`")
