"""vLLM's gRPC launcher, as enginelink answers it once ``--servicer-impl enginelink`` selected it.

``vllm serve MODEL --grpc`` parses its arguments, then imports
``vllm.entrypoints.launchers.grpc_server`` and runs ``uvloop.run(serve_grpc(args))``.
With enginelink selected, that import yields this module (tools/vllm_plugin.py),
and :func:`serve_grpc` runs ``enginelink serve --engine vllm`` in this process.
``python -m vllm.entrypoints.launchers.grpc_server`` (or the older
``vllm.entrypoints.grpc_server``) with enginelink selected runs :func:`main`
instead, the stock launcher's parser (``--host``, ``--port``, vLLM's engine
arguments, the reference's flags) then the same hand-over
(``tools/vllm_launch_hook.py`` answers the module; with the reference
installed, the plugin rebinds the stock module's ``serve_grpc``). Either way
enginelink's runtime (trio) serves the gRPC contract, the engine core runs
headless beside it from this same vLLM installation, exactly as ``enginelink
serve`` launches it. ``serve_grpc`` is an ordinary function, called while the
CLI evaluates ``serve_grpc(args)``: it runs to the end of the servicer and
leaves with its exit status (0 after a drain, 1 when the engine died, 2 for a
configuration it refuses), so vLLM's event loop never starts and trio owns
the main thread and its signals.

What goes where: ``--host`` (default 0.0.0.0, as vLLM's launcher binds) and
``--port`` are the gRPC listener; ``--metrics-port``/``--metrics-host`` (else
``SMG_VLLM_SERVICER_METRICS_*``) the Prometheus endpoint; the ``--mm-*``
flags the worker-side media settings, with vLLM's ``--allowed-local-media-path``,
``--allowed-media-domains`` and ``--media-io-kwargs``, which the servicer's
fetcher reads and the engine gets as well (``docs/compatibility.md``);
``--otlp-traces-endpoint`` the servicer's trace export (``docs/tracing.md``;
the engine gets it too); the
model and every engine argument go to the headless engine; ``vllm serve``
flags that only vLLM's HTTP front end reads are not used, and named once in a
warning. Every other setting is enginelink's environment (docs/running.md, "Settings").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["serve_grpc", "main"]

LISTEN_HOST_DEFAULT = "0.0.0.0"  # vLLM's gRPC launcher binds all interfaces unless --host says otherwise
STOCK_PORT_DEFAULT = 50051  # the stock launcher's --port default
# Destinations of vllm serve's flags that enginelink reads itself (not engine arguments, not unused).
# The media flags vLLM defines (--allowed-media-domains, ...) are the engine's too: read and passed on.
MM_DESTS = frozenset(f"mm_{name}" for name in ("processor", "max_inflight", "max_item_bytes", "max_items",
                                               "redis_url", "sidecar_timeout_ms", "sidecar_max_queue",
                                               "sidecar_namespace", "turbojpeg", "fetch_timeout_ms",
                                               "video_fetch_timeout_ms"))
CONSUMED = frozenset({"host", "port", "grpc", "servicer_impl", "metrics_port", "metrics_host", "model_tag",
                      "headless", "model", *MM_DESTS})

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


def serve_namespace(args: Any, engine_args: list[str], engine: str = "vllm",
                    selected_by: str | None = None) -> argparse.Namespace:
    """``enginelink serve``'s arguments for a launch (engine-neutral: docs/launchers.md): the listener, the
    reference's flags as parsed (``tools/ref_flags.py``: the servicer resolves flag > variable > default),
    and what selected enginelink, for its start-up line."""
    from enginelink.tools.ref_flags import MM_FLAGS

    media = {spec.dest: getattr(args, spec.dest, None) for spec in MM_FLAGS}
    domains = getattr(args, "allowed_media_domains", None)
    io_kwargs = getattr(args, "media_io_kwargs", None)
    return argparse.Namespace(
        **media,
        allowed_local_media_path=getattr(args, "allowed_local_media_path", None) or None,
        allowed_media_domains=list(domains) if domains else None,
        # vLLM parses it into a dict; the servicer only needs to know it was given (and shows it).
        media_io_kwargs=(io_kwargs if isinstance(io_kwargs, str) else json.dumps(io_kwargs)) if io_kwargs else None,
        servicer_impl_source=selected_by,
        engine=engine,
        model=Path(args.model),
        served_model_name=None,  # the engine's --served-model-name, else the directory's name
        host=getattr(args, "host", None) or LISTEN_HOST_DEFAULT,
        port=int(args.port),
        journal=None,
        metrics_port=getattr(args, "metrics_port", None),
        metrics_host=getattr(args, "metrics_host", None),
        # vLLM's own tracing flag (an engine argument too): the servicer continues the router's trace with it.
        otlp_traces_endpoint=getattr(args, "otlp_traces_endpoint", None) or None,
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
    selected_by = plan.source if plan is not None else None
    if unused:
        log.warning("vllm serve flags that enginelink's servicer does not use: %s (vLLM's HTTP front end reads "
                    "them; enginelink's settings are ENGINELINK_* / SMG_* variables, docs/running.md)",
                    " ".join(unused))
    # The engine core runs from this launcher's own vLLM, unless the operator named another interpreter.
    os.environ["ENGINELINK_VLLM_PYTHON"] = os.environ.get("ENGINELINK_VLLM_PYTHON") or sys.executable
    return serve.run(serve_namespace(args, engine_args, selected_by=selected_by))


def serve_grpc(args: Any, *_rest: Any, **_kwargs: Any):
    """vLLM's ``serve_grpc(args)``: runs enginelink to its end, then leaves with its exit status."""
    raise SystemExit(run(args))


def main() -> None:
    """``python -m vllm.entrypoints.launchers.grpc_server`` (or ``vllm.entrypoints.grpc_server``) with
    enginelink selected: the stock launcher's parser, then the hand-over. vLLM loads the plugins while its
    engine arguments join the parser, and the plugin adds the reference's flags and records the parse;
    both are done here too, for a process where ``VLLM_PLUGINS`` leaves the plugin out."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from enginelink.tools import vllm_plugin

    parser = FlexibleArgumentParser(description="vLLM gRPC Server (enginelink)")
    parser.add_argument("--host", type=str, default=LISTEN_HOST_DEFAULT, help="Host to bind gRPC server to")
    parser.add_argument("--port", type=int, default=STOCK_PORT_DEFAULT, help="Port to bind gRPC server to")
    parser = AsyncEngineArgs.add_cli_args(parser)
    vllm_plugin.add_flags(parser)
    args = parser.parse_args()
    if vllm_plugin.handover() is None:  # the plugin did not see the parse (left out by VLLM_PLUGINS)
        vllm_plugin.after_parse(parser, None, args)
    raise SystemExit(run(args))


if __name__ == "__main__":
    main()
