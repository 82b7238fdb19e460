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
- SGLang 0.5.23 (a scheduler rank under ``--skip-tokenizer-init``, msgpack
  IPC): no handshake. The front end binds; the scheduler connects a PULL to
  ``scheduler_input_ipc_name`` and a PUSH to ``tokenizer_ipc_name`` (outputs
  and control replies alike), then reports ``{"status": "ready", ...}``
  through its spawn pipe (``sglang-wire.md`` §1, §5). The sim writes that
  report as one JSON line to ``--ready-fd`` (what a launcher bridging the
  real scheduler's ``multiprocessing`` pipe would forward), and on stderr.
  The rpc and metrics sockets are not simulated (enginelink uses neither).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import zmq

from enginelink.machines.sim_core import SimConfig, SimEngineCore
from enginelink.machines.sim_wires import SglangPersonality, TokenSpeedPersonality
from enginelink.tools import sim_process as shell
from enginelink.wire import tokenspeed, vllm


def run_wire(args: argparse.Namespace, config: SimConfig) -> int:
    life = shell.Lifetime(ignore_sigterm=args.fault_ignore_sigterm)
    ctx = zmq.Context()
    try:
        if args.wire == "tokenspeed":
            return _run_tokenspeed(ctx, args, config, life)
        return _run_sglang(ctx, args, config, life)
    finally:
        ctx.destroy(linger=0)


def _load(args: argparse.Namespace, life: shell.Lifetime) -> None:
    """A real engine loads its model here (--startup-delay-s), still answering signals."""
    loading_until = time.monotonic() + args.startup_delay_s
    while time.monotonic() < loading_until and not life.reason():
        time.sleep(0.01)
    if args.bind_cpu is not None:
        shell.start_bound_thread(args.bind_cpu)


def _run_tokenspeed(ctx: zmq.Context, args: argparse.Namespace, config: SimConfig, life: shell.Lifetime) -> int:
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
    personality = TokenSpeedPersonality(SimEngineCore(config, hooks))
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


def sglang_ready_report(config: SimConfig, started: float) -> dict:
    """What ``run_scheduler_process`` sends through its pipe once loaded (the keys a front end reads)."""
    tokens = config.num_gpu_blocks * config.block_size
    return {"status": "ready", "max_total_num_tokens": tokens,
            "max_req_input_len": min(config.max_model_len - 1, tokens - 1),
            "startup_time": started, "max_running_requests": config.max_num_seqs,
            "is_generation": config.runner != "pooling"}


def _run_sglang(ctx: zmq.Context, args: argparse.Namespace, config: SimConfig, life: shell.Lifetime) -> int:
    started = time.time()
    while args.hello_gate is not None and not args.hello_gate.exists():
        if life.reason():
            return 0
        time.sleep(shell.IDLE_POLL_MS / 1000)
    _load(args, life)
    hooks, kv_sockets, _ = shell.kv_publisher(ctx, args, config)
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(args.scheduler_input_ipc)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 4000)
    outputs.connect(args.tokenizer_ipc)
    report = json.dumps(sglang_ready_report(config, started))
    if args.ready_fd is not None:
        with contextlib.suppress(OSError), os.fdopen(args.ready_fd, "w") as pipe:
            pipe.write(report + "\n")
    shell.log(f"ready (sglang wire) {report}")
    if args.fault_stray_child:
        shell.log(f"stray child {shell.start_stray_child()} started")
    personality = SglangPersonality(SimEngineCore(config, hooks))
    reason = shell.serve(personality, inputs, outputs, life, kv_sockets)
    shell.log(f"stopping: {reason}")
    return 0
