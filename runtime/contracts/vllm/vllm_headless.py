"""A headless vLLM engine that dials enginelink's handshake socket.

Run BY PATH with the vLLM venv's python (enginelink is not installed there):

    VENV/bin/python vllm_headless.py --handshake ipc:///PRIVATE/DIR/hs.sock \
        [--facts PATH] -- --model DIR [vLLM engine args...]
        (--facts defaults to $ENGINELINK_ENGINE_FACTS, which enginelink sets)

It does what ``vllm serve DIR --headless`` does for one node
(reference/vllm-engine-wire.md §1): build the engine config from vLLM's own
engine-argument parser, then run the ``EngineCore``: in this process for one
engine without data parallelism (``EngineCoreProc.run_engine_core``, what the
manager's spawned process would run), else one process per local DP rank with
``CoreEngineProcManager(local_client=False)``, watched. It needs no ``vllm``
dist-info shim, because it never goes through vLLM's CLI entry.

Rules:
- imports nothing of enginelink; only the standard library and vLLM, and
  vLLM only inside ``main`` (vLLM starts processes with spawn, so everything
  that builds an engine sits under ``if __name__ == "__main__"``);
- never orphans its engines: SIGTERM/SIGINT and the death of its parent
  (enginelink) both end it as ``vllm serve --headless`` does, with vLLM's
  ``shutdown_timeout`` capped at half of ``ENGINELINK_ENGINE_STOP_GRACE_SECS``
  (through ``CoreEngineProcManager.shutdown``, or for the core run here, that
  long for its own shutdown and then its Workers killed); then the launcher
  leaves at once (``os._exit``), well before enginelink's grace runs out;
- ``--facts`` writes the resolved engine config facts that the ready response
  lacks (kv cache dtype, served name, profiler) as JSON, before the engines start.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from urllib.parse import urlsplit

PARENT_POLL_S = 0.5
# enginelink SIGKILLs all of the engine this long after its SIGTERM
# (ENGINELINK_ENGINE_STOP_GRACE_SECS, read here too; the default is enginelink's).
STOP_GRACE_ENV = "ENGINELINK_ENGINE_STOP_GRACE_SECS"
STOP_GRACE_DEFAULT_S = 5.0


def core_stop_window_s(shutdown_timeout: float) -> float:
    """How long vLLM's process manager lets an EngineCore exit on its own before it kills it (and its Worker).

    vLLM's own ``shutdown_timeout`` (engine argument ``--shutdown-timeout``;
    0 by default: abort and kill at once, which is what ``vllm serve
    --headless`` does), but never more than half of enginelink's grace, so
    the launcher is done before enginelink escalates to SIGKILL. A longer
    window buys nothing on CPU: given 2.5 s, EngineCore waited for its
    Worker (vLLM lets a Worker take 5 s, then 4 s more after SIGTERM) and
    was killed anyway.
    """
    try:
        grace = float(os.environ.get(STOP_GRACE_ENV) or STOP_GRACE_DEFAULT_S)
    except ValueError:
        grace = STOP_GRACE_DEFAULT_S
    return max(0.0, min(float(shutdown_timeout), grace / 2))


def _watch_parent(parent: int) -> None:
    """SIGTERM ourselves when the parent goes (reparenting changes getppid)."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent:
            # The signal first: our stderr is a pipe to the servicer that just died, so
            # the line below may fail (EPIPE) and must not stop the shutdown.
            os.kill(os.getpid(), signal.SIGTERM)
            with contextlib.suppress(OSError):
                print("vllm-headless: parent process exited; shutting down", file=sys.stderr, flush=True)
            return


def _write_facts(path: str, vllm_config) -> None:
    model, cache = vllm_config.model_config, vllm_config.cache_config
    served = model.served_model_name
    facts = {
        "kv_cache_dtype": str(cache.cache_dtype),
        "served_model_name": served if isinstance(served, str) else (served or [model.model])[0],
        "dtype": str(model.dtype).removeprefix("torch."),
        "enable_prefix_caching": bool(cache.enable_prefix_caching),
        "profiler": getattr(vllm_config.profiler_config, "profiler", None),
        # vLLM's front end checks logprob counts against it; the EngineCore does not.
        "max_logprobs": int(model.max_logprobs),
        # "generate" or "pooling" (--runner, or what vLLM resolved for the model): which RPCs the engine can serve.
        "runner_type": str(model.runner_type),
        # The grammar backend its front end would resolve constraints for (--structured-outputs-config).
        "structured_outputs_backend": getattr(vllm_config.structured_outputs_config, "backend", None),
        **_pd_facts(vllm_config),
        **_media_facts(vllm_config),
    }
    _write_json(path, facts)


def _media_facts(vllm_config) -> dict:
    """A multimodal model's media bounds, as vLLM's own front end holds requests to them (enginelink's
    runtime/requests/media_bounds.py): the items per modality it allows (``--limit-mm-per-prompt`` within
    what the model supports; a modality absent takes none) and the encoder budget, the feature tokens one
    item may carry, from the ``MultiModalBudget`` helper the front end and the model runner share."""
    if not getattr(vllm_config.model_config, "is_multimodal_model", False):
        return {}
    try:
        from vllm.multimodal import MULTIMODAL_REGISTRY
        from vllm.multimodal.encoder_budget import MultiModalBudget

        budget = MultiModalBudget(vllm_config, MULTIMODAL_REGISTRY, enable_cache=False)
        return {"mm_item_limits": {str(m): int(n) for m, n in budget.mm_limits.items()},
                "mm_encoder_budget": max(int(budget.get_encoder_budget()), 0)}  # fmt: skip
    except Exception as error:  # the bounds go unchecked; the engine still starts
        print(f"vllm-headless: the media bounds are not known ({type(error).__name__}: {error}); media past "
              "them reaches the engine unchecked", file=sys.stderr, flush=True)  # fmt: skip
        return {}


def _pd_facts(vllm_config) -> dict:
    """The PD pairing identity GetServerInfo advertises (enginelink's runtime/contracts/vllm/kv_transfer.py reads it).

    Resolved by vLLM itself (an engine id left out is a fresh uuid, known only
    here). Names and ids only: the connector's extra config may hold
    credentials, and the facts are journaled. A MultiConnector's children go
    as [connector, engine id] pairs, for enginelink to project onto the one
    that moves the KV.
    """
    facts = {}
    attention = getattr(vllm_config, "attention_config", None)
    backend = getattr(attention, "backend", None)
    if backend is not None:
        facts["attention_backend"] = str(getattr(backend, "name", backend))
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None or not kv.kv_connector:
        return facts
    facts.update(kv_connector=kv.kv_connector, kv_role=kv.kv_role or "", kv_engine_id=kv.engine_id or "")
    children = (kv.kv_connector_extra_config or {}).get("connectors")
    if isinstance(children, list):
        facts["kv_connector_children"] = [
            [child.get("kv_connector"), child.get("engine_id")] if isinstance(child, dict) else None
            for child in children
        ]
    return facts


def _write_json(path: str, body: dict) -> None:
    """Atomically: enginelink reads the file after the process exits, or at the handshake."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(body, fh)
    os.replace(tmp, path)


def report_refused_arguments(parser: argparse.ArgumentParser, facts_path: str | None) -> None:
    """Launched by enginelink (``facts_path`` set): argparse's refusal goes to the facts file
    as ``refused_arguments`` instead of stderr, and the engine exits 2 as argparse does.

    enginelink's exit line then quotes it once, credentials redacted; argparse would print
    the whole usage (250 lines for vLLM) and the arguments verbatim. When the file cannot
    be written, argparse says it here as usual."""
    if not facts_path:
        return
    refuse = parser.error

    def error(message: str):
        try:
            _write_json(facts_path, {"refused_arguments": f"{parser.prog}: error: {message}"})
        except OSError:
            refuse(message)
        sys.exit(2)

    parser.error = error


def run_engine(handshake: str, facts_path: str | None, engine_argv: list[str]) -> int:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.utils import CoreEngineProcManager
    from vllm.v1.executor import Executor

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm-headless (enginelink)"))
    report_refused_arguments(parser, facts_path)
    args = parser.parse_args(engine_argv)
    engine_args = AsyncEngineArgs.from_cli_args(args)
    if handshake.startswith("tcp://"):
        # Only a tcp handshake names a host and port; for ipc (enginelink's
        # own, in its private socket directory) vLLM's defaults stand: one
        # node, and the manager dials the address it is given as it is.
        address = urlsplit(handshake)
        engine_args.data_parallel_address = address.hostname
        engine_args.data_parallel_rpc_port = address.port
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER, headless=True)
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size_local <= 0:
        raise SystemExit("vllm-headless: data_parallel_size_local must be > 0")
    if facts_path:
        _write_facts(facts_path, vllm_config)

    executor_class, log_stats = Executor.get_class(vllm_config), not engine_args.disable_log_stats
    if _core_runs_here(parallel):
        return _run_core_here(vllm_config, handshake, executor_class, log_stats)

    shutdown_requested = False

    def on_signal(signum, _frame):
        nonlocal shutdown_requested
        if not shutdown_requested:
            shutdown_requested = True
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    manager = CoreEngineProcManager(
        local_engine_count=parallel.data_parallel_size_local,
        start_index=parallel.data_parallel_rank,
        local_start_index=0,
        vllm_config=vllm_config,
        local_client=False,
        handshake_address=handshake,
        executor_class=executor_class,
        log_stats=log_stats,
    )
    try:
        manager.monitor_engine_liveness()
    finally:
        # The engine already aborted or finished every request (enginelink drained
        # first); EngineCore, at vLLM's shutdown_timeout 0, aborts what is left.
        manager.shutdown(timeout=core_stop_window_s(vllm_config.shutdown_timeout) if shutdown_requested else None)
    if shutdown_requested:
        return 0
    failed = manager.failed_proc_name
    print(f"vllm-headless: engine process {failed or '?'} exited", file=sys.stderr, flush=True)
    return 1


def _core_runs_here(parallel) -> bool:
    """One engine, no data parallelism, no NUMA wrapper: the EngineCore runs in this process.

    ``CoreEngineProcManager`` would spawn a process that imports torch and vLLM
    again only to run ``EngineCoreProc.run_engine_core``, which this process can
    run itself: measured on CPU with the test model, 25.0 -> 18.3-18.9 CPU-s and
    23 -> 17 s from launch to serving, and the same engine (the same handshake,
    executor and Worker). DP ranks keep the manager (one process per rank), and
    so does ``--numa-bind``, which wraps the spawned EngineCore in numactl."""
    return (parallel.data_parallel_size == 1 and parallel.data_parallel_size_local == 1
            and not getattr(parallel, "numa_bind", False))  # fmt: skip


def _run_core_here(vllm_config, handshake: str, executor_class, log_stats: bool) -> int:
    """``EngineCoreProc.run_engine_core`` in this process, its stop bounded as the manager bounds it.

    vLLM's core installs its own SIGTERM/SIGINT handler (shut down, at its
    ``shutdown_timeout``); a signal also wakes ``_bound_the_stop`` through the
    wakeup fd, which gives that shutdown ``core_stop_window_s`` and then kills
    the Worker and leaves, as the manager kills the EngineCore's process tree."""
    from vllm.v1.engine import utils as engine_utils
    from vllm.v1.engine.core import EngineCoreProc

    wakeup_read, wakeup_write = socket.socketpair()
    wakeup_write.setblocking(False)
    signal.set_wakeup_fd(wakeup_write.fileno(), warn_on_full_buffer=False)
    window_s = core_stop_window_s(vllm_config.shutdown_timeout)
    threading.Thread(target=_bound_the_stop, args=(wakeup_read, window_s), name="stop-bound", daemon=True).start()
    # What the manager does around a single UniProc engine's spawn on a GPU (0.32+): startup threads for
    # weight loading, within the CPUs this process may use. A no-op on CPU and for multiprocess executors.
    startup_threads = getattr(engine_utils, "_configure_uniproc_startup_threads", None)
    threads = startup_threads(executor_class, 1) if startup_threads else contextlib.nullcontext()
    # vLLM's log lines name their process ("(EngineCore pid=...)"), as they do for the manager's child.
    multiprocessing.current_process().name = "EngineCore"
    try:
        with threads:
            EngineCoreProc.run_engine_core(vllm_config=vllm_config, local_client=False, handshake_address=handshake,
                                           executor_class=executor_class, log_stats=log_stats, dp_rank=0,
                                           local_dp_rank=0)  # fmt: skip
    except SystemExit as stop:  # vLLM's core ends its busy loop so on a signal
        return stop.code if isinstance(stop.code, int) else 0
    except Exception as error:  # vLLM logged it ("EngineCore failed to start" or "fatal error")
        print(f"vllm-headless: the engine core failed ({type(error).__name__}: {error})", file=sys.stderr, flush=True)
        return 1
    return 0


STOPPING_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def _bound_the_stop(wakeup: socket.socket, window_s: float) -> None:
    """On SIGTERM/SIGINT: ``window_s`` for vLLM's own shutdown, then the Worker killed and this process gone."""
    while not STOPPING_SIGNALS.intersection(wakeup.recv(64)):
        pass
    time.sleep(window_s)
    from vllm.utils.system_utils import kill_process_tree

    # The executor's Workers (multiprocessing's children), not the resource tracker, which cleans up after us.
    for child in multiprocessing.active_children():
        with contextlib.suppress(Exception):
            kill_process_tree(child.pid)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str]) -> int:
    if "--" in argv:
        split = argv.index("--")
        own, engine_argv = argv[:split], argv[split + 1 :]
    else:
        own, engine_argv = argv, []
    parser = argparse.ArgumentParser(prog="vllm_headless.py")
    parser.add_argument("--handshake", help="enginelink's handshake ROUTER: ipc://PATH (what enginelink passes) or tcp://HOST:PORT")
    parser.add_argument("--facts", default=os.environ.get("ENGINELINK_ENGINE_FACTS"),
                        help="write resolved engine facts (JSON) here (default: $ENGINELINK_ENGINE_FACTS)")
    args = parser.parse_args(own)
    if not args.handshake:
        parser.error("--handshake is required")
    parent = os.getppid()
    threading.Thread(target=_watch_parent, args=(parent,), name="parent-watch", daemon=True).start()
    try:
        status = run_engine(args.handshake, args.facts, engine_argv)
    except SystemExit as stop:  # a signal, or a refused configuration
        if stop.code is None or isinstance(stop.code, int):
            status = stop.code or 0
        else:
            print(stop.code, file=sys.stderr, flush=True)
            status = 2
    # The engine processes are gone (vLLM's process manager saw to it): leave
    # now. The interpreter's own teardown (torch, vLLM's modules) kept the
    # launcher busy 2.5 s after its engines were gone here, on 2 loaded cores,
    # and stops nothing; the multiprocessing resource tracker still cleans up
    # after us (leaked shared memory), as it does on any exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
