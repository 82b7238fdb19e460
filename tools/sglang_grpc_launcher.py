"""SGLang's gRPC entry point, as enginelink answers it once ``SMG_SGLANG_SERVICER_IMPL=enginelink`` selected it.

``sglang serve --model-path M --smg-grpc-mode ...`` (or ``python -m
sglang.launch_server ...``) parses its arguments, then imports
``sglang.srt.entrypoints.grpc_server`` and runs ``asyncio.run(serve_grpc(server_args))``.
With enginelink selected (``tools/sglang_plugin.py``) that import yields
this module, and :func:`serve_grpc` is an ordinary function: evaluating
``serve_grpc(server_args)`` runs ``enginelink serve --engine sglang`` in this
process to its end and exits with its status (0 after a drain, 1 when the
engine died, 2 for a configuration it refuses), so SGLang's event loop never
starts and trio owns the main thread and its signals. The scheduler then
runs from this same SGLang installation (``ENGINELINK_SGLANG_PYTHON`` =
this interpreter), exactly as ``enginelink serve --engine sglang`` launches it.

What goes where (:func:`handover_args`): ``--model-path``/``--model`` is
the model directory; ``--host`` (SGLang's default 127.0.0.1) and ``--port``
(its default 30000) the gRPC listener; the reference's ``--metrics-port`` and
``--metrics-host`` the servicer's Prometheus endpoint (else
``SMG_SGLANG_SERVICER_METRICS_*``); ``--smg-grpc-mode``, ``--grpc-mode``,
and ``--servicer-impl`` (it selected enginelink: ``tools/sglang_plugin.py``)
are dropped; every other argument goes to the scheduler as given
(``--skip-tokenizer-init`` too: the scheduler then builds no grammar
backend, and GetServerInfo says so).
"""

from __future__ import annotations

import os
import sys

__all__ = ["serve_grpc", "handover_args"]

SGLANG_HOST_DEFAULT = "127.0.0.1"
SGLANG_PORT_DEFAULT = "30000"
_DROPPED = ("--smg-grpc-mode", "--grpc-mode")
_VALUES = {"--model-path": "model", "--model": "model", "--host": "host", "--port": "port",
           "--servicer-impl": "servicer_impl", "--metrics-port": "metrics_port", "--metrics-host": "metrics_host"}


def server_arguments(argv: list[str]) -> list[str]:
    """The server's own arguments: after ``serve`` for ``sglang serve``, else after the program."""
    return argv[2:] if len(argv) > 1 and argv[1] == "serve" else argv[1:]


def handover_args(args: list[str], selected_by: str | None = None) -> list[str]:
    """SGLang's server arguments as ``enginelink serve``'s (without the program and ``serve``); ``selected_by``
    (flag, env) is what selected enginelink, for its start-up line."""
    taken = {"host": SGLANG_HOST_DEFAULT, "port": SGLANG_PORT_DEFAULT, "model": None}
    engine: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        flag, has_value, value = arg.partition("=")
        if flag in _DROPPED:
            index += 1
            continue
        if flag in _VALUES:
            if not has_value:
                index += 1
                value = args[index] if index < len(args) else ""
            taken[_VALUES[flag]] = value
            index += 1
            continue
        engine.append(arg)
        index += 1
    if not taken["model"]:
        raise SystemExit("enginelink: --model-path is required (the model directory the scheduler loads)")
    out = ["--engine", "sglang", "--model", taken["model"], "--host", taken["host"], "--port", taken["port"]]
    for name in ("metrics_port", "metrics_host"):
        if taken.get(name):
            out += [f"--{name.replace('_', '-')}", taken[name]]
    if selected_by:
        out += ["--servicer-impl-source", selected_by]
    return [*out, "--", *engine] if engine else out


def serve_grpc(server_args=None, model_info=None):
    """Run ``enginelink serve --engine sglang`` with this launcher's arguments; never returns."""
    os.environ.setdefault("ENGINELINK_SGLANG_PYTHON", sys.executable)
    from enginelink.tools.cli import main
    from enginelink.tools.sglang_plugin import selection

    arguments = server_arguments(sys.argv)
    sys.exit(main(["serve", *handover_args(arguments, selected_by=selection(arguments)[1])]))
