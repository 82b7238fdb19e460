"""``enginelink bench --against smg-rust,smg-python``: the reference servicers, side by side with enginelink.

Theory of operation. An *arm* is one servicer in front of the engine: ``enginelink`` (``enginelink
serve``), ``smg-rust`` (``smg.servicer.VllmGrpcServer`` of smg 1.13.0) or ``smg-python`` (the
``VllmEngineServicer`` of smg-grpc-servicer 0.14.1, hosted by vLLM's own gRPC launcher on an
``AsyncLLM``). The references run from their own venv (``tools/setup-bench-refs``), through
``tools/bench_ref_servicer.py``. Every arm gets the same engine, model, engine arguments, workload and
load client (``bench_load.run_load``: the same process, the same calls), one arm after the other in
each repetition, so slow drift of a shared machine lands on every arm alike.

- ``--engine vllm`` (``bench_engine.py``): the arms join enginelink and the raw ZMQ driver in its
  alternation. smg-rust's engine is the very launch enginelink and the raw driver use
  (``runtime/contracts/vllm/vllm_headless.py``, its own session, the priority ``ENGINELINK_ENGINE_NICE`` gives);
  smg-python's is the one its ``AsyncLLM`` starts itself, as that reference is deployed.
- the sim engine (no ``--engine``): the servicer alone against a zero-cost engine. Every arm's engine
  is the sim engine with the bench's engine arguments; smg-python's ``AsyncLLM`` starts no engine of
  its own (``--data-parallel-size-local 0``) and the sim engine dials it as a remote headless rank.
- ``grpclib-floor`` (the sim engine only): not a servicer anyone deploys, but the gRPC stack the design
  card binds enginelink to, with nothing behind it (``tools/bench_floor_servicer.py``). It has no
  engine; each repetition it streams each call's tokens in as many messages as enginelink sent per call
  in that repetition, so its CPU per token is the floor under enginelink's at the same calls.

What is compared: tokens/s over the load window, the servicer's CPU per output token (its process
only; the engine is read apart), its RSS at the end of the window, and, pooled over the repetitions,
each arm's ratio to the raw driver and to enginelink per repetition, as the geometric mean of the
per-repetition ratios with a 95% interval (normal approximation on their logs).

Rules: KV events and the planned warm-up are off in every arm; an arm whose servicer cannot start
fails the bench (never a silently missing column); no reference is installed by the bench itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

from enginelink.tools.bench_load import Servicer, proc_children

ARMS = ("smg-rust", "smg-python", "grpclib-floor")
REFERENCES = ("smg-rust", "smg-python")  # the arms installed by tools/setup-bench-refs
FLOOR = "grpclib-floor"
REFS_VENV_ENV = "ENGINELINK_BENCH_REFS_VENV"
SHIM = Path(__file__).resolve().parent / "bench_ref_servicer.py"
# Where tools/setup-bench-refs puts the references by default.
DEFAULT_REFS_VENV = Path(__file__).resolve().parent.parent / ".venv-bench-refs"
Z_95 = 1.959963984540054
# smg-python builds an AsyncLLM (vLLM and torch imported) before it answers: allow a slow, shared machine.
START_TIMEOUT_S = 600.0


def parse_against(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(ARMS)}; got {text!r}")
    return list(dict.fromkeys(arms))


def refs_python() -> Path:
    venv = Path(os.environ.get(REFS_VENV_ENV) or DEFAULT_REFS_VENV)
    python = venv / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"no reference servicers at {venv}: run tools/setup-bench-refs "
                           f"(or set {REFS_VENV_ENV} to the venv it made)")
    return python


def flag_int(argv: list[str], flag: str) -> int | None:
    from enginelink.runtime.engine.launchers import flag_value

    value = flag_value(argv, flag)
    return int(value) if value is not None else None


class RefServicer(Servicer):
    """A reference servicer in a subprocess, started and stopped as ``bench_load.Servicer`` does."""

    def __init__(self, arm: str, tmp: Path, model_dir: Path, engine_args: list[str],
                 engine_command: tuple[list[str], dict[str, str]] | None, env: dict[str, str] | None = None,
                 front_end_args: list[str] | None = None) -> None:
        super().__init__(argparse.Namespace(engine_args_text="", engine_args=[], concurrency=1, model=model_dir),
                         tmp, model_dir=model_dir, engine_args=engine_args, env=env)
        self.arm = arm
        self.metrics_port = None  # the references' own metrics are not read: the client's figures compare
        impl = "rust" if arm == "smg-rust" else "python"
        argv = [str(refs_python()), str(SHIM), impl, "--port", str(self.port), "--model", str(model_dir)]
        if engine_command is not None:
            spec = tmp / f"{arm}-engine.json"
            spec.write_text(json.dumps({"argv": engine_command[0], "env": engine_command[1]}))
            argv += ["--engine", str(spec)]
        if impl == "rust":
            for flag in ("--max-model-len", "--max-num-seqs"):
                value = flag_int(engine_args, flag)
                if value is not None:
                    argv += [flag, str(value)]
        else:
            argv += ["--", *(engine_args if front_end_args is None else front_end_args)]
        self.argv = argv
        # Nothing of enginelink's environment may change a reference's behaviour; its own knobs are set here.
        self.env = {**self.env, "SMG_VLLM_SERVICER_KV_EVENTS": "0", "SMG_VLLM_SERVICER_WARMUP": "off"}


def floor_messages(max_tokens: int, tokens_per_chunk: float) -> int:
    """Chunk messages per call for the floor: as many as enginelink sent per call (at least one)."""
    if tokens_per_chunk <= 0:
        return 1
    return max(1, min(max_tokens, round(max_tokens / tokens_per_chunk)))


class FloorServicer(Servicer):
    """``tools/bench_floor_servicer.py`` in a subprocess, from enginelink's own environment."""

    def __init__(self, tmp: Path, messages: int, max_num_seqs: int) -> None:
        from enginelink.runtime.rpc.fastpath import MAX_CONCURRENT_STREAMS

        # No model and no engine: Servicer's own command is replaced below, so any model_dir will do.
        super().__init__(argparse.Namespace(engine_args_text="", engine_args=[], concurrency=1, model=None),
                         tmp, model_dir=tmp, engine_args=[])
        self.messages = messages
        self.metrics_port = None
        self.argv = [sys.executable, "-m", "enginelink.tools.bench_floor_servicer", "--port", str(self.port),
                     "--messages", str(messages), "--max-num-seqs", str(max_num_seqs),
                     "--max-streams", str(MAX_CONCURRENT_STREAMS)]


def engine_processes(servicer_pid: int) -> list[int]:
    """Every process under the servicer (its engine, the engine's workers)."""
    seen, todo = [], proc_children(servicer_pid)
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo += proc_children(pid)
    return seen


def give_engine_its_priority(servicer: RefServicer, levels: int) -> None:
    """The priority enginelink gives its engine (``ENGINELINK_ENGINE_NICE``), so every arm runs alike."""
    if levels <= 0:
        return
    from enginelink.runtime.engine.placement import NICE_MAX, lower_priority

    for pid in engine_processes(servicer.process.pid):
        try:
            if os.getsid(pid) == pid:  # an engine in its own session (smg-rust's): as enginelink's
                lower_priority(pid, levels)
            else:  # inside the servicer's session (smg-python's own engine core): its nice value only
                os.setpriority(os.PRIO_PROCESS, pid, min(NICE_MAX, os.getpriority(os.PRIO_PROCESS, 0) + levels))
        except (OSError, ProcessLookupError):
            continue


# -- pooling -------------------------------------------------------------------------------


def pooled(ratios: list[float]) -> dict:
    """The geometric mean of per-repetition ratios, with a 95% interval from the spread of their logs."""
    logs = [math.log(r) for r in ratios if r and r > 0]
    if not logs:
        return {"n": 0, "geomean": None, "low": None, "high": None}
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return {"n": 1, "geomean": math.exp(mean), "low": None, "high": None}
    half = Z_95 * statistics.stdev(logs) / math.sqrt(len(logs))
    return {"n": len(logs), "geomean": math.exp(mean), "low": math.exp(mean - half), "high": math.exp(mean + half)}


def format_pooled(p: dict) -> str:
    if p["geomean"] is None:
        return "-"
    if p["low"] is None:
        return f"{p['geomean']:.3f} (1 repetition)"
    return f"{p['geomean']:.3f} ({p['low']:.3f}-{p['high']:.3f}, {p['n']} repetitions)"


def per_token_us(run: dict, key: str) -> float | None:
    value = run.get(key)
    return None if value is None or not run.get("tokens") else value / run["tokens"] * 1e6


def arm_summary(runs: dict[str, list[dict]], arm: str, bases: tuple[str, ...]) -> dict:
    """One arm's figures: medians of its runs, and its ratio to each base, repetition by repetition."""
    mine = runs[arm]
    summary = {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
        "servicer_us_per_token": _median([per_token_us(r, "servicer_cpu_s") for r in mine]),
        "servicer_rss_mib": _median([r.get("servicer_rss_mib") for r in mine]),
        "tokens_per_s_per_core": _median([r["tokens"] / r["servicer_cpu_s"] if r.get("servicer_cpu_s") else None
                                          for r in mine]),
    }
    summary["latency"] = latency_summary(mine, [runs[b] for b in bases if b != arm and b in runs][:1])
    for base in bases:
        if base == arm or base not in runs:
            continue
        pairs = list(zip(mine, runs[base]))
        summary[f"vs_{base}"] = pooled([a["tokens_per_s"] / b["tokens_per_s"] for a, b in pairs if b["tokens_per_s"]])
        cpu = [(per_token_us(a, "servicer_cpu_s"), per_token_us(b, "servicer_cpu_s")) for a, b in pairs]
        if all(a and b for a, b in cpu) and cpu:
            summary[f"cpu_vs_{base}"] = pooled([a / b for a, b in cpu])
    return summary


LATENCY = (("ttft_ms", "TTFT"), ("itl_ms", "inter-token"))
QUANTILES = ("p50", "p90", "p99")


def spread(values: list) -> dict | None:
    """Median of the repetitions' figures, with their lowest and highest (the spread across repetitions)."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "low": min(values), "high": max(values), "n": len(values)}


def latency_summary(mine: list[dict], bases: list[list[dict]]) -> dict:
    """Per figure (TTFT and inter-token p50/p90/p99, the servicer's output delay): the spread of the
    arm's repetitions, and, against the first base (the raw driver on a real engine), what the arm
    added in each repetition (its percentile minus the base's in the same repetition)."""
    out: dict = {}
    for key, _ in LATENCY:
        for q in QUANTILES:
            out[f"{key}.{q}"] = spread([(r.get(key) or {}).get(q) for r in mine])
            if bases:
                added = [(a.get(key) or {}).get(q) - (b.get(key) or {}).get(q)
                         for a, b in zip(mine, bases[0])
                         if (a.get(key) or {}).get(q) is not None and (b.get(key) or {}).get(q) is not None]
                out[f"{key}.{q}.added"] = spread(added)
    for stage in ("received", "engine"):
        for q in QUANTILES:
            out[f"output_delay.{stage}.{q}"] = spread([((r.get("output_delay_ms") or {}).get(stage) or {}).get(q)
                                                       for r in mine])
    return out


def format_spread(s: dict | None, spec: str = ".1f") -> str:
    if s is None:
        return "-"
    if s["n"] == 1:
        return format(s["median"], spec)
    return f"{s['median']:{spec}} ({s['low']:{spec}}-{s['high']:{spec}})"


def format_latency(summary: dict, base: str | None) -> list[str]:
    lat = summary.get("latency") or {}
    lines = []
    for key, label in LATENCY:
        spec = ".1f" if key == "ttft_ms" else ".2f"
        parts = [f"{q} {format_spread(lat.get(f'{key}.{q}'), spec)}" for q in QUANTILES]
        line = f"        {label} ms (median of repetitions, lowest-highest): " + ", ".join(parts)
        if base and any(lat.get(f"{key}.{q}.added") for q in QUANTILES):
            line += f"; added over {base}: " + ", ".join(
                f"{q} {format_spread(lat.get(f'{key}.{q}.added'), spec)}" for q in QUANTILES)
        lines.append(line)
    for stage, what in (("received", "frame read"), ("engine", "engine timestamp")):
        if lat.get(f"output_delay.{stage}.p50"):
            lines.append(f"        servicer output delay ms ({what} -> written, its histogram): " + ", ".join(
                f"{q} {format_spread(lat.get(f'output_delay.{stage}.{q}'), '.3f')}" for q in QUANTILES))
    return lines


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def format_arm(label: str, runs: list[dict], summary: dict, bases: tuple[str, ...],
               tokens_ratio: bool = True) -> list[str]:
    """The arm's lines; without ``tokens_ratio`` only its CPU per token is compared (an arm with no engine)."""
    us = summary["servicer_us_per_token"]
    rss = summary["servicer_rss_mib"]
    per_core = summary["tokens_per_s_per_core"]
    lines = [f"      {label:>13s}: {summary['tokens_per_s']:8.0f} tokens/s ("
             + ", ".join(f"{r['tokens_per_s']:.0f}" for r in runs) + ")"
             + (f"; servicer {us:.1f} us/token" if us is not None else "")
             + (f" ({per_core / 1e3:.1f}k tokens/s per core)" if per_core else "")
             + (f"; RSS {rss:.0f} MiB" if rss is not None else "")]
    for base in bases:
        parts = []
        if tokens_ratio and f"vs_{base}" in summary:
            parts.append(f"tokens/s {format_pooled(summary[f'vs_{base}'])}")
        if f"cpu_vs_{base}" in summary:
            parts.append(f"CPU per token {format_pooled(summary[f'cpu_vs_{base}'])}")
        if parts:
            lines.append(f"        ÷ {base}, per repetition: " + "; ".join(parts))
    if "latency" in summary:
        lines += format_latency(summary, next((b for b in bases if f"vs_{b}" in summary and b == "raw"), None))
    return lines


# -- the servicer alone, against the zero-cost sim engine ---------------------------------------------


def run_sim(args: argparse.Namespace) -> int:
    """Alternate enginelink and the references over the sim engine, for each ``--concurrency``."""
    import tempfile
    import time

    from enginelink.runtime.engine.launchers import SimLauncher
    from enginelink.tools import bench_load
    from enginelink.tools.bench_load import bench_model_dir, engine_args_of, machine_facts

    model_dir = Path(args.model) if args.model else bench_model_dir()
    arms = ["enginelink", *args.against]  # enginelink first in each repetition: the floor takes its chunking
    if any(arm in REFERENCES for arm in arms):
        refs_python()  # fail before any servicer starts
    results = []
    bad = False
    with tempfile.TemporaryDirectory(prefix="enginelink-bench-") as tmp_name:
        tmp = Path(tmp_name)
        for concurrency in args.concurrency:
            run_args = argparse.Namespace(**vars(args))
            run_args.concurrency = concurrency
            run_args.client = args.client[0] if isinstance(args.client, list) else args.client
            run_args.target = None
            run_args.servicer_pid = None
            engine_args = engine_args_of(run_args)
            runs: dict[str, list[dict]] = {arm: [] for arm in arms}
            for r in range(args.rounds):
                for arm in arms:
                    where = tmp / f"{arm}-{concurrency}-{r}"
                    if arm == "enginelink":
                        servicer = Servicer(run_args, where, model_dir=model_dir, engine_args=engine_args,
                                            env={"ENGINELINK_KV_EVENTS": "off", "ENGINELINK_WARMUP": "off"})
                    elif arm == FLOOR:
                        messages = floor_messages(args.max_tokens, runs["enginelink"][-1]["tokens_per_chunk"])
                        servicer = FloorServicer(where, messages, flag_int(engine_args, "--max-num-seqs") or 256)
                    else:
                        where.mkdir(parents=True, exist_ok=True)
                        command = SimLauncher(model_dir, engine_args).command("{handshake}")
                        # smg-python's AsyncLLM front end: the vLLM arguments that shape it, from the sim's.
                        front = [a for flag in ("--max-num-seqs", "--max-model-len")
                                 if (v := flag_int(engine_args, flag)) is not None for a in (flag, str(v))]
                        servicer = RefServicer(arm, where, model_dir, engine_args, command, front_end_args=front)
                    t = time.monotonic()
                    servicer.start(timeout_s=START_TIMEOUT_S)
                    try:
                        report = bench_load.run_load(run_args, servicer.target, servicer.process.pid, servicer.metrics_port)
                    except Exception as error:
                        raise RuntimeError(f"{arm}: {error}\nits log ends:\n{servicer.log()}") from None
                    finally:
                        servicer.stop()
                    run = {"tokens": report["output_tokens"], "tokens_per_s": report["tokens_per_s"],
                           "wall_s": report["wall_s"], "short": report["short"] + report["errors"],
                           "servicer_cpu_s": report["servicer_cpu_s"], "client_cpu_s": report["client_cpu_s"],
                           "servicer_rss_mib": report.get("servicer_rss_mib"),
                           "tokens_per_chunk": report["tokens_per_chunk"],
                           "ttft_ms": report["ttft_ms"], "itl_ms": report["itl_token_ms"],
                           "output_delay_ms": report.get("output_delay_ms")}
                    if arm == FLOOR:
                        run["messages_per_call"] = servicer.messages
                    bad |= bool(run["short"])
                    runs[arm].append(run)
                    us = per_token_us(run, "servicer_cpu_s")
                    print(f"concurrency {concurrency} round {r + 1} {arm:12s} {run['tokens_per_s']:8.0f} tokens/s "
                          f"({run['tokens']} tokens in {run['wall_s']:.2f} s, {run['tokens_per_chunk']:.1f} per "
                          f"message, {run['short']} short/failed; servicer "
                          f"{us:.1f} us/token, RSS {run['servicer_rss_mib'] or 0:.0f} MiB; "
                          f"{time.monotonic() - t:.0f} s with start-up)", file=sys.stderr, flush=True)
            results.append({"concurrency": concurrency, "engine_args": engine_args, "runs": runs,
                            "arms": {arm: arm_summary(runs, arm, ("enginelink",)) for arm in arms}})
    report = {"machine": machine_facts(), "engine": "sim", "max_tokens": args.max_tokens,
              "prompt_tokens": args.prompt_tokens, "requests": args.requests, "duration_s": args.duration_s,
              "model": str(model_dir), "results": results}
    if getattr(args, "latency_plot", None):
        plot(results, arms, args.latency_plot, f"enginelink bench --against {','.join(args.against)}: sim engine "
             f"{' '.join(results[0]['engine_args']) if results else ''}, {args.rounds} repetition(s)")
    from enginelink.tools.bench_plot import maybe_write

    maybe_write(args, report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"enginelink bench --against {','.join(args.against)}: the servicer alone against the sim engine "
              f"({' '.join(results[0]['engine_args']) if results else ''}), max_tokens {args.max_tokens}, "
              f"prompt {args.prompt_tokens}, {args.rounds} repetition(s), arms alternating")
        for r in results:
            print(f"  concurrency {r['concurrency']}:")
            for arm in arms:
                print("\n".join(format_arm(arm, r["runs"][arm], r["arms"][arm], ("enginelink",),
                                            tokens_ratio=arm != FLOOR)))
                if arm == FLOOR:
                    print("        no engine, no work: grpclib alone, chunk messages per call as enginelink's ("
                          + ", ".join(str(run["messages_per_call"]) for run in r["runs"][arm]) + ")")
    return 1 if bad else 0


# -- the plot (--plot FILE.svg) ----------------------------------------------------------------------


def plot(results: list[dict], arms: list[str], path: Path, title: str, base: str | None = None) -> None:
    """Each arm side by side per concurrency: tokens/s (÷ ``base`` per repetition when given), TTFT and
    inter-token p50/p90/p99; a point is the median of the repetitions, its whisker their lowest-highest."""
    from enginelink.tools.bench_svg import RangePanel, write

    groups = [f"c={r['concurrency']}" for r in results]

    def item(s: dict | None):
        return None if s is None else (s["median"], s["low"], s["high"])

    if base:
        rate = RangePanel(f"tokens/s ÷ {base}, same repetition", "ratio", groups, reference=1.0)
        for arm in arms:
            rate.series.append((arm, [item(spread([a["tokens_per_s"] / b["tokens_per_s"]
                                                   for a, b in zip(r["runs"][arm], r["runs"][base])
                                                   if b["tokens_per_s"]])) for r in results]))
    else:
        rate = RangePanel("tokens/s", "tokens/s", groups)
        for arm in arms:
            rate.series.append((arm, [item(spread([x["tokens_per_s"] for x in r["runs"][arm]])) for r in results]))
    panels = [rate]
    for key, label in LATENCY:
        for q in QUANTILES:
            if key == "ttft_ms" and q == "p90":
                continue
            panel = RangePanel(f"{label} {q}", "ms", groups)
            for arm in arms:
                panel.series.append((arm, [item((r["arms"][arm].get("latency") or {}).get(f"{key}.{q}"))
                                           for r in results]))
            panels.append(panel)
    write(path, panels, title, columns=3, note="point: median of the repetitions; whisker: lowest to highest")
