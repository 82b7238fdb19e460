"""``enginelink sim-engine``: the sim engine as a process, on vLLM's headless wire.

The process shell around ``machines/sim_core.py``'s ``SimEngineCore``. It behaves like one rank
of ``vllm serve MODEL --headless``: it dials the front end's handshake ROUTER
and runs the handshake of reference §3, then serves the input and output
sockets the front end named. Runnable as ``python -m enginelink.tools.sim_engine``.

Rules:
- the core decides everything; this file only moves frames, keeps time
  (``time.monotonic``, like vLLM's engine timestamps) and waits. A step's cost
  is waited out by polling the input socket until the step's deadline, so
  aborts and utility calls are still read while "the GPU is busy".
- one front end (client index 0): inputs[0] and outputs[0] of the init message.
- data parallelism as ``vllm serve --headless --data-parallel-size N`` does it:
  the launched process runs no rank itself; it starts one process per rank
  (``--rank i``, identity = i as 2 bytes little-endian, each its own
  handshake) and watches them, as vLLM's ``CoreEngineProcManager`` does: one
  rank exiting stops the others and the launcher exits 1; SIGTERM stops
  every rank (0). ``sim_ranks.py``.
- it never orphans: SIGTERM/SIGINT end it with status 0, and it exits when
  its parent process goes away (``os.getppid`` changes).
- plain blocking pyzmq is fine here: this is its own process, outside trio.
  Its lifetime, engine loop and KV sockets are every wire's (``sim_process.py``).
- KV events (``--kv-events-config JSON``, the flag and keys of the engine
  its wire plays: vLLM's, SGLang's or TokenSpeed's, ``wire/kv_engines.py``):
  a PUB socket that binds or connects by that engine's rule and a replay
  ROUTER that always binds, both offset by the rank; one batch per engine
  step that has events, encoded as that engine's publisher does
  (``sim_kv.py``). The ready response's ``kv_events_config`` carries the
  config with the endpoints this rank actually bound (a tcp port 0 resolved).
  ``--kv-fault-*`` plan publisher faults; the utility call
  ``enginelink_sim_kv_fault(kind, count)`` injects them at run time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import zmq

from enginelink.machines.sim_core import SimConfig, SimEngineCore, ready_response
from enginelink.machines.sim_legs import LEG_MODES, SimLeg
from enginelink.tools.sim_process import (
    HANDSHAKE_TIMEOUT_S, IDLE_POLL_MS, Lifetime, kv_publisher, log, serve, start_bound_thread, start_stray_child,
)
from enginelink.wire import kv_engines, vllm
from enginelink.wire.engine import WireError

WIRES = ("vllm", "tokenspeed", "sglang")

SIM_DESCRIPTION = """\
Run the deterministic sim engine: one rank of `vllm serve --headless`, on vLLM's wire
(--wire tokenspeed: a `ts serve --headless` rank; --wire sglang: an SGLang scheduler).
`enginelink serve` launches it (the default --engine sim) and fills in --handshake and
--model; give it the other flags after serve's `--`, e.g.
  enginelink serve -- --step-us 20000 --max-num-seqs 64
Settings of the servicer itself: docs/running.md, "Settings"; this engine: docs/engines/sim.md."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = SIM_DESCRIPTION
    parser.add_argument("--wire", choices=WIRES, default="vllm",
                        help="the engine wire it speaks: vllm (default, a vllm serve --headless rank), tokenspeed "
                        "(ts serve --headless), or sglang (an SGLang 0.5.23 scheduler in msgpack mode); "
                        "docs/simulation.md")
    parser.add_argument("--handshake", default=None,
                        help="the front end's handshake ROUTER: ipc://PATH or tcp://HOST:PORT (vllm, tokenspeed)")
    parser.add_argument("--scheduler-input-ipc", default=None, metavar="ADDR",
                        help="sglang: PortArgs.scheduler_input_ipc_name, the front end's bound PUSH (we connect PULL)")
    parser.add_argument("--tokenizer-ipc", default=None, metavar="ADDR",
                        help="sglang: PortArgs.tokenizer_ipc_name, the front end's bound PULL (we connect PUSH)")
    parser.add_argument("--ready-fd", type=int, default=None, metavar="FD",
                        help="sglang: write the scheduler's ready report, one JSON line, to this inherited fd")
    parser.add_argument("--model", required=True, type=Path, help="model directory holding config.json")
    parser.add_argument("--rank", type=int, default=0, help="data-parallel rank (engine index and identity)")
    parser.add_argument("--data-parallel-size", "-dp", "--dp-size", "--dp", type=int, default=1, metavar="N",
                        help="run N engine ranks (0..N-1), one process each, as vllm serve --headless does "
                        "(--wire sglang: N scheduler ranks behind SGLang's DP controller, in this process)")
    parser.add_argument("--disaggregation-mode", choices=LEG_MODES, default="null",
                        help="sglang, tokenspeed: a PD leg (prefill: one token, then done; decode: a whole "
                        "generation), as the engines' flag; docs/pd.md")
    parser.add_argument("--disaggregation-bootstrap-port", type=int, default=8998, metavar="PORT",
                        help="a prefill leg listens on it (127.0.0.1) as the engine's KV bootstrap server does")
    parser.add_argument("--disaggregation-transfer-backend", default="mooncake",
                        help="accepted for the engines' argv (the sim moves no KV)")
    parser.add_argument("--load-balance-method", default="auto",
                        help="sglang: the DP controller's balance (auto: follow_bootstrap_room on a prefill "
                        "leg, else round_robin)")
    parser.add_argument("--data-parallel-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prefill-us-per-token", type=float, default=0.0, metavar="US",
                        help="cost model: microseconds of a step per prompt token it prefills (default 0)")
    parser.add_argument("--step-us", type=float, default=0.0, metavar="US",
                        help="cost model: microseconds each engine step takes, decode included (default 0)")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="requests running at once (default 128)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="tokens one step may schedule (default 2048)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's "
                        "max_position_embeddings)")
    parser.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens (default 16)")
    parser.add_argument("--num-gpu-blocks", type=int, default=8192, help="KV cache blocks (default 8192)")
    parser.add_argument("--vocab-size", type=int, default=None, help="default: config.json vocab_size")
    parser.add_argument("--max-logprobs", type=int, default=20,
                        help="largest logprobs count a request may ask for, -1: the vocabulary (vLLM's flag; "
                        "default 20)")
    parser.add_argument("--startup-delay-s", type=float, default=0.0,
                        help="seconds between the handshake init and the ready response (model loading)")
    parser.add_argument("--hello-gate", type=Path, default=None, metavar="PATH",
                        help="fault injection: hold HELLO until PATH exists (tests act before the handshake)")
    parser.add_argument("--bind-cpu", type=int, default=None, metavar="CPU",
                        help="while loading, bind one thread to CPU, as vLLM's CPU backend binds its Worker's "
                        "OpenMP thread (for placement tests; the thread only waits)")
    parser.add_argument("--runner", choices=("generate", "pooling"), default="generate",
                        help="generate (default), or pooling: an embedding engine, as vLLM's --runner pooling")
    parser.add_argument("--embed-dim", type=int, default=None, metavar="N",
                        help="pooled vector length under --runner pooling (default: config.json hidden_size, else 256)")
    parser.add_argument("--kv-events-config", default=None, metavar="JSON",
                        help="the KV-event publisher config, in the dialect of the engine --wire plays: vLLM's "
                        'and TokenSpeed\'s \'{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":'
                        '"tcp://*:5557"}\', SGLang\'s \'{"publisher":"zmq","endpoint":"tcp://*:5557"}\'')
    parser.add_argument("--kv-transfer-config", type=_kv_transfer_config, default=None, metavar="JSON",
                        help="vLLM's PD connector config: the sim echoes kv_transfer_params back as a connector "
                        'would, e.g. \'{"kv_connector":"NixlConnector","kv_role":"kv_both","engine_id":"e1"}\'')
    parser.add_argument("--kv-fault-skip", type=_seqs, default=frozenset(), metavar="SEQ[,SEQ]",
                        help="KV batches numbered and never sent nor kept for replay (holes)")
    parser.add_argument("--kv-fault-drop", type=_seqs, default=frozenset(), metavar="SEQ[,SEQ]",
                        help="KV batches kept for replay but not sent on PUB (repairable)")
    parser.add_argument("--kv-fault-restart-after", type=int, default=None, metavar="N",
                        help="restart the KV publisher (and empty the cache) once after N batches")
    parser.add_argument("--kv-replay-no-topic", action="store_true",
                        help="answer replay requests without the topic frame (TokenSpeed's form, and older "
                        "SGLang's; --wire tokenspeed always does)")
    # The SGLang / TokenSpeed server arguments the servicer reads back (a real scheduler resolves them; the
    # sim reports them as given, SGLang's defaults where unset: sim_wire_shell.sglang_server_args).
    engine = parser.add_argument_group("sglang / tokenspeed server arguments (reported, not enforced)")
    engine.add_argument("--grammar-backend", default=None, help="the grammar backend it reports (enforces none)")
    engine.add_argument("--reasoning-parser", default=None, help="the reasoning parser it reports")
    engine.add_argument("--skip-tokenizer-init", action="store_true",
                        help="sglang: report running without a tokenizer (so without a grammar backend)")
    engine.add_argument("--enable-custom-logit-processor", action="store_true",
                        help="sglang: accept custom logit processors (SGLang's flag; the sim applies none)")
    engine.add_argument("--limit-mm-data-per-request", type=_json_object, default=None, metavar="JSON",
                        help="sglang: the per-request media counts it reports, e.g. '{\"image\": 1}'")
    engine.add_argument("--language-model-only", action="store_true",
                        help="sglang: serve the language model only (it then takes no images)")
    engine.add_argument("--constrained-decoding", default=None, choices=("always", "requested"),
                        help="tokenspeed: the constrained-decoding policy a newer engine declares")
    parser.add_argument("--fault-ignore-sigterm", action="store_true",
                        help="ignore SIGTERM (only SIGKILL or the parent's death stops it), as a stuck launcher")
    parser.add_argument("--fault-stray-child", action="store_true",
                        help="once ready, start a child that ignores SIGTERM and leaves the process group "
                        "(still in the session), as an engine worker that outlives its parent")


def _kv_config(text: str | None, wire: str) -> "kv_engines.EngineKvConfig | None":
    """``--kv-events-config`` as the engine ``wire`` plays reads it (ValueError says why not)."""
    return None if text is None else kv_engines.parse_config(text, wire)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


_KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


def _kv_transfer_config(text: str) -> dict | None:
    """vLLM's ``--kv-transfer-config``, checked as vLLM's ``KVTransferConfig`` checks what the sim uses.

    As in vLLM, an object that names no ``kv_connector`` configures no
    connector; one that does needs a ``kv_role``. Errors never echo the text
    (a connector's config may hold credentials)."""
    try:
        config = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError("not JSON") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    if not config.get("kv_connector"):
        return None
    if not isinstance(config["kv_connector"], str):
        raise argparse.ArgumentTypeError("kv_connector must be a connector's name")
    if config.get("kv_role") not in _KV_ROLES:
        raise argparse.ArgumentTypeError(f"kv_role must be one of {', '.join(_KV_ROLES)} when kv_connector is set")
    return config


def _pd_facts(config: SimConfig, kv_transfer: dict) -> dict:
    """The PD identity, written where vllm_headless.py writes the real engine's (same keys)."""
    facts = {"kv_connector": config.kv_connector, "kv_role": config.kv_role, "kv_engine_id": config.kv_engine_id}
    children = (kv_transfer.get("kv_connector_extra_config") or {}).get("connectors")
    if isinstance(children, list):
        facts["kv_connector_children"] = [
            [child.get("kv_connector"), child.get("engine_id")] if isinstance(child, dict) else None
            for child in children
        ]
    return facts


def _seqs(text: str) -> frozenset[int]:
    return frozenset(int(part) for part in text.split(",") if part.strip())


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """SimConfig from the CLI, with model facts from DIR/config.json."""
    model = json.loads((args.model / "config.json").read_text())
    eos = model.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    vocab = args.vocab_size or model.get("vocab_size")
    max_len = args.max_model_len or model.get("max_position_embeddings")
    if not vocab or not max_len:
        raise ValueError(f"{args.model}/config.json lacks vocab_size or max_position_embeddings; pass them")
    return SimConfig(
        vocab_size=int(vocab),
        max_model_len=int(max_len),
        eos_token_id=eos,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_us_per_token=args.prefill_us_per_token,
        step_us=args.step_us,
        engine_index=args.rank,
        data_parallel_size=args.data_parallel_size,
        instance_id=f"sim-{os.getpid()}",
        runner=args.runner,
        embed_dim=int(args.embed_dim or model.get("hidden_size") or 256),
        **_kv_transfer_fields(args.kv_transfer_config),
    )


def _kv_transfer_fields(kv_transfer: dict | None) -> dict:
    if kv_transfer is None:
        return {}
    fields = {"kv_connector": kv_transfer["kv_connector"], "kv_role": kv_transfer["kv_role"]}
    if isinstance(kv_transfer.get("engine_id"), str) and kv_transfer["engine_id"]:
        fields["kv_engine_id"] = kv_transfer["engine_id"]
    if isinstance(kv_transfer.get("kv_port"), int):
        fields["kv_port"] = kv_transfer["kv_port"]
    return fields


def _handshake(
    ctx: zmq.Context, args: argparse.Namespace, life: Lifetime
) -> tuple[zmq.Socket, vllm.HandshakeInit] | None:
    """Steps 1-2: HELLO, then the init message (None if told to stop first).

    Returns the handshake socket too: READY goes out on it once the data
    sockets are up.
    """
    identity = args.rank.to_bytes(2, "little")
    hs = ctx.socket(zmq.DEALER)
    hs.setsockopt(zmq.IDENTITY, identity)
    hs.setsockopt(zmq.LINGER, 5000)
    while args.hello_gate is not None and not args.hello_gate.exists():
        if life.reason():
            hs.close(linger=0)
            return None
        time.sleep(IDLE_POLL_MS / 1000)
    hs.connect(args.handshake)
    hs.send(vllm.encode_handshake_status(vllm.HandshakeStatus(status="HELLO", local=False, headless=True)))
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    while not hs.poll(IDLE_POLL_MS):
        if life.reason() or time.monotonic() > deadline:
            hs.close(linger=0)
            return None
    return hs, vllm.decode_handshake_init(hs.recv())


def run(args: argparse.Namespace) -> int:
    if isinstance(args.kv_events_config, str):  # `enginelink sim-engine` comes here without main()
        try:
            args.kv_events_config = _kv_config(args.kv_events_config, args.wire)
        except ValueError as exc:
            log(f"argument --kv-events-config: {exc}")
            return 2
    config = config_from_args(args)
    if args.wire != "vllm":
        from enginelink.tools.sim_wire_shell import run_wire

        return run_wire(args, config)
    if args.kv_transfer_config is not None:
        _write_pd_facts(config, args.kv_transfer_config)
    life = Lifetime(ignore_sigterm=args.fault_ignore_sigterm)
    ctx = zmq.Context()
    try:
        started = _handshake(ctx, args, life)
        if started is None:
            log(f"no handshake init ({life.reason() or 'timed out'})")
            return 0 if life.reason() else 1
        handshake, init = started
        # Step 3: a real engine loads its model here (18-24 s for vLLM on CPU).
        loading_until = time.monotonic() + args.startup_delay_s
        while time.monotonic() < loading_until and not life.reason():
            time.sleep(0.01)
        if args.bind_cpu is not None:
            start_bound_thread(args.bind_cpu)
        hooks, kv_sockets, kv_resolved = kv_publisher(ctx, args, config)
        identity = args.rank.to_bytes(2, "little")
        inputs = ctx.socket(zmq.DEALER)
        inputs.setsockopt(zmq.IDENTITY, identity)
        inputs.connect(init.addresses.inputs[0])
        # Step 4: the ready response goes first; until it arrives the
        # front end's ROUTER cannot route to our identity.
        ready = ready_response(config)
        ready.kv_events_config = kv_resolved
        inputs.send(vllm.encode_ready_response(ready))
        outputs = ctx.socket(zmq.PUSH)
        outputs.setsockopt(zmq.LINGER, 4000)
        outputs.connect(init.addresses.outputs[0])
        ready = vllm.HandshakeStatus(status="READY", local=False, headless=True)
        handshake.send(vllm.encode_handshake_status(ready))
        log(f"ready (rank {args.rank}, vocab {config.vocab_size}, max_model_len {config.max_model_len})")
        if args.fault_stray_child:
            log(f"stray child {start_stray_child()} started")
        reason = serve(_VllmWire(SimEngineCore(config, hooks)), inputs, outputs, life, kv_sockets)
        log(f"stopping: {reason}")
        return 0
    finally:
        ctx.destroy(linger=0)


class _VllmWire:
    """The core on its own wire: ``[type, payload]`` straight in (the personalities' interface)."""

    def __init__(self, core: SimEngineCore) -> None:
        self.core = core

    @property
    def has_work(self) -> bool:
        return self.core.has_work

    def handle(self, frames: list[bytes], now: float) -> list[list[bytes]]:
        if len(frames) < 2:
            raise WireError(f"a {len(frames)}-frame input message")
        return self.core.handle_input(frames[0], frames[1], now)

    def step(self, now: float) -> tuple[list[list[bytes]], float]:
        return self.core.step(now)


def _write_pd_facts(config: SimConfig, kv_transfer: dict) -> None:
    """Before the handshake, where enginelink reads the engine's facts (as vllm_headless.py does)."""
    from enginelink.runtime.engine.zmq_transport import ENGINE_FACTS_ENV

    path = os.environ.get(ENGINE_FACTS_ENV)
    if path:
        # Atomically: enginelink reads the file at the handshake.
        tmp = f"{path}.{os.getpid()}.tmp"  # each DP rank writes the same facts: a temp file of its own
        Path(tmp).write_text(json.dumps(_pd_facts(config, kv_transfer)))
        os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    from enginelink.runtime.engine.zmq_transport import ENGINE_FACTS_ENV
    from enginelink.runtime.contracts.vllm.vllm_headless import report_refused_arguments

    parser = argparse.ArgumentParser(prog="python -m enginelink.tools.sim_engine", description=__doc__.splitlines()[0])
    add_arguments(parser)
    # Launched by enginelink: a refusal (exit 2) is also reported where the servicer reads it.
    report_refused_arguments(parser, os.environ.get(ENGINE_FACTS_ENV))
    args = parser.parse_args(argv)
    try:
        args.kv_events_config = _kv_config(args.kv_events_config, args.wire)
    except ValueError as exc:
        parser.error(f"argument --kv-events-config: {exc}")
    _write_facts(os.environ.get(ENGINE_FACTS_ENV), args)
    if args.wire == "sglang" and (args.scheduler_input_ipc is None or args.tokenizer_ipc is None):
        parser.error("--wire sglang needs --scheduler-input-ipc and --tokenizer-ipc (the front end binds them)")
    if args.wire != "sglang" and args.handshake is None:
        parser.error(f"--wire {args.wire} needs --handshake")
    if args.data_parallel_size < 1:
        parser.error(f"--data-parallel-size {args.data_parallel_size}: expected >= 1")
    if args.data_parallel_size > 1 and not args.data_parallel_child and args.wire != "sglang":
        from enginelink.tools.sim_ranks import run_ranks

        return run_ranks(sys.argv[1:] if argv is None else list(argv), args.data_parallel_size)
    return run(args)


def _write_facts(path: str | None, args: argparse.Namespace) -> None:
    """What vLLM's launch script reports beside the ready response (runtime/contracts/vllm/vllm_headless.py):
    the runner (whether the servicer offers Generate or Embed) and --max-logprobs."""
    if path:
        # Every DP rank writes the same facts: each through a temp file of its own, or one rank's
        # replace takes the other's temp file away under it (a rank then died at start-up).
        tmp = f"{path}.{os.getpid()}.tmp"
        Path(tmp).write_text(json.dumps({"runner_type": args.runner, "max_logprobs": args.max_logprobs}))
        os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
