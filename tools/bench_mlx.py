"""``enginelink bench --engine mlx``: enginelink + the MLX engine vs mlx-lm's BatchGenerator alone.

Theory of operation, as ``bench_engine.py`` does it for vLLM. For each
``--concurrency`` value the bench alternates (enginelink, raw) ``--rounds``
pairs of the same load: ``--requests`` streaming requests, ``--concurrency``
in flight, each with ``--prompt-tokens`` random prompt tokens, temperature 1,
``ignore_eos`` and ``--max-tokens`` output tokens.

- enginelink: ``enginelink serve --engine mlx --model DIR -- --completion-batch-size C``
  (warm-up off), driven by ``bench_load.py``'s load client.
- raw: ``python -m enginelink.tools.bench_mlx --raw`` run by the MLX venv's
  python: the model loaded and force-evaluated, ``BatchGenerator`` with the
  same batch sizes driven in-process, requests topped up as they finish, no
  wire, no servicer. It runs in a process group of its own at the priority
  enginelink gives its engine (``ENGINELINK_ENGINE_NICE``), as the engine runs.

- reference (``--against smg-python``): the reference MLX servicer,
  ``python -m smg_grpc_servicer.mlx.server`` (smg-grpc-servicer 0.14.1, which
  runs mlx-lm in its gRPC process), from the MLX venv with the reference on
  ``PYTHONPATH`` (``tools/setup-mlx --with-reference`` puts it in
  ``<MLX venv>/reference``; ``ENGINELINK_MLX_REFERENCE`` names another
  folder), with the same batch sizes, in a process group of its own at the
  engine's priority, driven by the same load client over the same
  ``MlxEngine`` contract. It joins the alternation.

Each side's figure is output tokens / load window (first request to last
finished; a short warm-up request before). The ratio is enginelink / raw of
the per-concurrency medians (and reference / raw when that arm ran).
Numbers measured on a shared machine mean little.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

RAW_TIMEOUT_S = 1800.0
REFERENCE_ENV = "ENGINELINK_MLX_REFERENCE"  # the folder holding smg_grpc_servicer (default <MLX venv>/reference)
REFERENCE_START_TIMEOUT_S = 300.0


def engine_args_for(args: argparse.Namespace, concurrency: int) -> list[str]:
    import shlex

    engine_args = shlex.split(args.engine_args_text) + list(args.engine_args)
    if not any(a.split("=", 1)[0] == "--completion-batch-size" for a in engine_args):
        engine_args += ["--completion-batch-size", str(concurrency)]
    return engine_args


def _flag(engine_args: list[str], name: str, default: int) -> int:
    from enginelink.runtime.engine.launchers import flag_value

    value = flag_value(engine_args, name)
    return default if value is None else int(value)


def measure_raw(python: str, model_dir: Path, engine_args: list[str], concurrency: int, requests: int,
                max_tokens: int, prompt_tokens: int) -> dict:
    from enginelink.runtime.engine.placement import lower_priority
    from enginelink.tools.serve import _engine_nice

    plan = {"model": str(model_dir), "concurrency": concurrency, "requests": requests, "max_tokens": max_tokens,
            "prompt_tokens": prompt_tokens,
            "completion_batch_size": _flag(engine_args, "--completion-batch-size", concurrency),
            "prefill_batch_size": _flag(engine_args, "--prefill-batch-size", 8),
            "prefill_step_size": _flag(engine_args, "--prefill-step-size", 2048)}  # fmt: skip
    # A process group of its own in our session, as enginelink starts its engine (in its servicer's
    # session: under the kernel's autogroups, one scheduling group).
    process = subprocess.Popen([python, "-m", "enginelink.tools.bench_mlx", "--raw", json.dumps(plan)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               process_group=0)  # fmt: skip
    lower_priority(process.pid, _engine_nice())  # and at the engine's priority (ENGINELINK_ENGINE_NICE)
    try:
        out, err = process.communicate(timeout=RAW_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise RuntimeError(f"the raw MLX driver took over {RAW_TIMEOUT_S:.0f} s") from None
    if process.returncode != 0:
        raise RuntimeError(f"the raw MLX driver failed (status {process.returncode}): {err.strip()[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def reference_dir(python: str) -> Path:
    """Where the reference MLX servicer is installed, or RuntimeError saying how to install it."""
    folder = Path(os.environ.get(REFERENCE_ENV) or Path(python).parent.parent / "reference")
    if not (folder / "smg_grpc_servicer" / "mlx" / "server.py").exists():
        raise RuntimeError(f"no reference MLX servicer at {folder}: run tools/setup-mlx --with-reference "
                           f"(or set {REFERENCE_ENV} to a folder with smg-grpc-servicer 0.14.1)")
    return folder


class ReferenceServicer:
    """``python -m smg_grpc_servicer.mlx.server`` in a process group of its own at the engine's priority, stopped by SIGTERM."""

    def __init__(self, python: str, reference: Path, model_dir: Path, engine_args: list[str], tmp: Path) -> None:
        from enginelink.tools.bench_load import free_port

        self.port = free_port()
        tmp.mkdir(parents=True, exist_ok=True)
        self.log_path = tmp / "reference.log"
        self.argv = [python, "-m", "smg_grpc_servicer.mlx.server", "--model", str(model_dir), "--host", "127.0.0.1",
                     "--port", str(self.port),
                     "--completion-batch-size", str(_flag(engine_args, "--completion-batch-size", 32)),
                     "--prefill-batch-size", str(_flag(engine_args, "--prefill-batch-size", 8))]  # fmt: skip
        # Its own prefill step as the engine's (the reference reads it from the environment).
        self.env = {**os.environ, "PYTHONPATH": str(reference),
                    "MLX_PREFILL_STEP": str(_flag(engine_args, "--prefill-step-size", 2048))}  # fmt: skip
        self.process: subprocess.Popen | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        from enginelink.runtime.engine.placement import lower_priority
        from enginelink.tools.bench_load import wait_serving
        from enginelink.tools.serve import _engine_nice

        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                        process_group=0)  # fmt: skip
        lower_priority(self.process.pid, _engine_nice())  # its engine is in-process: it runs where an engine runs
        try:
            wait_serving(self.target, REFERENCE_START_TIMEOUT_S, self.process, "mlx")
        except Exception as error:
            self.stop()
            raise RuntimeError(f"the reference MLX servicer did not start: {error}\n{self.log()}") from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # it stops its server (5 s grace) and its generation thread
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


def measure_reference(args: argparse.Namespace, python: str, reference: Path, model_dir: Path,
                      engine_args: list[str], concurrency: int, client: str, tmp: Path) -> dict:
    from enginelink.tools import bench_load
    from enginelink.tools.bench_engine import load_result

    run_args = argparse.Namespace(**vars(args))
    run_args.concurrency, run_args.client, run_args.contract = concurrency, client, "mlx"
    run_args.target = run_args.servicer_pid = run_args.duration_s = None
    run_args.temperature, run_args.random_prompt = 1.0, True
    server = ReferenceServicer(python, reference, model_dir, engine_args, tmp)
    server.start()
    try:
        report = bench_load.run_load(run_args, server.target, server.process.pid)
    except Exception as error:
        raise RuntimeError(f"{error}\nreference servicer log ends:\n{server.log()}") from None
    finally:
        server.stop()
    return load_result(report)


def raw_main(plan: dict) -> dict:
    """In the MLX venv: drive BatchGenerator alone with the plan's load; the tokens/s."""
    import importlib

    import mlx.core as mx

    from enginelink.tools import mlx_core
    from enginelink.tools.mlx_admission import burst_sizes

    generate = importlib.import_module("mlx_lm.generate")
    sample_utils = importlib.import_module("mlx_lm.sample_utils")
    model, config = mlx_core.load(Path(plan["model"]))
    vocab = int(config["vocab_size"])
    gen = generate.BatchGenerator(model, completion_batch_size=plan["completion_batch_size"],
                                  prefill_batch_size=plan["prefill_batch_size"],
                                  prefill_step_size=plan["prefill_step_size"])  # fmt: skip
    rng = random.Random()
    sampler = sample_utils.make_sampler(temp=1.0)

    def add(tokens: int) -> None:
        gen.insert(prompts=[[rng.randrange(3, vocab) for _ in range(plan["prompt_tokens"])]], max_tokens=[tokens],
                   samplers=[sampler], state_machines=[generate.SequenceStateMachine()])

    steps, bursts = [0], Counter()  # what the engine's stop line says of enginelink's arm (mlx_core.summary)

    def drive(n_requests: int, n_concurrent: int, tokens_each: int) -> tuple[int, int]:
        sent = done = tokens = 0
        while sent < min(n_concurrent, n_requests):
            add(tokens_each)
            sent += 1
        inserted = sent
        while done < n_requests:
            if inserted:
                bursts[inserted] += 1
                inserted = 0
            _, generated = gen.next()
            steps[0] += bool(generated)
            for g in generated:
                tokens += 1
                if g.finish_reason is not None:
                    done += 1
                    if sent < n_requests:
                        add(tokens_each)
                        sent += 1
                        inserted += 1
        return tokens, done

    drive(1, 1, 2)
    mx.synchronize()
    steps[0] = 0
    bursts.clear()
    t0, cpu0 = time.monotonic(), time.process_time()
    tokens, done = drive(plan["requests"], plan["concurrency"], plan["max_tokens"])
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    gen.close()
    # The CPU this process spent over the window: beside the enginelink arm's engine_cpu_s (its engine
    # process alone), it tells engine work from waiting for a core on a shared machine.
    sizes = burst_sizes(bursts)
    return {"tokens": tokens, "requests": done, "short": 0, "wall_s": wall, "tokens_per_s": tokens / wall,
            "engine_cpu_s": cpu, "engine_summary": f"{steps[0]} steps, bursts {sizes}"}


def run(args: argparse.Namespace) -> int:
    from enginelink.runtime.engine.launchers import LauncherError
    from enginelink.runtime.contracts.mlx.launch import MlxIncompatible, check_installed, default_mlx_python
    from enginelink.tools.bench_engine import measure_enginelink
    from enginelink.tools.bench_load import bench_model_dir, machine_facts

    try:
        python = default_mlx_python()
        check_installed(python)
    except (LauncherError, MlxIncompatible) as error:
        raise RuntimeError(str(error)) from None
    against = list(getattr(args, "against", []) or [])
    if "smg-rust" in against:
        raise RuntimeError("smg 1.13.0 has no Rust MLX servicer: with --engine mlx, --against takes smg-python "
                           "(the reference MLX servicer)")
    sides = ["enginelink", "raw"] + (["reference"] if "smg-python" in against else [])
    reference = reference_dir(python) if "reference" in sides else None
    model_dir = Path(args.model) if args.model else bench_model_dir()
    args.requests = requests = args.requests or 256
    client = args.client[0] if isinstance(args.client, list) else args.client
    results = []
    with tempfile.TemporaryDirectory(prefix="enginelink-bench-mlx-") as tmp_name:
        tmp = Path(tmp_name)
        for concurrency in args.concurrency:
            engine_args = engine_args_for(args, concurrency)
            runs: dict[str, list[dict]] = {side: [] for side in sides}
            for r in range(args.rounds):
                for side in sides:
                    if side == "enginelink":
                        res = measure_enginelink(args, model_dir, engine_args, concurrency, client,
                                                 tmp / f"el-{concurrency}-{r}", engine="mlx")
                    elif side == "reference":
                        res = measure_reference(args, python, reference, model_dir, engine_args, concurrency,
                                                client, tmp / f"ref-{concurrency}-{r}")
                    else:
                        res = measure_raw(python, model_dir, engine_args, concurrency, requests, args.max_tokens,
                                          args.prompt_tokens)
                    # The machine's 1-minute load average after the run: on a shared machine a ratio means
                    # little without it. CPU: the engine process's (raw: the whole driver; the reference's
                    # engine is in its servicer process).
                    res["load1"] = os.getloadavg()[0]
                    cpu = res.get("servicer_cpu_s") if side == "reference" else res.get("engine_cpu_s")
                    runs[side].append(res)
                    print(f"concurrency {concurrency} round {r + 1} {side:10s} {res['tokens_per_s']:8.0f} tokens/s "
                          f"({res['tokens']} tokens in {res['wall_s']:.2f} s, {res['short']} short/failed, "
                          f"engine CPU {'?' if cpu is None else f'{cpu:.2f}'} s, load {res['load1']:.1f})"
                          + (f"; engine: {res['engine_summary']}" if res.get("engine_summary") else ""),
                          file=sys.stderr, flush=True)
            el = statistics.median(x["tokens_per_s"] for x in runs["enginelink"])
            raw = statistics.median(x["tokens_per_s"] for x in runs["raw"])
            result = {"concurrency": concurrency, "engine_args": engine_args, "runs": runs,
                      "enginelink_tokens_per_s": el, "raw_tokens_per_s": raw, "ratio": el / raw}
            if "reference" in runs:
                ref = statistics.median(x["tokens_per_s"] for x in runs["reference"])
                result.update(reference_tokens_per_s=ref, reference_ratio=ref / raw)
            results.append(result)
    report = {"machine": machine_facts(), "engine": "mlx", "requests": requests, "max_tokens": args.max_tokens,
              "prompt_tokens": args.prompt_tokens, "model": str(model_dir), "results": results}
    from enginelink.tools.bench_plot import maybe_write

    maybe_write(args, report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"enginelink bench --engine mlx: {requests} requests x {args.max_tokens} tokens, "
              f"prompt {args.prompt_tokens} random tokens, temperature 1, ignore_eos")
        for r in results:
            line = (f"  concurrency {r['concurrency']:4d}: enginelink {r['enginelink_tokens_per_s']:7.0f} tokens/s  "
                    f"raw BatchGenerator {r['raw_tokens_per_s']:7.0f} tokens/s  ratio {r['ratio']:.3f}")
            if "reference_tokens_per_s" in r:
                line += (f"  reference servicer {r['reference_tokens_per_s']:7.0f} tokens/s  "
                         f"ratio {r['reference_ratio']:.3f}")
            print(line)
    bad = any(x["short"] for r in results for side in r["runs"].values() for x in side)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--raw":  # the raw arm, inside the MLX venv
        print(json.dumps(raw_main(json.loads(argv[1]))), flush=True)
        return 0
    print("usage: python -m enginelink.tools.bench_mlx --raw PLAN_JSON (run by enginelink bench --engine mlx)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
