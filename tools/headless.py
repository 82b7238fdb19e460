"""``enginelink headless``: the servicer as an engine on the SMG router's direct ZMQ lane.

    enginelink headless --engine sglang --zmq-handshake-address tcp://HOST:PORT [--zmq-engine-index N]
                        [--model DIR] [--journal PATH] [serve's flags] [-- SGLANG ARGS]

What ``smg serve --backend sglang --connection-mode zmq`` launches in the
reference (``python -m smg_grpc_servicer.sglang.headless``, which SMG points at
the handshake port it derives from the worker's ``ipc://`` URL): here the
servicer runs its engine as ``enginelink serve`` does (``--engine sglang``, or
the sim with ``--wire sglang``) and, once it serves, dials the router as the
engine, relaying the lane's requests and outputs through its request machines
(``runtime/contracts/sglang/router_front.py``). No gRPC port. The journal is the
servicer's (``inspect`` and ``journal replay`` read it; by default it is named
after the handshake port: ``enginelink inspect --port PORT``).

The router's lane for vLLM and TokenSpeed speaks those engines' own wires
(their engines dial the router themselves), and is not served here.
"""

from __future__ import annotations

import argparse
import sys

import trio

from enginelink.tools import serve

LANE_CONTRACTS = ("sglang",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    serve.add_arguments(p)
    p.description = __doc__
    p.add_argument("--zmq-handshake-address", required=True, metavar="tcp://HOST:PORT",
                   help="the router's handshake socket (what SMG derives from the worker's ipc:// URL)")
    p.add_argument("--zmq-engine-index", type=int, default=0, metavar="N",
                   help="the engine index this servicer registers as (its 2-byte identity; default 0)")


def _handshake_port(address: str) -> int | None:
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return int(port)


def run(args: argparse.Namespace) -> int:
    from enginelink.journal.files import default_journal_path
    from enginelink.runtime.lifetime.engines import choose
    from enginelink.wire.sglang_router import ENGINE_INDEX_MAX

    prog = "enginelink headless"
    port = _handshake_port(args.zmq_handshake_address)
    if port is None:
        print(f"{prog}: --zmq-handshake-address must be tcp://HOST:PORT, got {args.zmq_handshake_address!r}",
              file=sys.stderr)
        return 2
    if not 0 <= args.zmq_engine_index <= ENGINE_INDEX_MAX:
        print(f"{prog}: --zmq-engine-index must be in 0..{ENGINE_INDEX_MAX}", file=sys.stderr)
        return 2
    try:
        contract = choose(args.engine, getattr(args, "wire", None)).contract
    except KeyError as error:
        print(f"{prog}: {error.args[0]}", file=sys.stderr)
        return 2
    if contract not in LANE_CONTRACTS:
        print(f"{prog}: the router's ZMQ lane is served for SGLang (--engine sglang, or the sim with --wire sglang); "
              f"--engine {args.engine} speaks {contract}, whose lane is that engine's own wire", file=sys.stderr)
        return 2
    if args.journal is None:
        args.journal = default_journal_path(port)
    config = serve.prepare(args, prog)
    if isinstance(config, int):
        return config
    from enginelink.runtime.lifetime import core
    from enginelink.runtime.contracts.sglang.router_front import LaneConfig
    from enginelink.runtime.lifetime.server import serve_headless

    lane = LaneConfig(args.zmq_handshake_address, args.zmq_engine_index)
    try:
        return trio.run(serve_headless, config, lane)
    except core.Exit as refused:
        print(f"{prog}: {refused.reason}", file=sys.stderr)
        return refused.status
