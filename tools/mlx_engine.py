"""The MLX engine process: mlx-lm on the engine side of vLLM's headless wire.

``enginelink serve --engine mlx`` launches it with the MLX venv's python
(tools/setup-mlx) as ``python -m enginelink.tools.mlx_engine --handshake ADDR
--model DIR [flags]``. It behaves like one rank of ``vllm serve --headless``,
as the sim engine does (``sim_engine.py``): dial the handshake ROUTER, HELLO,
take the init message, load the model, send the ready response on the input
socket, READY, then serve. The core (``mlx_core.py``) owns mlx-lm.

Why a process and not a thread in the servicer: the reference servicer runs
mlx-lm in its gRPC process, and a token id outside the vocabulary segfaulted
the whole server (reference/mlx.md §3.1). Here a crash is an engine death the
link already handles: every open stream UNAVAILABLE, exit 1.

Rules:
- ONE thread: this loop reads the sockets and steps the generator, so every
  MLX object is made and used on the thread that loaded the model.
- while requests generate, inputs are polled without waiting between steps
  (an abort lands before the next step); idle, it waits IDLE_POLL_MS, or
  while the core holds a burst of new requests (``mlx_admission``), until
  that burst is due.
- it never orphans: SIGTERM/SIGINT end it with status 0, and it exits when
  its parent goes (``sim_process.Lifetime``).
- imports of enginelink: the wire and the sim engine's process helpers only
  (msgspec and pyzmq: all the MLX venv has of enginelink's dependencies).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import zmq

from enginelink.tools.mlx_admission import GAP_MS_DEFAULT, MAX_MS_DEFAULT
from enginelink.tools.sim_engine import _handshake
from enginelink.tools.sim_process import IDLE_POLL_MS, Lifetime
from enginelink.wire import vllm
from enginelink.wire.engine import WireError

# runtime/engine/zmq_transport.py's ENGINE_FACTS_ENV (that module needs trio, which this venv lacks;
# tests/mlx/test_mlx_units.py checks the two agree).
ENGINE_FACTS_ENV = "ENGINELINK_ENGINE_FACTS"

DESCRIPTION = """\
Run mlx-lm's BatchGenerator as one rank of `vllm serve --headless`, on vLLM's wire.
`enginelink serve --engine mlx` launches it (with the MLX venv's python) and fills in
--handshake and --model; give it the other flags after serve's `--`, e.g.
  enginelink serve --engine mlx --model DIR -- --completion-batch-size 16"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.add_argument("--handshake", required=True, help="the front end's handshake ROUTER: ipc://PATH or tcp://HOST:PORT")
    parser.add_argument("--model", required=True, type=Path, help="model directory mlx-lm loads (config.json, safetensors)")
    parser.add_argument("--completion-batch-size", type=int, default=32,
                        help="sequences generating at once (default 32, mlx_lm.server's)")
    parser.add_argument("--prefill-batch-size", type=int, default=8, help="prompts prefilled together (default 8)")
    parser.add_argument("--prefill-step-size", type=int, default=2048,
                        help="prompt tokens per prefill chunk (default 2048)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length (default: the model's, from config.json; never more)")
    parser.add_argument("--max-logprobs", type=int, default=20,
                        help="largest logprobs count a request may ask for, -1: the vocabulary (vLLM's flag; default 20)")
    parser.add_argument("--coalesce-gap-ms", type=float, default=GAP_MS_DEFAULT,
                        help="new requests join the batch together once none has arrived for this long "
                             f"(default {GAP_MS_DEFAULT:g})")
    parser.add_argument("--coalesce-max-ms", type=float, default=MAX_MS_DEFAULT,
                        help="... or this long after the first of them (default "
                             f"{MAX_MS_DEFAULT:g}; 0: each request joins at the next step, as it arrived)")


def _log(message: str) -> None:
    try:
        print(f"mlx-engine[{os.getpid()}]: {message}", file=sys.stderr, flush=True)
    except OSError:  # our stderr is the servicer's pipe; once it is gone a line is lost, not the shutdown
        pass


def _write_facts(path: str | None, facts: dict) -> None:
    if path:
        tmp = f"{path}.{os.getpid()}.tmp"
        Path(tmp).write_text(json.dumps(facts))
        os.replace(tmp, path)


def run(args: argparse.Namespace) -> int:
    from enginelink.tools import mlx_core

    life = Lifetime()
    ctx = zmq.Context()
    args.rank, args.hello_gate = 0, None  # what sim_engine._handshake reads
    try:
        started = _handshake(ctx, args, life)
        if started is None:
            _log(f"no handshake init ({life.reason() or 'timed out'})")
            return 0 if life.reason() else 1
        handshake, init = started
        loaded = time.monotonic()
        model, model_config = mlx_core.load(args.model)
        config = mlx_core.MlxConfig(
            completion_batch_size=args.completion_batch_size, prefill_batch_size=args.prefill_batch_size,
            prefill_step_size=args.prefill_step_size, max_model_len=args.max_model_len,
            max_logprobs=args.max_logprobs, coalesce_gap_s=args.coalesce_gap_ms / 1000,
            coalesce_max_s=args.coalesce_max_ms / 1000,
        )  # fmt: skip
        core = mlx_core.MlxEngineCore(model, model_config, config)
        _log(f"model loaded in {time.monotonic() - loaded:.2f} s (vocab {core.vocab_size}, "
             f"max_model_len {core.max_model_len})")
        inputs = ctx.socket(zmq.DEALER)
        inputs.setsockopt(zmq.IDENTITY, (0).to_bytes(2, "little"))
        inputs.connect(init.addresses.inputs[0])
        inputs.send(vllm.encode_ready_response(core.ready_response(f"mlx-{os.getpid()}")))
        outputs = ctx.socket(zmq.PUSH)
        outputs.setsockopt(zmq.LINGER, 4000)
        outputs.connect(init.addresses.outputs[0])
        handshake.send(vllm.encode_handshake_status(vllm.HandshakeStatus(status="READY", local=False, headless=True)))
        reason = _serve(core, inputs, outputs, life)
        _log(f"stopping: {reason}; {core.summary()}")
        core.close()
        return 0
    finally:
        ctx.destroy(linger=0)


def _serve(core, inputs: zmq.Socket, outputs: zmq.Socket, life: Lifetime) -> str:
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    while True:
        if (reason := life.reason()) is not None:
            return reason
        if core.generating:
            timeout = 0
        else:  # idle, or holding a burst that is not due yet
            wait = core.admission_wait_s(time.monotonic())
            timeout = IDLE_POLL_MS if wait is None else min(IDLE_POLL_MS, math.ceil(wait * 1000))
        if dict(poller.poll(timeout)):
            while True:  # everything already here, before the next step
                try:
                    frames = inputs.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) < 2:
                    _log(f"ignored a {len(frames)}-frame input message")
                    continue
                try:
                    messages = core.handle_input(frames[0], frames[1], time.monotonic())
                except WireError as exc:
                    _log(f"ignored input: {exc}")
                    continue
                for message in messages:
                    outputs.send_multipart(message)
        if core.has_work:
            for message in core.step(time.monotonic()):
                outputs.send_multipart(message)


def main(argv: list[str] | None = None) -> int:
    from enginelink.runtime.contracts.vllm.vllm_headless import report_refused_arguments  # standard library only

    parser = argparse.ArgumentParser(prog="python -m enginelink.tools.mlx_engine", description=DESCRIPTION)
    add_arguments(parser)
    facts_path = os.environ.get(ENGINE_FACTS_ENV)
    report_refused_arguments(parser, facts_path)  # launched by enginelink: a refusal lands where it reads it
    args = parser.parse_args(argv)
    for name in ("completion_batch_size", "prefill_batch_size", "prefill_step_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected >= 1")
    if args.max_model_len is not None and args.max_model_len < 2:
        parser.error(f"--max-model-len {args.max_model_len}: expected >= 2")
    for name in ("coalesce_gap_ms", "coalesce_max_ms"):
        if not 0 <= getattr(args, name) <= 10_000:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected 0 to 10000")
    if args.max_logprobs < -1:
        parser.error(f"--max-logprobs {args.max_logprobs}: expected -1 (the vocabulary) or >= 0")
    # What vLLM's launch script reports beside the ready response (runtime/contracts/vllm/vllm_headless.py).
    _write_facts(facts_path, {"runner_type": "generate", "max_logprobs": args.max_logprobs,
                              "enable_prefix_caching": False, "engine": "mlx",
                              "coalesce_gap_ms": args.coalesce_gap_ms, "coalesce_max_ms": args.coalesce_max_ms})
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
