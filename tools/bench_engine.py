"""``enginelink bench --engine vllm``: enginelink vs a bare ZMQ driver of the same vLLM engine.

Theory of operation. For each ``--concurrency`` value the bench alternates
(enginelink, raw, enginelink, raw, ... ``--rounds`` pairs) the same load:
``--requests`` streaming requests, ``--concurrency`` in flight, each with
``--prompt-tokens`` random prompt tokens, temperature 1, ``ignore_eos`` and
``--max-tokens`` output tokens.

- enginelink: ``enginelink serve --engine vllm --model DIR -- ENGINE_ARGS``
  (``ENGINELINK_WARMUP=off``; KV events off, so both sides run the very same
  engine configuration), driven by ``tools/bench_load.py``'s load client
  (``--client``: the lean h2 client by default, grpc.aio as ``grpcio``; both
  given, each is an enginelink side and the first one's makes the ratio).
- raw: this module binds the handshake ROUTER (tcp loopback), the input ROUTER
  and the output PULL (ipc) itself, launches the engine with the same
  ``VllmLauncher.command(...)``, does the handshake with ``wire/vllm.py`` and
  keeps the requests in flight by sending ADD frames and counting output
  tokens until each finishes. No gRPC, no journal, no servicer. The engine
  runs at the priority enginelink gives it (``ENGINELINK_ENGINE_NICE``).

- ``--against smg-rust,smg-python``: the reference servicers join the alternation
  (``tools/bench_refs.py``): smg-rust in front of the same ``vllm_headless.py``
  launch, smg-python on the engine core its own ``AsyncLLM`` starts.

Each side's figure is output tokens / load window (first request sent to last
finished; one short warm-up request before). Engine start-up is outside the
window. The ratio is enginelink / raw of the per-concurrency medians; every
servicer arm is also compared with raw and with enginelink repetition by
repetition (geometric mean with a 95% interval).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

HANDSHAKE_TIMEOUT_S = 600.0
# With --warm-s and no --duration-s: the steady window (long enough that a repetition repeats, on a
# real engine's pace: hundreds of steps).
DEFAULT_WINDOW_S = 20.0
ENGINE_ARGS_DEFAULT = ["--max-model-len", "1024", "--enforce-eager"]


class Side(NamedTuple):
    """One side of the comparison: enginelink driven by ``client``, the raw driver spending
    ``front_end_us`` CPU per token as a stand-in front end (0: none), or a reference servicer
    (``ref``: smg-rust, smg-python; ``tools/bench_refs.py``) driven by ``client``."""

    label: str
    client: str | None = None
    front_end_us: float = 0.0
    ref: str | None = None


def engine_args_for(args: argparse.Namespace, concurrency: int) -> list[str]:
    import shlex

    engine_args = shlex.split(args.engine_args_text) + list(args.engine_args)
    if not engine_args:
        engine_args = list(ENGINE_ARGS_DEFAULT)
    if not any(a.split("=", 1)[0] == "--max-num-seqs" for a in engine_args):
        engine_args += ["--max-num-seqs", str(max(128, concurrency))]
    return engine_args


def vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Ids 0-2 are special in the test model.
    return [rng.randrange(3, max(4, vocab)) for _ in range(n)]


# -- raw: a bare ZMQ driver -----------------------------------------------------------


def spend_cpu(seconds: float) -> None:
    """Busy-loop until this thread has used ``seconds`` of CPU: CPU taken, not wall time slept."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _percentiles(samples) -> dict:
    """p50/p90/p99 in ms of seconds, as ``bench_load.summarize`` gives them."""
    from enginelink.tools.bench_load import percentile

    ordered = sorted(samples)
    return {f"p{q}": (None if (v := percentile(ordered, q)) is None else v * 1e3) for q in (50, 90, 99)}


def measure_raw(model_dir: Path, engine_args: list[str], concurrency: int, requests: int,
                max_tokens: int, prompt_tokens: int, log_path: Path, front_end_us: float = 0.0,
                warm_s: float | None = None, window_s: float = 10.0) -> dict:
    import msgspec
    import zmq
    from enginelink.runtime.engine.placement import (
        PLACEMENT_CHOICES,
        PLACEMENT_DEFAULT,
        describe_placement,
        lower_priority,
        own_threads,
        place_front_end,
        set_affinity,
    )
    from enginelink.tools.serve import _engine_nice, _env_choice, _vllm_launcher
    from enginelink.wire import vllm as vllm_wire
    from enginelink.wire.engine import EngineDead, GenerateSpec, SamplingSpec

    launcher = _vllm_launcher(model_dir, engine_args)
    engine_nice = _engine_nice()
    placement = _env_choice("ENGINELINK_PLACEMENT", PLACEMENT_CHOICES, PLACEMENT_DEFAULT)
    own_cpus = os.sched_getaffinity(0)
    codec = vllm_wire.VllmCodec(release=launcher.wire_release)  # the installed release, as serve speaks it
    vocab = vocab_size(model_dir)
    rng = random.Random()
    ctx = zmq.Context()
    handshake = ctx.socket(zmq.ROUTER)
    inputs = ctx.socket(zmq.ROUTER)
    outputs = ctx.socket(zmq.PULL)
    inputs.setsockopt(zmq.ROUTER_MANDATORY, 1)
    tmp = Path(tempfile.mkdtemp(prefix="enginelink-rawbench-"))
    process = None
    log = open(log_path, "wb")
    try:
        port = handshake.bind_to_random_port("tcp://127.0.0.1")
        in_addr, out_addr = f"ipc://{tmp}/in.sock", f"ipc://{tmp}/out.sock"
        inputs.bind(in_addr)
        outputs.bind(out_addr)
        argv, env = launcher.command(f"tcp://127.0.0.1:{port}")
        env = {**os.environ, **env}
        env.pop("ENGINELINK_ENGINE_FACTS", None)
        # In a process group of its own in the bench's session, as enginelink runs its engine (in its
        # servicer's session: under the kernel's autogroups, one scheduling group); its priority too
        # (runtime/engine/placement.py).
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, process_group=0)
        lower_priority(process.pid, engine_nice)

        # Handshake: HELLO -> init -> ready response (inputs) + READY (handshake).
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        poller = zmq.Poller()
        poller.register(handshake, zmq.POLLIN)
        poller.register(inputs, zmq.POLLIN)
        identity = None
        got_ready = got_response = False
        while not (got_ready and got_response):
            if time.monotonic() > deadline:
                raise RuntimeError("engine handshake timed out")
            if process.poll() is not None:
                raise RuntimeError(f"engine exited with status {process.returncode} during the handshake")
            events = dict(poller.poll(500))
            if handshake in events:
                ident, payload = handshake.recv_multipart()
                message = msgspec.msgpack.decode(payload)
                if identity is None:
                    identity = ident
                    init = vllm_wire.HandshakeInit(addresses=vllm_wire.HandshakeAddresses(
                        inputs=[in_addr], outputs=[out_addr]))
                    handshake.send_multipart([identity, vllm_wire.encode_handshake_init(init)])
                elif isinstance(message, dict) and message.get("status") == "READY":
                    got_ready = True
            if inputs in events:
                inputs.recv_multipart()
                got_response = True
        placed = "off (ENGINELINK_PLACEMENT=off)"
        if placement == "auto":
            # The placement enginelink gives its engine and itself (runtime/engine/placement.py), the
            # driver standing in for the servicer: off the CPUs the engine binds.
            placed = describe_placement(place_front_end(process.pid), front_end="the driver")

        def add(request_id: str, tokens: int) -> None:
            spec = GenerateSpec(
                request_id=request_id,
                prompt_token_ids=random_prompt(rng, prompt_tokens, vocab),
                sampling=SamplingSpec(max_tokens=tokens, temperature=1.0, ignore_eos=True),
                arrival_time=time.time(),
            )
            inputs.send_multipart([identity, *codec.encode_add(spec)])

        def drive(n_requests: int, n_concurrent: int, tokens_each: int, tag: str) -> dict:
            sent = done = tokens = short = 0
            per_request: dict[str, int] = {}
            while sent < min(n_concurrent, n_requests):
                add(f"{tag}-{sent}", tokens_each)
                sent += 1
            while done < n_requests:
                if not outputs.poll(60_000):
                    raise RuntimeError("no engine output for 60 s")
                batch = codec.decode_output(outputs.recv_multipart())
                if isinstance(batch, EngineDead):
                    raise RuntimeError("engine reported ENGINE_CORE_DEAD")
                if front_end_us:
                    # A stand-in front end: the CPU a servicer (and its client) would spend on these tokens.
                    spend_cpu(front_end_us * 1e-6 * sum(len(out.new_token_ids) for out in batch.outputs))
                for out in batch.outputs:
                    got = len(out.new_token_ids)
                    tokens += got
                    per_request[out.request_id] = per_request.get(out.request_id, 0) + got
                    if out.finish_reason is not None:
                        done += 1
                        if per_request.pop(out.request_id) != tokens_each:
                            short += 1
                        if sent < n_requests:
                            add(f"{tag}-{sent}", tokens_each)
                            sent += 1
            return {"tokens": tokens, "short": short, "requests": done}

        def drive_steady(n_concurrent: int, tokens_each: int, warm_s: float, window_s: float) -> dict:
            """Keep ``n_concurrent`` requests in flight, their slots opened over ``warm_s``; count and
            time only what arrives in the window after it (``bench_load.run_load``'s steady window)."""
            from array import array

            go = time.monotonic()
            w0, w1 = go + warm_s, go + warm_s + window_s
            ttft, gaps = array("d"), array("d")
            open_: dict[str, list] = {}  # request id -> [sent at, last output at, tokens]
            sent = done = short = tokens = window_tokens = window_frames = 0
            opened = 0
            cpu = [0.0, 0.0]
            while opened < n_concurrent or open_:
                now = time.monotonic()
                while opened < n_concurrent and now >= go + opened * warm_s / n_concurrent:
                    opened += 1
                    if now < w1:
                        add(f"raw-{sent}", tokens_each)
                        open_[f"raw-{sent}"] = [now, now, 0]
                        sent += 1
                if not cpu[0] and now >= w0:
                    cpu[0] = time.process_time()
                if not cpu[1] and now >= w1:
                    cpu[1] = time.process_time()
                if not open_:
                    time.sleep(max(0.0, min(go + opened * warm_s / n_concurrent, w1) - now) or 0.001)
                    continue
                if not outputs.poll(50 if opened < n_concurrent else 60_000):
                    if opened < n_concurrent:
                        continue
                    raise RuntimeError("no engine output for 60 s")
                batch = codec.decode_output(outputs.recv_multipart())
                now = time.monotonic()
                if isinstance(batch, EngineDead):
                    raise RuntimeError("engine reported ENGINE_CORE_DEAD")
                if front_end_us:
                    spend_cpu(front_end_us * 1e-6 * sum(len(out.new_token_ids) for out in batch.outputs))
                inside = w0 <= now < w1
                window_frames += inside and bool(batch.outputs)
                for out in batch.outputs:
                    state = open_.get(out.request_id)
                    if state is None:
                        continue
                    got = len(out.new_token_ids)
                    if got:
                        if state[2] == 0:
                            if w0 <= state[0] < w1:
                                ttft.append(now - state[0])
                        elif inside:
                            gaps.append((now - state[1]) / got)
                        state[1] = now
                        state[2] += got
                        tokens += got
                        if inside:
                            window_tokens += got
                    if out.finish_reason is not None:
                        done += 1
                        short += state[2] != tokens_each
                        del open_[out.request_id]
                        if now < w1:
                            add(f"raw-{sent}", tokens_each)
                            open_[f"raw-{sent}"] = [now, now, 0]
                            sent += 1
            return {"tokens": window_tokens, "all_tokens": tokens, "short": short, "requests": done,
                    "wall_s": window_s, "tokens_per_s": window_tokens / window_s,
                    "driver_cpu_s": (cpu[1] or time.process_time()) - cpu[0],
                    "ttft_ms": _percentiles(ttft), "itl_ms": _percentiles(gaps),
                    "engine_frames_per_s": window_frames / window_s,
                    "tokens_per_engine_frame": window_tokens / window_frames if window_frames else None}

        drive(1, 1, 2, "warm")
        if warm_s is not None:
            return {**drive_steady(concurrency, max_tokens, warm_s, window_s), "placement": placed}
        cpu0 = time.process_time()
        t0 = time.monotonic()
        counts = drive(requests, concurrency, max_tokens, "raw")
        wall = time.monotonic() - t0
        cpu = time.process_time() - cpu0
        return {**counts, "wall_s": wall, "tokens_per_s": counts["tokens"] / wall, "driver_cpu_s": cpu,
                "placement": placed}
    finally:
        for sock in (handshake, inputs, outputs):
            sock.close(linger=0)
        ctx.term()
        # place_front_end moved this process's threads: the next engine launched must see every CPU.
        set_affinity(own_threads(), own_cpus)
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()
        log.close()
        for f in tmp.iterdir():
            f.unlink(missing_ok=True)
        tmp.rmdir()


# -- enginelink -------------------------------------------------------------------------


def measure_enginelink(args: argparse.Namespace, model_dir: Path, engine_args: list[str], concurrency: int,
                       client: str, tmp: Path, engine: str = "vllm") -> dict:
    from enginelink.tools import bench_load

    run_args = argparse.Namespace(**vars(args))
    run_args.concurrency = concurrency
    run_args.client = client
    run_args.target = None
    run_args.servicer_pid = None
    if getattr(args, "warm_s", None) is None:
        run_args.duration_s = None
    else:  # the steady window: every side runs the same warm-up and window (run_load)
        run_args.requests = None
        run_args.duration_s = args.duration_s or DEFAULT_WINDOW_S
    run_args.temperature = 1.0
    run_args.random_prompt = True
    run_args.contract = "mlx" if engine == "mlx" else "vllm"  # serve --engine mlx serves MlxEngine
    servicer = bench_load.Servicer(run_args, tmp, engine=engine, model_dir=model_dir, engine_args=engine_args,
                              env={"ENGINELINK_WARMUP": "off", "ENGINELINK_KV_EVENTS": "off"})
    servicer.start(timeout_s=HANDSHAKE_TIMEOUT_S)
    try:
        report = bench_load.run_load(run_args, servicer.target, servicer.process.pid, servicer.metrics_port)
    except Exception as error:
        raise RuntimeError(f"{error}\nservicer log ends:\n{servicer.log()}") from None
    finally:
        servicer.stop()
    result = load_result(report)
    if engine == "mlx":  # the engine's stop line: its steps and how requests joined its batch (mlx_core.summary)
        stopped = re.findall(r"mlx-engine\[\d+\]: stopping: [^;\n]*; ([^\n]*)", servicer.log())
        result["engine_summary"] = stopped[-1] if stopped else None
    return result


def load_result(report: dict) -> dict:
    return {
        "tokens": report["output_tokens"], "short": report["short"] + report["errors"],
        "requests": report["requests"], "wall_s": report["wall_s"], "tokens_per_s": report["tokens_per_s"],
        "servicer_cpu_s": report["servicer_cpu_s"], "client_cpu_s": report["client_cpu_s"],
        "engine_cpu_s": report.get("engine_cpu_s"),  # the servicer's engine processes (none for a --target)
        "servicer_rss_mib": report.get("servicer_rss_mib"),
        "ttft_ms": report.get("ttft_ms"), "itl_ms": report.get("itl_token_ms"),
        "output_delay_ms": report.get("output_delay_ms"),
        "engine_frames_per_s": report.get("engine_frames_per_s"),
        "tokens_per_engine_frame": report.get("tokens_per_engine_frame"),
    }


def measure_ref(args: argparse.Namespace, model_dir: Path, engine_args: list[str], concurrency: int,
                client: str, arm: str, tmp: Path) -> dict:
    """A reference servicer (tools/bench_refs.py) in front of the same engine, driven by the same load."""
    from enginelink.tools import bench_load
    from enginelink.tools.bench_refs import RefServicer, give_engine_its_priority
    from enginelink.tools.serve import _engine_nice, _vllm_launcher

    run_args = argparse.Namespace(**vars(args))
    run_args.concurrency = concurrency
    run_args.client = client
    run_args.target = None
    run_args.servicer_pid = None
    if getattr(args, "warm_s", None) is None:
        run_args.duration_s = None
    else:  # the steady window: every side runs the same warm-up and window (run_load)
        run_args.requests = None
        run_args.duration_s = args.duration_s or DEFAULT_WINDOW_S
    run_args.temperature = 1.0
    run_args.random_prompt = True
    argv, env = _vllm_launcher(model_dir, engine_args).command("{handshake}")
    env.pop("ENGINELINK_ENGINE_FACTS", None)
    tmp.mkdir(parents=True, exist_ok=True)
    if arm == "smg-rust":
        # The very engine launch enginelink and the raw driver use, dialing the Rust server's handshake.
        servicer = RefServicer(arm, tmp, model_dir, engine_args, (argv, env))
    else:
        # smg-python's AsyncLLM starts its engine core itself, with the same arguments and KV cache size.
        servicer = RefServicer(arm, tmp, model_dir, engine_args, None, env=env)
    servicer.start(timeout_s=HANDSHAKE_TIMEOUT_S)
    try:
        give_engine_its_priority(servicer, _engine_nice())
        report = bench_load.run_load(run_args, servicer.target, servicer.process.pid, servicer.metrics_port)
    except Exception as error:
        raise RuntimeError(f"{arm}: {error}\nits log ends:\n{servicer.log()}") from None
    finally:
        servicer.stop()
    return load_result(report)


def run(args: argparse.Namespace) -> int:
    from enginelink.tools.bench_load import machine_facts

    model_dir = Path(args.model) if args.model else None
    if model_dir is None:
        from enginelink.tools.bench_load import bench_model_dir

        model_dir = bench_model_dir()
    requests = args.requests or 256
    args.requests = requests
    results = []
    with tempfile.TemporaryDirectory(prefix="enginelink-bench-") as tmp_name:
        tmp = Path(tmp_name)
        clients = list(dict.fromkeys(args.client))
        # enginelink with the first client and raw make the ratio; the other sides are compared to raw.
        sides = [Side("enginelink", client=clients[0]), Side("raw"),
                 *(Side(f"raw+{us:g}us", front_end_us=us) for us in args.raw_front_end_us),
                 *(Side(f"enginelink/{client}", client=client) for client in clients[1:]),
                 *(Side(arm, client=clients[0], ref=arm) for arm in getattr(args, "against", []))]
        if getattr(args, "against", []):
            from enginelink.tools.bench_refs import refs_python

            refs_python()  # fail before the first engine starts
        for concurrency in args.concurrency:
            engine_args = engine_args_for(args, concurrency)
            runs = {side.label: [] for side in sides}
            for r in range(args.rounds):
                for side in sides:
                    t = time.monotonic()
                    if side.ref is not None:
                        res = measure_ref(args, model_dir, engine_args, concurrency, side.client, side.ref,
                                          tmp / f"{side.ref}-{concurrency}-{r}")
                    elif side.client is not None:
                        res = measure_enginelink(args, model_dir, engine_args, concurrency, side.client,
                                                 tmp / f"el-{concurrency}-{r}-{side.client}")
                    else:
                        res = measure_raw(model_dir, engine_args, concurrency, requests, args.max_tokens,
                                          args.prompt_tokens, tmp / "raw-engine.log", side.front_end_us,
                                          warm_s=getattr(args, "warm_s", None),
                                          window_s=args.duration_s or DEFAULT_WINDOW_S)
                    res["total_s"] = time.monotonic() - t
                    runs[side.label].append(res)
                    if r == 0 and side.label == "raw":
                        print(f"concurrency {concurrency} raw driver placement: {res['placement']}",
                              file=sys.stderr, flush=True)
                    cpu = (f"; servicer {res['servicer_cpu_s'] / res['tokens'] * 1e6:.0f} us/token, "
                           f"{side.client} client {res['client_cpu_s'] / res['tokens'] * 1e6:.0f} us/token, "
                           f"servicer RSS {res['servicer_rss_mib'] or 0:.0f} MiB"
                           if side.client is not None and res["tokens"] else "")
                    engine_side = (f"; engine {res['engine_frames_per_s']:.1f} frames/s x "
                                   f"{res['tokens_per_engine_frame']:.1f} tokens" if res.get("tokens_per_engine_frame")
                                   else "")
                    print(f"concurrency {concurrency} round {r + 1} {side.label:18s} {res['tokens_per_s']:8.0f} "
                          f"tokens/s ({res['tokens']} tokens in {res['wall_s']:.2f} s, {res['short']} short/failed"
                          f"{engine_side}; "
                          f"{res['total_s']:.0f} s with start-up{cpu})", file=sys.stderr, flush=True)
            el = statistics.median(x["tokens_per_s"] for x in runs["enginelink"])
            raw = statistics.median(x["tokens_per_s"] for x in runs["raw"])
            others = {side.label: statistics.median(x["tokens_per_s"] for x in runs[side.label]) / raw
                      for side in sides[2:] if side.ref is None}
            from enginelink.tools.bench_refs import arm_summary

            # Every servicer arm against raw and enginelink, repetition by repetition, pooled with an interval.
            arms = {side.label: arm_summary(runs, side.label, ("raw", "enginelink"))
                    for side in sides if side.label == "enginelink" or side.ref is not None}
            results.append({"concurrency": concurrency, "engine_args": engine_args, "runs": runs,
                            "enginelink_tokens_per_s": el, "raw_tokens_per_s": raw, "ratio": el / raw,
                            "client": clients[0], "other_ratios": others, "arms": arms})
    report = {"machine": machine_facts(), "requests": requests, "max_tokens": args.max_tokens,
              "prompt_tokens": args.prompt_tokens, "model": str(model_dir), "results": results}
    if getattr(args, "latency_plot", None):
        from enginelink.tools.bench_refs import plot

        arms = [label for label in results[0]["arms"]] if results else []
        for r in results:  # the raw driver beside the servicers, its latency with the same spread
            from enginelink.tools.bench_refs import latency_summary

            r["arms"].setdefault("raw", {"latency": latency_summary(r["runs"]["raw"], [])})
        plot(results, [*arms, "raw"], args.latency_plot,
             f"enginelink bench --engine vllm: {args.max_tokens} tokens a call, {args.rounds} repetition(s)",
             base="raw")
    from enginelink.tools.bench_plot import maybe_write

    maybe_write(args, report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"enginelink bench --engine vllm: {requests} requests x {args.max_tokens} tokens, "
              f"prompt {args.prompt_tokens} random tokens, temperature 1, ignore_eos")
        for r in results:
            el = ", ".join(f"{x['tokens_per_s']:.0f}" for x in r["runs"]["enginelink"])
            raw = ", ".join(f"{x['tokens_per_s']:.0f}" for x in r["runs"]["raw"])
            print(f"  concurrency {r['concurrency']:4d}: enginelink ({r['client']} client) "
                  f"{r['enginelink_tokens_per_s']:7.0f} tokens/s ({el})"
                  f"  raw {r['raw_tokens_per_s']:7.0f} tokens/s ({raw})  ratio {r['ratio']:.3f}")
            if len(r["arms"]) > 1 or args.rounds > 1:
                from enginelink.tools.bench_refs import format_arm

                print("    servicers, each against the raw driver and enginelink in the same repetition "
                      "(geometric mean of the per-repetition ratios, 95% interval):")
                for label, summary in r["arms"].items():
                    if label == "raw":
                        continue
                    print("\n".join(format_arm(label, r["runs"][label], summary, ("raw", "enginelink"))))
                from enginelink.tools.bench_refs import format_latency, latency_summary

                raw_latency = format_latency({"latency": latency_summary(r["runs"]["raw"], [])}, None)
                if any("-, " not in line for line in raw_latency):
                    print("                raw: (the bare driver: the engine's own latency)")
                    print("\n".join(raw_latency))
            for side, ratio in r["other_ratios"].items():
                runs_text = ", ".join(f"{x['tokens_per_s']:.0f}" for x in r["runs"][side])
                what = ("raw driver spending that much CPU per token" if side.startswith("raw")
                        else "the servicer, with this load client")
                print(f"      {side:>18s} ({what}): ratio {ratio:.3f} ({runs_text})")
    bad = any(x["short"] for r in results for side in r["runs"].values() for x in side)
    return 1 if bad else 0
