"""The sim engine's process shell for the TokenSpeed and SGLang wires (``--wire``).

The personalities themselves are sans-io (``machines/sim_wires.py``); this
file only connects their sockets as the real engine does, reports readiness
the way that engine does, and runs the sim process's engine loop (``sim_process.serve``:
the same polling, step timing, KV publishing, signals and parent watch).

- TokenSpeed (``ts serve --headless``): a DEALER with identity = rank (2 bytes
  LE) dials the handshake ROUTER: HELLO (every key, ``parallel_config_hash:
  None``), INIT with the addresses, READY on the handshake socket, then the
  ready response on a DEALER to ``inputs[0]``, outputs on a PUSH to
  ``outputs[0]`` (reference ``tokenspeed.md`` §5).
- SGLang 0.5.23 (a scheduler rank, msgpack IPC): no handshake. The front end binds; the scheduler connects a PULL to
  ``scheduler_input_ipc_name`` and a PUSH to ``tokenizer_ipc_name`` (outputs
  and control replies alike), then reports ``{"status": "ready", ...}``
  through its spawn pipe (``sglang-wire.md`` §1, §5). The sim writes that
  report as one JSON line to ``--ready-fd`` (what a launcher bridging the
  real scheduler's ``multiprocessing`` pipe would forward), and on stderr,
  with the ``server_args`` enginelink's launch script adds to the real one's
  (``sglang_server_args``: its SGLang flags as given, SGLang's defaults else).
  The rpc and metrics sockets are not simulated (enginelink uses neither).
  ``--dp-size N``: N scheduler ranks (one sim core each) behind SGLang's DP
  controller, in this one process (``machines/sim_legs.py``); one ready
  report for all, as the controller sends.
- PD (both wires, ``--disaggregation-mode prefill|decode``): the personality
  plays the leg (``machines/sim_legs.py``); a prefill leg also listens on
  ``--disaggregation-bootstrap-port`` (127.0.0.1), as the engine's KV
  bootstrap server does, so the router's registration probe finds it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path

import msgspec
import zmq

from enginelink.machines.sim_core import SimConfig, SimEngineCore
from enginelink.machines.sim_legs import SglangDpController, SimLeg
from enginelink.machines.sim_wires import SglangPersonality, TokenSpeedPersonality
from enginelink.tools import sim_process as shell
from enginelink.wire import tokenspeed, vllm


def run_wire(args: argparse.Namespace, config: SimConfig) -> int:
    life = shell.Lifetime(ignore_sigterm=args.fault_ignore_sigterm)
    ctx = zmq.Context()
    leg = SimLeg(mode=args.disaggregation_mode, bootstrap_port=args.disaggregation_bootstrap_port,
                 load_balance_method=args.load_balance_method, dp_size=args.data_parallel_size)
    # One listener per launch: a TokenSpeed DP rank other than 0 leaves it to rank 0.
    bootstrap = _bootstrap_listener(leg) if leg.mode == "prefill" and args.rank == 0 else None
    try:
        if args.wire == "tokenspeed":
            return _run_tokenspeed(ctx, args, config, life, leg)
        return _run_sglang(ctx, args, config, life, leg)
    finally:
        ctx.destroy(linger=0)
        if bootstrap is not None:
            bootstrap.close()


def _bootstrap_listener(leg: SimLeg) -> socket.socket:
    """The prefill leg's KV bootstrap port, listening on loopback: connections are accepted and closed
    (a thread of its own; the sim moves no KV), so a probe of the port finds a server."""
    listener = socket.create_server(("127.0.0.1", leg.bootstrap_port), reuse_port=False)

    def serve() -> None:
        with contextlib.suppress(OSError):  # closed at exit
            while True:
                connection, _ = listener.accept()
                connection.close()

    threading.Thread(target=serve, name="sim-bootstrap", daemon=True).start()
    shell.log(f"pd prefill leg: bootstrap server on 127.0.0.1:{leg.bootstrap_port}")
    return listener


def _load(args: argparse.Namespace, life: shell.Lifetime) -> None:
    """A real engine loads its model here (--startup-delay-s), still answering signals."""
    loading_until = time.monotonic() + args.startup_delay_s
    while time.monotonic() < loading_until and not life.reason():
        time.sleep(0.01)
    if args.bind_cpu is not None:
        shell.start_bound_thread(args.bind_cpu)


def _run_tokenspeed(ctx: zmq.Context, args: argparse.Namespace, config: SimConfig, life: shell.Lifetime,
                    leg: SimLeg) -> int:
    identity = tokenspeed.TokenSpeedHandshake.identity(args.rank)
    hs = ctx.socket(zmq.DEALER)
    hs.setsockopt(zmq.IDENTITY, identity)
    hs.setsockopt(zmq.LINGER, 5000)
    while args.hello_gate is not None and not args.hello_gate.exists():
        if life.reason():
            return 0
        time.sleep(shell.IDLE_POLL_MS / 1000)
    hs.connect(args.handshake)
    hs.send(tokenspeed.encode_handshake_status("HELLO"))
    deadline = time.monotonic() + shell.HANDSHAKE_TIMEOUT_S
    while not hs.poll(shell.IDLE_POLL_MS):
        if life.reason() or time.monotonic() > deadline:
            shell.log(f"no handshake init ({life.reason() or 'timed out'})")
            return 0 if life.reason() else 1
    init = vllm.decode_handshake_init(hs.recv())
    _load(args, life)
    hooks, kv_sockets, kv_resolved = shell.kv_publisher(ctx, args, config)
    # TokenSpeed's order: READY on the handshake socket, then the ready response on the input socket.
    hs.send(tokenspeed.encode_handshake_status("READY"))
    inputs = ctx.socket(zmq.DEALER)
    inputs.setsockopt(zmq.IDENTITY, identity)
    inputs.connect(init.addresses.inputs[0])
    inputs.send(tokenspeed.encode_ready_response(ready_response(config, kv_resolved)))
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 4000)
    outputs.connect(init.addresses.outputs[0])
    shell.log(f"ready (tokenspeed wire, rank {args.rank}, vocab {config.vocab_size})")
    if args.fault_stray_child:
        shell.log(f"stray child {shell.start_stray_child()} started")
    personality = TokenSpeedPersonality(SimEngineCore(config, hooks), leg)
    reason = shell.serve(personality, inputs, outputs, life, kv_sockets)
    shell.log(f"stopping: {reason}")
    return 0


def ready_response(config: SimConfig, kv_events_config: dict | None = None) -> tokenspeed.WireEngineCoreReadyResponse:
    tokens = config.num_gpu_blocks * config.block_size
    return tokenspeed.WireEngineCoreReadyResponse(
        max_model_len=config.max_model_len, num_gpu_blocks=config.num_gpu_blocks,
        prefix_granularity=config.block_size, dtype=config.dtype, vllm_version=tokenspeed.ready_version(),
        data_parallel_size=config.data_parallel_size, data_parallel_rank=config.engine_index,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        instance_id=config.instance_id, kv_cache_size_tokens=tokens,
        kv_cache_max_concurrency=tokens / config.max_model_len, kv_events_config=kv_events_config,
    )


def sglang_server_args(args: argparse.Namespace) -> dict:
    """The resolved server arguments ``runtime/contracts/sglang/sglang_headless.py`` reports (``REPORTED``), as a
    scheduler given the sim's SGLang flags would resolve them (an unset grammar backend is xgrammar)."""
    return {"skip_tokenizer_init": bool(args.skip_tokenizer_init),
            "grammar_backend": getattr(args, "grammar_backend", None) or "xgrammar",
            "reasoning_parser": getattr(args, "reasoning_parser", None),
            "enable_custom_logit_processor": bool(getattr(args, "enable_custom_logit_processor", False)),
            "limit_mm_data_per_request": getattr(args, "limit_mm_data_per_request", None),
            "tokenizer_path": str(args.model)}


def sglang_supports_vision(args: argparse.Namespace) -> bool:
    """What the real launcher reports from SGLang's model config (``sglang_headless.image_understanding``), as the
    sim can tell it: a vision tower in the model's config.json, and no ``--language-model-only``."""
    from enginelink.runtime.engine.model_dir import ModelDirError, read_model_facts

    try:
        facts = read_model_facts(Path(args.model))
    except (ModelDirError, OSError):
        return False
    return facts.supports_vision and not getattr(args, "language_model_only", False)


def sglang_ready_report(config: SimConfig, started: float, server_args: dict | None = None) -> dict:
    """What ``run_scheduler_process`` sends through its pipe once loaded (the keys a front end reads)."""
    tokens = config.num_gpu_blocks * config.block_size
    return {"status": "ready", "max_total_num_tokens": tokens,
            "max_req_input_len": min(config.max_model_len - 1, tokens - 1),
            "startup_time": started, "max_running_requests": config.max_num_seqs,
            "is_generation": config.runner != "pooling", "server_args": server_args or {}}


def _run_sglang(ctx: zmq.Context, args: argparse.Namespace, config: SimConfig, life: shell.Lifetime,
                leg: SimLeg) -> int:
    started = time.time()
    while args.hello_gate is not None and not args.hello_gate.exists():
        if life.reason():
            return 0
        time.sleep(shell.IDLE_POLL_MS / 1000)
    _load(args, life)
    vision = sglang_supports_vision(args)
    ranks, kv_sockets = [], []
    for rank in range(args.data_parallel_size):  # SGLang's DP ranks, each its own core and KV publisher
        rank_config = msgspec.structs.replace(config, engine_index=rank)
        hooks, kv, _ = shell.kv_publisher(ctx, argparse.Namespace(**{**vars(args), "rank": rank}), rank_config)
        ranks.append(SglangPersonality(SimEngineCore(rank_config, hooks), leg, supports_vision=vision))
        kv_sockets += [kv] if kv is not None else []
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(args.scheduler_input_ipc)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 4000)
    outputs.connect(args.tokenizer_ipc)
    report = json.dumps({**sglang_ready_report(config, started, sglang_server_args(args)),
                         "supports_vision": vision})
    if args.ready_fd is not None:
        with contextlib.suppress(OSError), os.fdopen(args.ready_fd, "w") as pipe:
            pipe.write(report + "\n")
    shell.log(f"ready (sglang wire) {report}")
    if args.fault_stray_child:
        shell.log(f"stray child {shell.start_stray_child()} started")
    personality = ranks[0] if len(ranks) == 1 else SglangDpController(ranks, leg)
    reason = shell.serve(personality, inputs, outputs, life, kv_sockets)
    shell.log(f"stopping: {reason}")
    return 0
