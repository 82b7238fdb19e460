"""``enginelink bench --soak DURATION``: a long run under churn that must stay flat.

Theory of operation. The soak plays a supervisor: it starts ``enginelink serve``
on the sim engine at a real engine's pace (``--step-us 20000`` unless
``--engine-args`` says otherwise), KV events and /metrics on, its own journal;
halfway through it kills the engine (SIGKILL), the servicer exits 1 as its
contract says, and the soak starts it again on the same port and journal, as a
supervisor would. One client process (``bench_soak_client.py``, grpc.aio)
keeps ``--concurrency`` calls open the whole time, with churn: greedy, seeded,
``n > 1``, stop strings, EOS, logprobs, structured outputs, cancels mid-stream,
Abort RPCs, bad requests, connections dropped with calls open, KV-event
subscribers that come and go and one that reads slowly; it checks every stream
against the sim engine's deterministic answer (``machines.sim_core.expected_tokens``).

Every ``--soak-sample-s`` the soak samples the servicer: RSS, open fds,
threads (``/proc``), trio and asyncio tasks and the journal's last seq
(``/metrics``), the journal's files on disk. It prints each sample, then per
servicer run the least-squares slope of each over the samples after the first
``--soak-warmup-s`` of that run and after what fills by design has filled
(``judged_from``), and judges the growth over that window
against a bound (``BOUNDS``). At the end the servicer is drained (exit 0) and
``enginelink journal verify`` must pass on both runs' journals.

Exit status: 0 when everything held, 1 when a bound, a stream check, a verify
or the supervisor's expectations failed (each printed).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from enginelink.tools.bench_load import bench_model_dir, free_port, proc_children, wait_serving
from enginelink.tools.bench_soak_client import client_main

SOAK_CONCURRENCY = 256
STEP_US = 20000  # a real engine's decode pace (docs/benchmarks-history.md, stop 22)
SAMPLE_S = 60.0
WARMUP_S = 300.0
SERVING_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Bound:
    """Growth allowed over a judged window of ``hours``: ``absolute + per_hour * hours``, plus
    ``relative`` of the window's mean (for what swings with the load, like tasks)."""

    absolute: float
    per_hour: float = 0.0
    relative: float = 0.0

    def allowed(self, hours: float, mean: float) -> float:
        return self.absolute + self.per_hour * hours + self.relative * abs(mean)


# What "flat" means. RSS: bounded structures fill first (the journal's ring, the KV history, the
# fold's ended requests; judged from when they are full: ``judged_from``), then the allocator's noise
# is a few MiB; a leak of a few dozen bytes per call (hundreds of calls a second) is tens of MiB an hour. fds and threads: exact but for transient
# sockets. Tasks: one per open call, so they swing with the load.
BOUNDS: dict[str, Bound] = {
    "rss_mib": Bound(24.0, per_hour=16.0),
    "fds": Bound(8.0),
    "threads": Bound(2.0),
    "trio_tasks": Bound(16.0, relative=0.15),
    "asyncio_tasks": Bound(32.0, relative=0.15),
    # Journal records per call that ended (choices and refusals): what a leak of records per call shows
    # as; records a second swing with whatever else the box runs (a short window on a shared box once
    # judged a 30% rise of the load as growth), so they are printed, not judged.
    "records_per_call": Bound(0.0, relative=0.30),
}
# Printed with a slope but judged otherwise: the journal's files grow to its store budget
# (journal/store.py, 1 GiB by default) and stay there; its records a second follow the load.
UNJUDGED = ("journal_mib", "records_per_s")
# The WAL (cut back to 4 MiB after a checkpoint) and a flush or two over the store's budget, which
# counts what the blocks take in the file (journal/store.py stored_bytes); 128 MiB before that did.
JOURNAL_SLACK_MIB = 32.0


def parse_duration(text: str) -> float:
    """``3600``, ``3600s``, ``90m``, ``1h``, ``1h30m`` → seconds."""
    text = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise argparse.ArgumentTypeError(f"expected a duration like 3600, 90s, 2m or 1h; got {text!r}")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


# -- the servicer, supervised ------------------------------------------------------------


class Supervised:
    """``enginelink serve`` on a fixed port, metrics port and journal; started again after it exits."""

    def __init__(self, tmp: Path, model_dir: Path, engine_args: list[str]) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        self.journal = tmp / "journal.sqlite"
        self.log_path = tmp / "servicer.log"
        self.argv = [sys.executable, "-m", "enginelink.tools.cli", "serve", "--port", str(self.port),
                     "--metrics-port", str(self.metrics_port), "--journal", str(self.journal),
                     "--log-level", "WARNING", "--model", str(model_dir), "--", *engine_args]
        self.process: subprocess.Popen | None = None
        self.runs = 0
        self._log = open(self.log_path, "ab")

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> float:
        """Start it and wait for SERVING; the time it started serving (time.monotonic)."""
        self.process = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT)
        self.runs += 1
        wait_serving(self.target, SERVING_TIMEOUT_S, self.process)
        return time.monotonic()

    def engine_pid(self) -> int | None:
        children = proc_children(self.process.pid) if self.process else []
        return children[0] if children else None

    def stop(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def close(self) -> None:
        self.stop()
        self._log.close()

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


# -- sampling --------------------------------------------------------------------------


def scrape(metrics_port: int) -> dict[str, float]:
    """The servicer's /metrics as {name: value}, label sets summed (our families have one each)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


def _count(path: str) -> int:
    try:
        return len(os.listdir(path))
    except OSError:
        return 0


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def journal_mib(journal: Path) -> float:
    total = 0
    for suffix in ("", "-wal"):
        try:
            total += os.stat(f"{journal}{suffix}").st_size
        except OSError:
            pass
    return total / 2**20


def take_sample(sv: Supervised, t0: float) -> dict:
    pid = sv.process.pid
    sample = {"t_s": time.monotonic() - t0, "run": sv.runs, "rss_mib": _rss_mib(pid),
              "fds": _count(f"/proc/{pid}/fd"), "threads": _count(f"/proc/{pid}/task"),
              "journal_mib": journal_mib(sv.journal)}
    try:
        m = scrape(sv.metrics_port)
    except OSError:
        m = {}
    sample["full"] = bounded_structures_full(m)
    sample["trio_tasks"] = m.get("smg_servicer_tasks_trio")
    sample["asyncio_tasks"] = m.get("smg_servicer_tasks_asyncio")
    sample["journal_seq"] = m.get("smg_servicer_journal_last_seq")
    sample["calls_ended"] = (m["smg_servicer_requests_total"] + m.get("smg_servicer_refusals_total", 0.0)
                             if "smg_servicer_requests_total" in m else None)
    sample["in_flight"] = m.get("smg_servicer_in_flight_requests")
    return sample


def bounded_structures_full(m: dict[str, float]) -> bool | None:
    """Whether what fills by design has filled (so memory should be flat from here): the journal's
    ring prunes, and the KV history is at its cap (when KV events are on): 10,000 batches, one per
    engine step that stored or evicted blocks, about 5 a second at the soak's churn, so about half an
    hour. None when /metrics did not answer. (The retired engine ids are bounded too, but
    only aborted calls' ids stay there: a few hundred an hour, a few MiB at their cap.)"""
    if not m:
        return None
    full = m.get("smg_servicer_journal_pruned", 0) > 0
    if "smg_servicer_kv_history_batches_max" in m:
        full = full and (m.get("smg_servicer_kv_history_batches", 0) >= m["smg_servicer_kv_history_batches_max"]
                         or m.get("smg_servicer_kv_history_bytes", 0) >= m.get("smg_servicer_kv_history_bytes_max", 1))
    return full


def judged_from(samples: list[dict], run: int, start: float, warmup_s: float) -> float:
    """Where a run's judged window starts: after the warm-up, and after its bounded structures filled
    when they did within the run (else after the warm-up alone: judged, and said to be still filling)."""
    filled = next((s["t_s"] for s in samples if s["run"] == run and s.get("full")), None)
    return max(start + warmup_s, filled if filled is not None else 0.0)


def add_rates(samples: list[dict]) -> None:
    """``records_per_s`` and ``records_per_call``: the journal's appends between a sample and the one
    before it (same run), a second and per call that ended in between."""
    for before, after in zip(samples, samples[1:]):
        if before["run"] == after["run"] and before["journal_seq"] is not None and after["journal_seq"] is not None:
            appended = after["journal_seq"] - before["journal_seq"]
            after["records_per_s"] = appended / (after["t_s"] - before["t_s"])
            if before.get("calls_ended") is not None and after.get("calls_ended") is not None:
                ended = after["calls_ended"] - before["calls_ended"]
                after["records_per_call"] = appended / ended if ended > 0 else None
    for s in samples:
        s.setdefault("records_per_s", None)
        s.setdefault("records_per_call", None)


def slope_per_hour(ts: list[float], vs: list[float]) -> float | None:
    if len(ts) < 3:
        return None
    mt, mv = statistics.fmean(ts), statistics.fmean(vs)
    den = sum((t - mt) ** 2 for t in ts)
    return None if den == 0 else sum((t - mt) * (v - mv) for t, v in zip(ts, vs)) / den * 3600


def judge(samples: list[dict], starts: dict[int, float], warmup_s: float) -> tuple[list[dict], list[str]]:
    """Per run, per quantity: its slope after the warm-up and whether the growth is within bounds."""
    rows, failures = [], []
    for run, start in sorted(starts.items()):
        since = judged_from(samples, run, start, warmup_s)
        judged = [s for s in samples if s["run"] == run and s["t_s"] >= since and not s.get("after")]
        for name in (*BOUNDS, *UNJUDGED):
            points = [(s["t_s"], s[name]) for s in judged if s.get(name) is not None]
            ts, vs = [p[0] for p in points], [p[1] for p in points]
            slope = slope_per_hour(ts, vs)
            row = {"run": run, "quantity": name, "samples": len(points), "slope_per_hour": slope, "since_s": since,
                   "filled": any(s.get("full") for s in samples if s["run"] == run),
                   "mean": statistics.fmean(vs) if vs else None, "first": vs[0] if vs else None,
                   "last": vs[-1] if vs else None}
            if slope is not None and name in BOUNDS:
                hours = (ts[-1] - ts[0]) / 3600
                row["growth"] = slope * hours
                row["allowed"] = BOUNDS[name].allowed(hours, row["mean"])
                row["ok"] = row["growth"] <= row["allowed"]
                if not row["ok"]:
                    failures.append(f"run {run}: {name} grew {row['growth']:.2f} over {hours * 60:.1f} min "
                                    f"(slope {slope:.2f}/h), allowed {row['allowed']:.2f}")
            rows.append(row)
    return rows, failures


# -- the run -----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    duration_s = args.soak
    warmup_s = args.soak_warmup_s if args.soak_warmup_s is not None else min(WARMUP_S, duration_s / 4)
    sample_s = args.soak_sample_s if args.soak_sample_s is not None else min(SAMPLE_S, max(1.0, duration_s / 24))
    concurrency = args.concurrency[0] if isinstance(args.concurrency, list) else (args.concurrency or SOAK_CONCURRENCY)
    engine_args = shlex.split(args.engine_args_text) + list(args.engine_args)
    if not any(a.split("=", 1)[0] == "--step-us" for a in engine_args):
        engine_args += ["--step-us", str(STEP_US)]
    if not any(a.split("=", 1)[0] == "--max-num-seqs" for a in engine_args):
        engine_args += ["--max-num-seqs", str(4 * concurrency)]  # every choice of n > 1 runs too
    model_dir = Path(args.model) if args.model else bench_model_dir()
    config = json.loads((model_dir / "config.json").read_text())
    eos = config.get("eos_token_id")
    plan = {"seed": args.soak_seed, "vocab_size": int(config["vocab_size"]),
            "eos_token_id": eos[0] if isinstance(eos, list) else eos, "concurrency": concurrency}
    print(f"enginelink bench --soak {duration_s:g} s: concurrency {concurrency}, engine {' '.join(engine_args)}, "
          f"a sample every {sample_s:g} s, judged after {warmup_s:g} s of each servicer run; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    failures: list[str] = []
    samples: list[dict] = []
    starts: dict[int, float] = {}
    events: list[tuple[float, str]] = []
    with tempfile.TemporaryDirectory(prefix="enginelink-soak-") as tmp_name:
        tmp = Path(tmp_name)
        sv = Supervised(tmp, model_dir, engine_args)
        client = conn = None
        try:
            t0 = time.monotonic()
            starts[1] = sv.start() - t0
            from enginelink.tools.bench_load import server_facts

            plan.update(target=sv.target, max_context_length=server_facts(sv.target)["max_context_length"])
            ctx = multiprocessing.get_context("spawn")
            conn, child = ctx.Pipe()
            client = ctx.Process(target=client_main, args=(child, plan), daemon=False)
            client.start()
            child.close()
            if not conn.poll(120):
                raise RuntimeError("the soak's client did not start")
            conn.recv()
            t0 = time.monotonic()
            starts = {1: 0.0}
            conn.send(("go", t0 + duration_s))
            restart_at, restarted = duration_s / 2, False
            next_sample = 0.0
            result = None
            while result is None:
                now = time.monotonic() - t0
                if sv.process.poll() is not None:
                    code = sv.process.returncode
                    events.append((now, f"servicer exited {code}"))
                    if not restarted or code != 1:
                        raise RuntimeError(f"the servicer exited with status {code} unasked; its log ends:\n"
                                           f"{sv.log_tail()}")
                    if sv.runs > 2:
                        raise RuntimeError("the servicer exited again after its restart")
                    started = sv.start() - t0
                    starts[sv.runs] = started
                    events.append((starts[sv.runs], "servicer serving again"))
                    print(f"  {starts[sv.runs]:7.1f} s  the servicer exited {code} and is serving again "
                          f"({starts[sv.runs] - now:.1f} s after)", flush=True)
                    continue
                if now >= next_sample:
                    s = take_sample(sv, t0)
                    if s["t_s"] >= duration_s or (restarted and sv.runs == 1):
                        s["after"] = True  # the load winding down, or the engine killed: shown, not judged
                    samples.append(s)
                    print(f"  {s['t_s']:7.1f} s  run {s['run']}  RSS {s['rss_mib']:6.1f} MiB  fds {s['fds']:4d}  "
                          f"threads {s['threads']:3d}  tasks trio {_n(s['trio_tasks'])} asyncio "
                          f"{_n(s['asyncio_tasks'])}  journal {s['journal_mib']:7.1f} MiB seq "
                          f"{_n(s['journal_seq'])}  in flight {_n(s['in_flight'])}", flush=True)
                    next_sample += sample_s
                if not restarted and now >= restart_at:
                    engine = sv.engine_pid()
                    if engine is None:
                        raise RuntimeError("no engine process under the servicer to kill")
                    os.kill(engine, signal.SIGKILL)
                    restarted = True
                    events.append((now, "engine killed"))
                    print(f"  {now:7.1f} s  killed the engine (pid {engine}): the servicer must exit 1", flush=True)
                if conn.poll(0.25):
                    message, payload = conn.recv()
                    if message == "error":
                        raise RuntimeError(f"the soak's client failed:\n{payload}")
                    result = payload
                elif not client.is_alive():
                    raise RuntimeError("the soak's client died")
            samples.append({**take_sample(sv, t0), "after": True})  # the load is over: shown, not judged
            if not restarted:
                failures.append("the engine was never restarted (the run ended first)")
            code = sv.stop()
            if code != 0:
                failures.append(f"the servicer's drain exited {code}, not 0")
            failures += _verify(sv.journal, previous=sv.runs - 1)
        except (RuntimeError, TimeoutError) as error:
            print(f"enginelink bench --soak: {error}", file=sys.stderr)
            return 1
        finally:
            if client is not None:
                client.join(timeout=30)
                if client.is_alive():
                    client.kill()
            sv.close()
    add_rates(samples)
    rows, bound_failures = judge(samples, starts, warmup_s)
    failures += bound_failures
    failures += _client_failures(result)
    for row in rows:
        if row["quantity"] == "journal_mib" and row["last"] is not None:
            from enginelink.journal.store import STORE_BYTES_MAX

            if row["last"] > STORE_BYTES_MAX / 2**20 + JOURNAL_SLACK_MIB:
                failures.append(f"run {row['run']}: the journal's files are {row['last']:.0f} MiB, over the store's "
                                f"budget ({STORE_BYTES_MAX / 2**20:.0f} MiB) and {JOURNAL_SLACK_MIB:.0f} MiB of slack")
    report = {"duration_s": duration_s, "concurrency": concurrency, "engine_args": engine_args, "warmup_s": warmup_s,
              "sample_s": sample_s, "samples": samples, "starts": starts, "events": events, "slopes": rows,
              "client": result, "failures": failures, "loadavg": os.getloadavg()}
    print(format_report(report))
    if getattr(args, "json_out", None):
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(report, args.plot)
    return 1 if failures else 0


def _n(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def _verify(journal: Path, previous: int) -> list[str]:
    out = []
    for k in range(previous + 1):
        argv = [sys.executable, "-m", "enginelink.tools.cli", "journal", "verify", "--journal", str(journal)]
        if k:
            argv += ["--previous", str(k)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
        label = "the last run's journal" if k == 0 else f"the journal of the run before (--previous {k})"
        print(f"  journal verify, {label}: exit {done.returncode}; {done.stdout.strip().splitlines()[-1:] or ''}",
              flush=True)
        if done.returncode != 0:
            out.append(f"journal verify failed on {label}:\n{(done.stdout + done.stderr)[-2000:]}")
    return out


def _client_failures(result: dict | None) -> list[str]:
    if result is None:
        return ["no report from the client"]
    out = [f"stream check: {v}" for v in result["violations"]]
    if result["violation_count"] > len(result["violations"]):
        out.append(f"... {result['violation_count'] - len(result['violations'])} more stream check failures")
    ok = sum(per.get("OK", 0) for per in result["calls"].values())
    if not ok:
        out.append("no call ended OK")
    if not result["kv_batches"] and not result["slow_reader_batches"]:
        out.append("no KV-event batch reached a subscriber")
    return out


def format_report(report: dict) -> str:
    c = report["client"] or {}
    lines = ["", "calls by kind (status: count):"]
    for kind, per in sorted(c.get("calls", {}).items()):
        lines.append(f"  {kind:11s} " + ", ".join(f"{code} {n}" for code, n in sorted(per.items())))
    lines.append(f"streams checked against the sim engine's answer: {c.get('choices_checked', 0)} choices, "
                 f"{c.get('tokens_checked', 0)} tokens; violations {c.get('violation_count', 0)}")
    lines.append(f"connections dropped with calls open {c.get('disconnects', 0)}; KV subscriptions "
                 f"{c.get('kv_subscriptions', 0)} ({c.get('kv_batches', 0)} batches), the slow reader "
                 f"{c.get('slow_reader_batches', 0)} batches, {c.get('slow_reader_restarts', 0)} restarts")
    lines.append(f"\nslopes after the first {report['warmup_s']:g} s of each servicer run, and after what fills by "
                 "design (the journal's ring, the KV history) filled (least squares over "
                 "the samples; growth = slope x the judged window):")
    for run in sorted({row["run"] for row in report["slopes"]}):
        row = next(r for r in report["slopes"] if r["run"] == run)
        lines.append(f"  run {run}: judged from {row['since_s']:.0f} s"
                     + ("" if row["filled"] else " (its bounded structures were still filling at its end)"))
    lines.append(f"  {'run':>3s}  {'quantity':16s} {'samples':>7s} {'first':>10s} {'last':>10s} "
                 f"{'slope / hour':>13s} {'growth':>9s} {'allowed':>9s}")
    for row in report["slopes"]:
        def f(v, spec=".2f"):
            return "-" if v is None else format(v, spec)

        verdict = "" if "ok" not in row else ("ok" if row["ok"] else "OVER")
        lines.append(f"  {row['run']:3d}  {row['quantity']:16s} {row['samples']:7d} {f(row['first']):>10s} "
                     f"{f(row['last']):>10s} {f(row['slope_per_hour']):>13s} {f(row.get('growth')):>9s} "
                     f"{f(row.get('allowed')):>9s} {verdict}")
    lines.append(f"load average at the end: {' '.join(f'{x:.2f}' for x in report['loadavg'])}")
    if report["failures"]:
        lines.append("\nFAILED:")
        lines += [f"  - {f}" for f in report["failures"]]
    else:
        lines.append("\nflat: every bound held, every stream matched, both journals verify")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    from enginelink.tools.bench_svg import LinePanel, write

    samples = report["samples"]
    minutes = [s["t_s"] / 60 for s in samples]
    marks = [(t / 60, label) for t, label in report["events"] if label in ("engine killed",)]
    panels = []
    for name, title, unit in (("rss_mib", "servicer RSS", "MiB"), ("fds", "open fds", "fds"),
                              ("threads", "threads", "threads"), ("trio_tasks", "tasks", "tasks"),
                              ("journal_mib", "journal files", "MiB"),
                              ("records_per_call", "journal records a call", "records/call")):
        series = []
        keys = (("trio_tasks", "trio"), ("asyncio_tasks", "asyncio")) if name == "trio_tasks" else ((name, title),)
        for key, label in keys:
            pts = [(m, s[key]) for m, s in zip(minutes, samples) if s.get(key) is not None]
            series.append((label, [p[0] for p in pts], [p[1] for p in pts]))
        panels.append(LinePanel(title, "minutes", unit, series, marks))
    write(path, panels, f"enginelink bench --soak {report['duration_s'] / 60:g} min, c={report['concurrency']}",
          columns=3, note="sim engine " + " ".join(report["engine_args"]) + "; dashed: the engine killed, "
          "the servicer exits 1 and is started again on the same journal")
