"""SGLang 0.5.23's own DP controller placing enginelink's bytes, run in the SGLang struct-only venv.

    SGLANG_VENV/bin/python dp_controller_peer.py CASES.json RESULTS.json

No scheduler runs (they need a GPU): the controller's dispatch methods are
SGLang's own, called on a controller whose two ranks' sockets record what
they are sent (``sock_send`` patched), so what is checked is the placement
itself: which rank each request, abort and control message reaches.
``CASES.json``: a list of ``{"frame": HEX, "method": "round_robin" |
"follow_bootstrap_room"}``; ``RESULTS.json``: ``{"cases": per case, the ranks
it reached or ``{"error": ...}``, "names": what runtime/contracts/sglang/sglang_headless.py
calls, as this release has it}``. The venv lacks a few modules the controller's module
imports for its process set-up (not for dispatching): they are stubbed by name.
"""

from __future__ import annotations

import importlib
import json
import sys
from unittest import mock

# Imported by data_parallel_controller for its process set-up and the HTTP server it never starts here.
STUBBED = ("setproctitle", "einops", "uvicorn", "fastapi", "fastapi.responses", "uvloop")


def _controller_module():
    for name in STUBBED:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            stub = mock.MagicMock(name=name)
            stub.__path__, stub.__spec__ = [], None
            if name == "uvloop":  # sglang.srt.entrypoints.engine installs its policy at import
                import asyncio

                stub.EventLoopPolicy = asyncio.DefaultEventLoopPolicy
            sys.modules[name] = stub
    return importlib.import_module("sglang.srt.managers.data_parallel_controller")


def main() -> int:
    cases = json.loads(open(sys.argv[1]).read())
    dpc = _controller_module()
    from sglang.srt.managers.io_struct import msgpack_decode

    sent: list[int] = []
    workers = [object(), object()]
    controller = object.__new__(dpc.DataParallelController)
    controller.workers = workers
    controller.status = [True, True]
    controller._active_workers = [0, 1]
    controller.round_robin_counter = 0
    controller.control_message_step = 1
    dpc.sock_send = lambda socket, obj: sent.append(workers.index(socket))
    results = []
    for case in cases:
        sent.clear()
        message = msgpack_decode(bytes.fromhex(case["frame"]))
        try:
            name = type(message).__name__
            if name in ("TokenizedGenerateReqInput", "TokenizedEmbeddingReqInput"):
                if case["method"] == "follow_bootstrap_room":
                    controller.follow_bootstrap_room_scheduler(message)
                else:
                    controller.round_robin_scheduler(message)
            else:  # aborts, flushes: the controller's fallback for every other message
                controller.send_control_message(message)
            results.append({"type": name, "ranks": list(sent)})
        except Exception as error:  # a refusal of the controller's own (a rank it does not have)
            results.append({"type": type(message).__name__, "error": f"{type(error).__name__}: {error}"})
    open(sys.argv[2], "w").write(json.dumps({"cases": results, "names": _headless_names()}))
    return 0


def _headless_names() -> dict:
    """What ``sglang_headless.py`` calls, read off this release: signatures, attributes."""
    import inspect

    import sglang.srt.entrypoints.engine as engine
    from sglang.srt.managers.disagg_service import start_disagg_service
    from sglang.srt.runtime_context import ParallelContext
    from sglang.srt.server_args import PortArgs

    return {
        "launch": list(inspect.signature(engine.Engine._launch_scheduler_processes).parameters)[:3],
        "port_args": list(inspect.signature(PortArgs.init_new).parameters),
        "disagg_service": list(inspect.signature(start_disagg_service).parameters),
        "attn_dp_enabled": hasattr(ParallelContext, "attn_dp_enabled"),
        "set_up": [name for name in ("configure_logger", "_set_envs_and_config", "load_plugins",
                                     "resolve_auto_parsers", "publish") if callable(getattr(engine, name, None))],
    }


if __name__ == "__main__":
    sys.exit(main())
