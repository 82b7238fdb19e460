"""A reference servicer for ``enginelink bench --against``: the Rust one of ``smg`` or the Python one of
``smg-grpc-servicer``, in front of the same engine enginelink drives.

Run BY PATH with the references' venv (``tools/setup-bench-refs``; enginelink is not installed there):

    REFS/bin/python bench_ref_servicer.py rust   --port P --model DIR --engine FILE.json [--max-model-len N]
                                                 [--max-num-seqs N]
    REFS/bin/python bench_ref_servicer.py python --port P --model DIR [--engine FILE.json] -- VLLM ENGINE ARGS

- ``rust``: ``smg.servicer.VllmGrpcServer`` (smg 1.13.0), built here with a constructor shim: the launcher
  that normally builds it (``smg_grpc_servicer.vllm.rust``, 0.14.1) passes keywords this release's binding
  does not take (``engine_silence_timeout_secs``, ``engine_prefill_tokens_per_sec``,
  ``metrics_bind_address``, ``mm_encoder_budget``) and builds the engine config with vLLM (torch in the
  servicer's process), so the facts come from the model directory instead, and only keywords the binding's
  signature names are passed. The engine is the command in ``--engine`` (the bench writes the very launch
  enginelink and its raw driver use: ``runtime/contracts/vllm/vllm_headless.py`` or the sim engine), pointed at the
  server's TCP handshake, in its own session as enginelink runs its engine.
- ``python``: vLLM's own gRPC launcher (``vllm.entrypoints.launchers.grpc_server``), which hosts
  ``smg_grpc_servicer.vllm.servicer.VllmEngineServicer`` on an ``AsyncLLM``. Without ``--engine`` the
  AsyncLLM starts its engine core itself (the reference as deployed). With ``--engine`` (the sim engine)
  the AsyncLLM starts none (``--data-parallel-size-local 0``) and waits for the engine at its handshake,
  which the sim engine dials as a remote headless rank.

Rules: imports nothing of enginelink; stops its engine's process group on every way out (SIGTERM, the server's
failure, the engine's exit); KV events and the planned warm-up are off, as the bench runs enginelink.
"""

from __future__ import annotations

import sys

# Run by path, this file's folder (enginelink's tools/, which holds an ``inspect.py``) would come first on
# sys.path and shadow the standard library's modules of the same names.
if __name__ == "__main__" and sys.path and sys.path[0]:
    import os.path

    if os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]

import argparse  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ENGINE_STOP_GRACE_S = 5.0
POLL_S = 0.1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log(text: str) -> None:
    print(f"bench_ref_servicer: {text}", file=sys.stderr, flush=True)


# -- the engine ---------------------------------------------------------------------------


def start_engine(spec_path: Path, handshake: str) -> subprocess.Popen:
    """The bench's engine command (``{"argv": [...], "env": {...}}``, ``{handshake}`` filled in)."""
    spec = json.loads(spec_path.read_text())
    argv = [arg.replace("{handshake}", handshake) for arg in spec["argv"]]
    env = {**os.environ, **spec.get("env", {})}
    # A process group of its own in the servicer's session, as enginelink and the raw driver run their
    # engine (under the kernel's autogroups: one scheduling group with the servicer).
    return subprocess.Popen(argv, env=env, process_group=0)


def stop_engine(process: subprocess.Popen | None) -> None:
    if process is None or process.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, ENGINE_STOP_GRACE_S), (signal.SIGKILL, ENGINE_STOP_GRACE_S)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


# -- rust ------------------------------------------------------------------------------------


def model_facts(model_dir: Path, max_model_len: int | None, max_num_seqs: int) -> dict:
    """What the Rust server advertises and needs up front, from the model directory (no vLLM import)."""
    config = json.loads((model_dir / "config.json").read_text())
    eos = config.get("eos_token_id")
    generation = model_dir / "generation_config.json"
    if generation.exists():
        eos = json.loads(generation.read_text()).get("eos_token_id", eos)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    return {
        "served_model_name": model_dir.name,
        "tokenizer_path": str(model_dir),
        "is_generation": True,
        "max_context_length": int(max_model_len or config.get("max_position_embeddings") or 0),
        "vocab_size": int(config.get("vocab_size") or 0),
        "model_type": str(config.get("model_type") or ""),
        "architectures": list(config.get("architectures") or []),
        "eos_token_ids": eos_ids,
        "pad_token_id": int(config.get("pad_token_id") or 0),
        "bos_token_id": int(config.get("bos_token_id") or 0),
        "data_parallel_size": 1,
        "max_num_seqs": max_num_seqs,
        "block_size": 16,
        "structured_outputs_backend": "auto",
        # The bench runs every engine with its KV-event publisher off.
        "kv_events_endpoint": "",
        "log_stats": True,
    }


def shim_kwargs(server_class, kwargs: dict) -> dict:
    """Only the keywords this release's binding takes (the constructor shim); the dropped ones are named."""
    accepted = set(inspect.signature(server_class).parameters)
    dropped = sorted(set(kwargs) - accepted)
    if dropped:
        log(f"not passed to {server_class.__name__} (this smg release does not take them): {', '.join(dropped)}")
    return {k: v for k, v in kwargs.items() if k in accepted}


def serve_rust(args: argparse.Namespace) -> int:
    import smg.servicer

    socket_dir = Path(tempfile.mkdtemp(prefix="smg-bench-"))
    handshake = f"tcp://127.0.0.1:{free_port()}"
    kwargs = {
        "bind_address": f"127.0.0.1:{args.port}",
        "ipc_base_url": f"ipc://{socket_dir}/servicer-{os.getpid()}",
        "handshake_address": handshake,
        "model_path": str(args.model),
        "engine_count": 1,
        "tokenizer_dir": str(args.model),
        **model_facts(args.model, args.max_model_len, args.max_num_seqs),
        # What the 0.14.1 launcher passes as well, with its defaults.
        "engine_startup_timeout_secs": 1800.0,
        "engine_startup_ceiling_secs": 14400.0,
        "engine_silence_timeout_secs": 300.0,
        "engine_prefill_tokens_per_sec": 2000.0,
        "metrics_bind_address": None,
    }
    server = smg.servicer.VllmGrpcServer(**shim_kwargs(smg.servicer.VllmGrpcServer, kwargs))
    log(f"Rust servicer (smg {version('smg')}) on {server.address}, engine handshake {handshake}")
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    engine = None
    code = 0
    try:
        engine = start_engine(args.engine, handshake)
        ready = False
        while not stopping:
            if not ready and server.engine_ready:
                ready = True
                log(f"engine connected (pid {engine.pid}); SERVING")
            if server.last_error or not server.running:
                log(f"Rust servicer cannot serve: {server.last_error or 'server exited'}")
                code = 1
                break
            if engine.poll() is not None:
                log(f"engine exited with status {engine.returncode}")
                code = 1
                break
            if not ready:
                server.note_engine_alive()
            time.sleep(POLL_S)
    finally:
        try:
            server.set_serving(False)
            server.stop(5.0)
        finally:
            stop_engine(engine)
            for f in socket_dir.iterdir():
                f.unlink(missing_ok=True)
            socket_dir.rmdir()
    return code


# -- python ----------------------------------------------------------------------------------


def serve_python(args: argparse.Namespace) -> int:
    # The bench's settings for every arm: no KV-event publisher, no planned warm-up.
    os.environ.setdefault("SMG_VLLM_SERVICER_KV_EVENTS", "0")
    os.environ.setdefault("SMG_VLLM_SERVICER_WARMUP", "off")
    os.environ["SMG_VLLM_SERVICER_IMPL"] = "python"
    argv = ["grpc_server", "--model", str(args.model), "--host", "127.0.0.1", "--port", str(args.port),
            *args.engine_args]
    engine = None
    if args.engine is not None:
        # An engine of our own (the sim engine): the AsyncLLM starts none and waits for it as a remote rank.
        rpc_port = free_port()
        argv += ["--data-parallel-size", "1", "--data-parallel-size-local", "0",
                 "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port)]
        engine = start_engine(args.engine, f"tcp://127.0.0.1:{rpc_port}")
    log(f"Python servicer (smg-grpc-servicer {version('smg-grpc-servicer')}) under vLLM's gRPC launcher: "
        f"{' '.join(argv[1:])}")
    from vllm.entrypoints.launchers import grpc_server

    sys.argv = argv
    try:
        grpc_server.main()
    except SystemExit as exit_:
        return int(exit_.code or 0)
    finally:
        stop_engine(engine)
    return 0


def version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version as dist_version

    try:
        return dist_version(dist)
    except PackageNotFoundError:
        return "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("impl", choices=("rust", "python"))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--engine", type=Path, default=None, metavar="FILE.json",
                        help='the engine command: {"argv": [...], "env": {...}}, "{handshake}" filled in')
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.engine_args = argv[split + 1:]  # python: vLLM's engine arguments, after --
    if args.impl == "rust":
        if args.engine is None:
            parser.error("rust needs --engine")
        return serve_rust(args)
    return serve_python(args)


if __name__ == "__main__":
    sys.exit(main())
