"""``enginelink bench``: the servicer's CPU per streamed output token, under load.

The command: its options, their checks, the run and its report. The load itself
(servicer, client processes, measurement; its theory of operation and rules)
is ``bench_load.py``; ``--engine vllm`` (enginelink beside a bare ZMQ driver)
is ``bench_engine.py``, run from here.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path

from enginelink.tools.bench_load import (
    DEFAULT_DURATION_S,
    SERVING_TIMEOUT_S,
    Servicer,
    run_load,
    wait_serving,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, metavar="HOST:PORT",
                   help="drive this running servicer instead of starting one")
    p.add_argument("--servicer-pid", type=int, default=None,
                   help="with --target: the servicer's process id, to read its CPU from /proc")
    p.add_argument("--engine", choices=["sim", "vllm", "mlx"], default="sim",
                   help="sim: the servicer's CPU per token with the sim engine (default); vllm: enginelink + "
                        "the real vLLM engine vs a bare ZMQ driver of it, alternating (tools/bench_engine.py); "
                        "mlx: enginelink + the MLX engine vs mlx-lm's BatchGenerator driven in-process, "
                        "alternating (tools/bench_mlx.py)")
    p.add_argument("--wire", choices=["vllm", "sglang", "tokenspeed"], default="vllm",
                   help="with the sim engine: the engine wire it speaks, and so the gRPC contract measured "
                        "(vllm: VllmEngine, default; sglang: SglangScheduler over SGLang's scheduler wire; "
                        "tokenspeed: TokenSpeedScheduler over TokenSpeed's wire); "
                        "with --target: the contract that servicer speaks")
    p.add_argument("--raw-front-end-us", type=float, nargs="+", default=[], metavar="US",
                   help="with --engine vllm: also run the raw driver as if it were a front end that spends "
                        "US CPU microseconds per output token (a busy loop in the driver), one side per value; "
                        "shows how much of the ratio a front end's CPU alone costs on this machine")
    p.add_argument("--against", type=_against, default=[], metavar="ARMS",
                   help="also run the reference servicers, comma-separated: smg-rust (smg 1.13.0's Rust servicer), "
                        "smg-python (smg-grpc-servicer 0.14.1); installed by tools/setup-bench-refs. With --engine "
                        "vllm they join the alternation; with --engine mlx, smg-python is the reference MLX servicer "
                        "(tools/setup-mlx --with-reference), a third arm; without either, every arm runs against "
                        "the zero-cost sim engine (the servicer alone), alternating (tools/bench_refs.py). "
                        "grpclib-floor (the sim engine only): grpclib with no engine and no work behind it, "
                        "as many messages per call as enginelink sent, the floor under enginelink's CPU per "
                        "token (tools/bench_floor_servicer.py)")
    p.add_argument("--rounds", type=int, default=2,
                   help="with --engine vllm, mlx or --against: repetitions per concurrency, the arms alternating "
                        "within each (default 2)")
    p.add_argument("--concurrency", type=int, nargs="+", default=None,
                   help="streaming calls open at once (default 128; --engine mlx: 8 and 32); --engine vllm, "
                        "mlx and --against take several")
    p.add_argument("--requests", type=int, default=None, help="total calls (default: run for --duration-s)")
    p.add_argument("--duration-s", type=float, default=None,
                   help=f"start calls for this long, then let open ones finish (default {DEFAULT_DURATION_S:g})")
    p.add_argument("--warm-s", type=float, default=None, metavar="S",
                   help="a steady window: open the calls' slots one by one over S seconds (so they are spread "
                        "over a call's life), keep them busy, and measure only the --duration-s after it "
                        "(tokens/s, latency, CPU; default: from the first call to the last, no warm-up). "
                        "With --engine vllm every side, the raw driver too, is measured so")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per call (default 128)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt tokens per call (default 16)")
    p.add_argument("--client-procs", type=int, default=1, help="load-generator processes (default 1)")
    p.add_argument("--channels", type=int, default=1, help="gRPC channels (connections) per client process")
    p.add_argument("--client", choices=["h2", "grpcio"], nargs="+", default=["h2"],
                   help="load client: h2, a lean HTTP/2 client that reads the wire itself (default; "
                        "tools/bench_h2client.py), or grpcio, grpc.aio, which spends about as much CPU per "
                        "message as the servicer; on a small machine that CPU is counted against enginelink. "
                        "--engine vllm takes both: one enginelink side each, the first one's is the ratio")
    p.add_argument("--model", type=Path, default=None,
                   help="model directory for the servicer it starts (default: the tiny test model, "
                        "the bench's own copy in the user cache dir)")
    p.add_argument("--engine-args", dest="engine_args_text", default="", metavar="'ARGS'",
                   help="sim engine arguments, one shell-quoted string, e.g. --engine-args='--step-us 2000' "
                        "(arguments after -- are added too)")
    p.add_argument("--media-ref-share", type=float, default=0.0, metavar="FRACTION",
                   help="the share of calls that carry one image media ref (--media-ref-url), e.g. 0.1: every "
                        "tenth call; the servicer needs --mm-processor inprocess (SMG_VLLM_MM_PROCESSOR). The "
                        "report then splits the text calls' tokens out (servicer CPU per text token)")
    p.add_argument("--media-ref-url", default=None, metavar="URL",
                   help="the media ref's URL (default: a 64x48 PNG as a data: URL)")
    p.add_argument("--py-spy", type=Path, default=None, metavar="FILE",
                   help="sample the servicer with py-spy over the load window (.svg flame graph, "
                        ".txt collapsed stacks); needs py-spy on PATH or in the venv")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.svg",
                   help="also draw the run's figures into this SVG: per arm and concurrency, tokens/s and the "
                        "servicer's CPU per token (needs matplotlib: pip install 'enginelink[bench]'); with --soak, "
                        "the soak's sampled curves instead (no matplotlib)")
    p.add_argument("--latency-plot", type=Path, default=None, metavar="FILE.svg",
                   help="with --against or --engine vllm: also draw each arm's tokens/s and latency percentiles "
                        "(TTFT, inter-token) side by side with their spread across repetitions")
    soak = p.add_argument_group("soak (tools/bench_soak.py)")
    soak.add_argument("--soak", type=_duration, default=None, metavar="DURATION",
                      help="instead of a measurement: a soak of DURATION (3600, 90m, 1h) at --concurrency (default "
                           "256) on the sim engine at a real engine's pace, with churn, an engine restart halfway, "
                           "resources sampled and their slopes judged; exit 1 on growth, a wrong stream or a "
                           "journal that does not verify")
    soak.add_argument("--soak-sample-s", type=float, default=None, metavar="S",
                      help="seconds between samples (default 60, less for a soak under 24 minutes)")
    soak.add_argument("--soak-warmup-s", type=float, default=None, metavar="S",
                      help="seconds of each servicer run not judged (default 300, a quarter of a shorter soak)")
    soak.add_argument("--soak-seed", type=int, default=1, help="the client's seed: the same mix of calls (default 1)")
    soak.add_argument("--soak-json", dest="json_out", type=Path, default=None, metavar="FILE",
                      help="write the soak's whole report (every sample) as JSON")
    p.set_defaults(engine_args=[])


def _duration(text: str) -> float:
    from enginelink.tools.bench_soak import parse_duration

    return parse_duration(text)


def _against(text: str) -> list[str]:
    from enginelink.tools.bench_refs import parse_against

    return parse_against(text)


def format_report(report: dict) -> str:
    c = report["config"]

    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    lines = [
        f"enginelink bench: concurrency {c['concurrency']}, max_tokens {c['max_tokens']}, "
        f"prompt {c['prompt_tokens']}, {c['client']} client, {c['client_procs']} process(es) x "
        f"{c['channels']} connection(s), {report.get('server', {}).get('wire', 'vllm')} contract",
        f"  machine            {report['machine']['nproc']} cpu, {report['machine']['cpu_model']}, "
        f"Python {report['machine']['python']}",
        f"  load window        {report['wall_s']:.2f} s" + (" (steady: after the warm-up, the window's tokens only)"
                                                            if report.get("steady") else ""),
        f"  calls              {report['requests']} ({report['ok']} ok, {report['short']} short, "
        f"{report['errors']} failed{' ' + str(report['error_codes']) if report['error_codes'] else ''})",
        f"  output tokens      {report['output_tokens']}  ({report['tokens_per_s']:,.0f} tokens/s)",
        f"  requests/s         {report['requests_per_s']:,.1f}",
        f"  messages/s         {report['messages_per_s']:,.0f}  ({report['tokens_per_chunk']:.2f} tokens/chunk)",
        f"  TTFT               p50 {f(report['ttft_ms']['p50'])} ms   p90 {f(report['ttft_ms'].get('p90'))} ms   "
        f"p99 {f(report['ttft_ms']['p99'])} ms",
        f"  inter-token        p50 {f(report['itl_token_ms']['p50'], '.3f')} ms   "
        f"p90 {f(report['itl_token_ms'].get('p90'), '.3f')} ms   "
        f"p99 {f(report['itl_token_ms']['p99'], '.3f')} ms  (message gap / tokens in it)",
        f"  inter-message      p50 {f(report['itl_message_ms']['p50'], '.3f')} ms   "
        f"p90 {f(report['itl_message_ms'].get('p90'), '.3f')} ms   "
        f"p99 {f(report['itl_message_ms']['p99'], '.3f')} ms",
        *[f"  output delay       p50 {f(d['p50'], '.3f')} ms   p90 {f(d['p90'], '.3f')} ms   p99 {f(d['p99'], '.3f')} ms"
          f"  (servicer's histogram, stage {stage}: {'engine timestamp' if stage == 'engine' else 'frame read'} "
          f"-> written; {d['frames']} frames)"
          for stage, d in sorted((report.get('output_delay_ms') or {}).items())],
        f"  servicer CPU       {f(report['servicer_cpu_s'], '.2f')} s  "
        f"= {f(report['servicer_cpu_us_per_token'])} us/token  "
        f"({f(None if report['servicer_cpu_util'] is None else report['servicer_cpu_util'] * 100, '.0f')}% of a core; "
        f"user {f(report['servicer_cpu_user_s'], '.2f')} s, sys {f(report['servicer_cpu_sys_s'], '.2f')} s)",
        "  servicer threads   " + ", ".join(f"{k} {v:.2f} s" for k, v in report.get("servicer_threads_cpu_s", {}).items() if v),
        f"  servicer RSS       {f(report.get('servicer_rss_mib'), '.0f')} MiB at the window's end, "
        f"peak {f(report.get('servicer_rss_peak_mib'), '.0f')} MiB",
        f"  engine CPU         {f(report['engine_cpu_s'], '.2f')} s  = {f(report['engine_cpu_us_per_token'])} us/token",
        f"  client CPU         {report['client_cpu_s']:.2f} s  = {f(report['client_cpu_us_per_token'])} us/token  "
        f"({report['client_cpu_util'] * 100:.0f}% of a core)",
    ]
    profile = report.get("profile", {}).get("activities", {})
    per_token = report["servicer_cpu_us_per_token"]
    for name, share in profile.items():
        cost = f"  ~{share * per_token:.1f} us/token" if per_token else ""
        lines.append(f"  profile {share * 100:5.1f}%  {name}{cost}")
    m = report.get("machine_cpu")
    if m:
        lines.append(
            f"  machine CPU        busy {m['busy_s']:.2f} of {m['capacity_s']:.2f} s; softirq {m['softirq_s']:.2f} s, "
            f"steal {m['steal_s']:.2f} s, other processes {m['others_s']:.2f} s"
        )
    return "\n".join(lines)


# -- the command --------------------------------------------------------------------------


class BenchError(Exception):
    """The bench could not measure: a servicer or client process failed (exit status 1)."""


class OptionError(BenchError):
    """The options cannot work together (exit status 2)."""


def check_options(args: argparse.Namespace) -> None:
    if args.concurrency is None:
        args.concurrency = [128]
    for name in ("concurrency", "client"):
        if isinstance(getattr(args, name), list):
            if len(getattr(args, name)) != 1:
                raise OptionError(f"several --{name} values go with --engine vllm")
            setattr(args, name, getattr(args, name)[0])
    for name in ("concurrency", "max_tokens", "prompt_tokens", "client_procs", "channels"):
        if getattr(args, name) < 1:
            raise OptionError(f"--{name.replace('_', '-')} must be >= 1")
    if args.requests is not None and args.requests < 1:
        raise OptionError("--requests must be >= 1")
    if getattr(args, "warm_s", None) is not None and (args.warm_s < 0 or args.requests is not None):
        raise OptionError("--warm-s takes seconds >= 0 and a --duration-s window, not --requests")
    if args.duration_s is not None and args.duration_s <= 0:
        raise OptionError("--duration-s must be > 0")
    if args.servicer_pid is not None and args.target is None:
        raise OptionError("--servicer-pid goes with --target")
    if args.client == "h2" and args.channels != 1:
        raise OptionError("--channels goes with --client grpcio (the h2 client uses one connection)")
    args.client_procs = min(args.client_procs, args.concurrency)


def measure(args: argparse.Namespace) -> dict:
    """Start (or reach) the servicer, run the load, stop what was started; the report."""
    check_options(args)
    with tempfile.TemporaryDirectory(prefix="enginelink-bench-") as tmp_name:
        tmp = Path(tmp_name)
        servicer = None
        try:
            if args.target is None:
                servicer = Servicer(args, tmp)
                servicer.start()
                return run_load(args, servicer.target, servicer.process.pid, servicer.metrics_port)
            wait_serving(args.target, SERVING_TIMEOUT_S, wire=args.wire)
            return run_load(args, args.target, args.servicer_pid)
        except (RuntimeError, TimeoutError) as error:
            message = str(error)
            if servicer is not None and servicer.process is not None and servicer.process.poll() is not None:
                message += f"\nservicer exited with status {servicer.process.returncode}; its log ends:\n{servicer.log()}"
            raise BenchError(message) from None
        finally:
            if servicer is not None:
                servicer.stop()


def run(args: argparse.Namespace) -> int:
    """The command. A SIGTERM ends it as Ctrl-C does: every servicer and engine it started is stopped
    (each arm's ``finally``), where the default action left them running, orphaned."""
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _run(args: argparse.Namespace) -> int:
    engine = getattr(args, "engine", "sim")
    if getattr(args, "soak", None) is not None:
        if engine != "sim" or args.against or args.target is not None or getattr(args, "wire", "vllm") != "vllm" \
                or getattr(args, "latency_plot", None) is not None:
            print("enginelink bench: --soak runs its own servicer on the sim engine (no --engine, --against, "
                  "--target, --wire or --latency-plot; --plot draws its curves)", file=sys.stderr)
            return 2
        from enginelink.tools import bench_soak

        return bench_soak.run(args)
    if getattr(args, "plot", None) is not None:
        from enginelink.tools.bench_plot import PlotError, check

        try:
            check(args.plot)  # before the run, not after an hour of it
        except PlotError as error:
            print(f"enginelink bench: {error}", file=sys.stderr)
            return 2
    latency_plot = getattr(args, "latency_plot", None)
    if latency_plot is not None:  # checked before the run too (tools/bench_svg.py draws it: no matplotlib)
        if not (args.against or engine == "vllm"):
            print("enginelink bench: --latency-plot draws arms side by side: it goes with --against or --engine vllm",
                  file=sys.stderr)
            return 2
        if latency_plot.suffix.lower() != ".svg" or not latency_plot.resolve().parent.is_dir():
            print(f"enginelink bench: --latency-plot {latency_plot}: an SVG file (FILE.svg) in a directory that exists",
                  file=sys.stderr)
            return 2
    if getattr(args, "wire", "vllm") != "vllm" and (engine != "sim" or args.against):
        print("enginelink bench: --wire goes with the sim engine (no --engine vllm/mlx, no --against)", file=sys.stderr)
        return 2
    if args.concurrency is None:
        # MLX's batch is 32 sequences by default (mlx_lm.server's): measured under and at it.
        args.concurrency = [8, 32] if engine == "mlx" else [128]
    if engine in ("vllm", "mlx"):
        from enginelink.tools import bench_engine, bench_mlx
        from enginelink.tools.bench_refs import FLOOR

        if FLOOR in args.against:
            print(f"enginelink bench: {FLOOR} has no engine behind it; it goes with the sim engine (no --engine)",
                  file=sys.stderr)
            return 2

        if args.target is not None or any(c < 1 for c in args.concurrency) or args.rounds < 1:
            print(f"enginelink bench: --engine {engine} needs --concurrency >= 1, --rounds >= 1 and no --target",
                  file=sys.stderr)
            return 2
        try:
            return bench_engine.run(args) if engine == "vllm" else bench_mlx.run(args)
        except (RuntimeError, TimeoutError) as error:
            print(f"enginelink bench: {error}", file=sys.stderr)
            return 1
    if args.against:
        from enginelink.tools import bench_refs

        if args.target is not None or args.rounds < 1 or any(c < 1 for c in args.concurrency) or len(args.client) != 1:
            print("enginelink bench: --against needs --rounds >= 1, --concurrency >= 1, one --client and no --target",
                  file=sys.stderr)
            return 2
        try:
            return bench_refs.run_sim(args)
        except (RuntimeError, TimeoutError) as error:
            print(f"enginelink bench: {error}", file=sys.stderr)
            return 1
    try:
        report = measure(args)
    except BenchError as error:
        print(f"enginelink bench: {error}", file=sys.stderr)
        return 2 if isinstance(error, OptionError) else 1
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    from enginelink.tools.bench_plot import maybe_write

    maybe_write(args, report)
    # Failed or short calls make the figures suspect: say so in the exit status.
    return 0 if report["errors"] == 0 and report["short"] == 0 else 1
