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
  wire, no servicer. It runs in a session of its own at the priority
  enginelink gives its engine (``ENGINELINK_ENGINE_NICE``), as the engine runs.

Each side's figure is output tokens / load window (first request to last
finished; a short warm-up request before). The ratio is enginelink / raw of
the per-concurrency medians. Numbers measured on a shared machine mean little.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAW_TIMEOUT_S = 1800.0


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
    from enginelink.runtime.engine.engine_process import lower_priority
    from enginelink.tools.serve import _engine_nice

    plan = {"model": str(model_dir), "concurrency": concurrency, "requests": requests, "max_tokens": max_tokens,
            "prompt_tokens": prompt_tokens,
            "completion_batch_size": _flag(engine_args, "--completion-batch-size", concurrency),
            "prefill_batch_size": _flag(engine_args, "--prefill-batch-size", 8),
            "prefill_step_size": _flag(engine_args, "--prefill-step-size", 2048)}  # fmt: skip
    # Its own session, as enginelink starts its engine: with the kernel's autogroups a session is a
    # scheduling group, so the raw arm must compete for CPU as the engine does, not inside ours.
    process = subprocess.Popen([python, "-m", "enginelink.tools.bench_mlx", "--raw", json.dumps(plan)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # fmt: skip
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


def raw_main(plan: dict) -> dict:
    """In the MLX venv: drive BatchGenerator alone with the plan's load; the tokens/s."""
    import importlib

    import mlx.core as mx

    from enginelink.tools import mlx_core

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

    def drive(n_requests: int, n_concurrent: int, tokens_each: int) -> tuple[int, int]:
        sent = done = tokens = 0
        while sent < min(n_concurrent, n_requests):
            add(tokens_each)
            sent += 1
        while done < n_requests:
            _, generated = gen.next()
            for g in generated:
                tokens += 1
                if g.finish_reason is not None:
                    done += 1
                    if sent < n_requests:
                        add(tokens_each)
                        sent += 1
        return tokens, done

    drive(1, 1, 2)
    mx.synchronize()
    t0 = time.monotonic()
    tokens, done = drive(plan["requests"], plan["concurrency"], plan["max_tokens"])
    wall = time.monotonic() - t0
    gen.close()
    return {"tokens": tokens, "requests": done, "short": 0, "wall_s": wall, "tokens_per_s": tokens / wall}


def run(args: argparse.Namespace) -> int:
    from enginelink.runtime.engine.launchers import LauncherError
    from enginelink.runtime.engine.mlx_launch import MlxIncompatible, check_installed, default_mlx_python
    from enginelink.tools.bench_engine import measure_enginelink
    from enginelink.tools.bench_load import bench_model_dir, machine_facts

    try:
        python = default_mlx_python()
        check_installed(python)
    except (LauncherError, MlxIncompatible) as error:
        raise RuntimeError(str(error)) from None
    model_dir = Path(args.model) if args.model else bench_model_dir()
    args.requests = requests = args.requests or 256
    client = args.client[0] if isinstance(args.client, list) else args.client
    results = []
    with tempfile.TemporaryDirectory(prefix="enginelink-bench-mlx-") as tmp_name:
        tmp = Path(tmp_name)
        for concurrency in args.concurrency:
            engine_args = engine_args_for(args, concurrency)
            runs: dict[str, list[dict]] = {"enginelink": [], "raw": []}
            for r in range(args.rounds):
                for side in ("enginelink", "raw"):
                    if side == "enginelink":
                        res = measure_enginelink(args, model_dir, engine_args, concurrency, client,
                                                 tmp / f"el-{concurrency}-{r}", engine="mlx")
                    else:
                        res = measure_raw(python, model_dir, engine_args, concurrency, requests, args.max_tokens,
                                          args.prompt_tokens)
                    runs[side].append(res)
                    print(f"concurrency {concurrency} round {r + 1} {side:10s} {res['tokens_per_s']:8.0f} tokens/s "
                          f"({res['tokens']} tokens in {res['wall_s']:.2f} s, {res['short']} short/failed)",
                          file=sys.stderr, flush=True)
            el = statistics.median(x["tokens_per_s"] for x in runs["enginelink"])
            raw = statistics.median(x["tokens_per_s"] for x in runs["raw"])
            results.append({"concurrency": concurrency, "engine_args": engine_args, "runs": runs,
                            "enginelink_tokens_per_s": el, "raw_tokens_per_s": raw, "ratio": el / raw})
    report = {"machine": machine_facts(), "engine": "mlx", "requests": requests, "max_tokens": args.max_tokens,
              "prompt_tokens": args.prompt_tokens, "model": str(model_dir), "results": results}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"enginelink bench --engine mlx: {requests} requests x {args.max_tokens} tokens, "
              f"prompt {args.prompt_tokens} random tokens, temperature 1, ignore_eos")
        for r in results:
            print(f"  concurrency {r['concurrency']:4d}: enginelink {r['enginelink_tokens_per_s']:7.0f} tokens/s  "
                  f"raw BatchGenerator {r['raw_tokens_per_s']:7.0f} tokens/s  ratio {r['ratio']:.3f}")
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
