"""``enginelink bench --soak DURATION``: a long run under churn that must stay flat.

Theory of operation. The soak plays a supervisor: it starts ``enginelink serve``
on the sim engine at a real engine's pace (``--step-us 20000`` unless
``--engine-args`` says otherwise), KV events and /metrics on, its own journal;
halfway through it kills the engine (SIGKILL), the servicer exits 1 as its
contract says, and the soak starts it again on the same port and journal, as a
supervisor would. One client process (grpc.aio) keeps ``--concurrency`` calls
open the whole time, with churn: greedy, seeded, ``n > 1``, stop strings, EOS,
logprobs, structured outputs, cancels mid-stream, Abort RPCs, bad requests,
connections dropped with calls open, KV-event subscribers that come and go and
one that reads slowly.

Every stream is checked against the sim engine's deterministic answer
(``machines.sim_core.expected_tokens``: a function of the prompt and seed):
what each choice received must be exactly the start of that answer (a lost or
doubled token breaks it), a ``length`` finish must carry ``max_tokens``, a call
that needs no stop must end ``length``; a bad request must be refused with
INVALID_ARGUMENT; INTERNAL never.

Every ``--soak-sample-s`` the soak samples the servicer: RSS, open fds,
threads (``/proc``), trio and asyncio tasks and the journal's last seq
(``/metrics``), the journal's files on disk. It prints each sample, then per
servicer run the least-squares slope of each over the samples after the first
``--soak-warmup-s`` of that run, and judges the growth over that window
against a bound (``BOUNDS``). At the end the servicer is drained (exit 0) and
``enginelink journal verify`` must pass on both runs' journals.

Exit status: 0 when everything held, 1 when a bound, a stream check, a verify
or the supervisor's expectations failed (each printed).
"""

from __future__ import annotations

import argparse
import json
import math
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
import traceback
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from enginelink.tools.bench_load import bench_model_dir, free_port, proc_children, wait_serving

SOAK_CONCURRENCY = 256
STEP_US = 20000  # a real engine's decode pace (docs/benchmarks.md, stop 22)
SAMPLE_S = 60.0
WARMUP_S = 300.0
SERVING_TIMEOUT_S = 120.0
STOP_STRINGS = ("e", "a", " t", "o")


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
    "records_per_s": Bound(0.0, relative=0.30),
}
# Printed with a slope but judged otherwise: the journal's files grow to its store budget
# (journal/store.py, 1 GiB by default) and stay there.
UNJUDGED = ("journal_mib",)
JOURNAL_SLACK_MIB = 128.0  # the WAL and one block over the store's budget


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
    """``records_per_s``: the journal's appends between a sample and the one before it, same run."""
    for before, after in zip(samples, samples[1:]):
        if before["run"] == after["run"] and before["journal_seq"] is not None and after["journal_seq"] is not None:
            after["records_per_s"] = (after["journal_seq"] - before["journal_seq"]) / (after["t_s"] - before["t_s"])
    for s in samples:
        s.setdefault("records_per_s", None)


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


# -- the client --------------------------------------------------------------------------


def _client_main(conn, plan: dict) -> None:
    try:
        import asyncio

        conn.send(("done", asyncio.run(_client(conn, plan))))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


@dataclass
class ClientStats:
    calls: dict = field(default_factory=dict)  # kind -> {code or "OK": n}
    tokens_checked: int = 0
    choices_checked: int = 0
    violations: list = field(default_factory=list)
    violation_count: int = 0
    disconnects: int = 0
    kv_subscriptions: int = 0
    kv_batches: int = 0
    slow_reader_batches: int = 0
    slow_reader_restarts: int = 0

    def count(self, kind: str, code: str) -> None:
        per = self.calls.setdefault(kind, {})
        per[code] = per.get(code, 0) + 1

    def violation(self, text: str) -> None:
        self.violation_count += 1
        if len(self.violations) < 50:
            self.violations.append(text)


# Call kinds and their weights in the mix; "bad" ones must be refused with INVALID_ARGUMENT.
KINDS = {"greedy": 40, "seeded": 10, "n": 8, "stop": 8, "eos": 6, "logprobs": 7, "structured": 5,
         "cancel": 6, "abort": 4, "bad": 6}
BAD = ("empty prompt", "top_p 2", "temperature -1", "over the context")


async def _client(conn, plan: dict) -> dict:
    import asyncio
    import random

    import grpc
    from smg_grpc_proto.generated import common_pb2
    from smg_grpc_proto.generated import vllm_engine_pb2 as pb
    from smg_grpc_proto.generated.vllm_engine_pb2_grpc import VllmEngineStub

    from enginelink.machines.sim_core import expected_tokens

    rng = random.Random(plan["seed"])
    vocab, eos, context = plan["vocab_size"], plan["eos_token_id"], plan["max_context_length"]
    options = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
               ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.use_local_subchannel_pool", 1)]
    channel = grpc.aio.insecure_channel(plan["target"], options=options)
    stub = VllmEngineStub(channel)
    stats = ClientStats()
    # A pool of prompts, so prefixes repeat (the prefix cache and its KV events have work).
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.choice((8, 16, 24, 40)))] for _ in range(64)]
    names = list(KINDS)
    weights = [KINDS[k] for k in names]
    counter = [0]
    conn.send(("ready", None))
    message, stop_at = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
    assert message == "go", message

    def request(kind: str) -> tuple[pb.GenerateRequest, dict]:
        counter[0] += 1
        rid = f"soak-{counter[0]}"
        prompt = rng.choice(prompts)
        max_tokens = rng.randint(8, 48)
        sp = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        seed = None
        if kind in ("seeded", "n"):
            seed = rng.randrange(1 << 30)
            sp.update(temperature=0.8, seed=seed)
        if kind == "n":
            sp["n"] = rng.choice((2, 3))
        elif kind == "stop":
            sp["stop"] = [rng.choice(STOP_STRINGS)]
        elif kind == "eos":
            sp["ignore_eos"] = False
        elif kind == "logprobs":
            sp["logprobs"] = 2
        elif kind == "structured":
            sp["json_object"] = True
        bad = None
        if kind == "bad":
            bad = rng.choice(BAD)
            if bad == "empty prompt":
                prompt = []
            elif bad == "top_p 2":
                sp["top_p"] = 2.0
            elif bad == "temperature -1":
                sp["temperature"] = -1.0
            else:
                sp["max_tokens"] = context
        req = pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=prompt),
                                 sampling_params=pb.SamplingParams(**sp), stream=True)
        return req, {"rid": rid, "prompt": prompt, "seed": seed, "max_tokens": sp["max_tokens"], "n": sp.get("n", 1),
                     "bad": bad}

    def check(kind: str, meta: dict, got: dict[int, list[int]], finish: dict[int, str], code: str) -> None:
        rid = meta["rid"]
        if code == "INTERNAL":
            stats.violation(f"{kind} {rid}: INTERNAL")
        if kind == "bad":
            # UNAVAILABLE: the servicer was restarting (no servicer to refuse it).
            if code not in ("INVALID_ARGUMENT", "UNAVAILABLE"):
                stats.violation(f"bad request ({meta['bad']}) {rid}: {code}, not INVALID_ARGUMENT")
            return
        for index, tokens in got.items():
            if index >= meta["n"]:
                stats.violation(f"{kind} {rid}: choice {index} of n={meta['n']}")
                continue
            seed = None if meta["seed"] is None else meta["seed"] + index
            want = expected_tokens(meta["prompt"], len(tokens), vocab_size=vocab, eos_token_id=eos, seed=seed)
            stats.tokens_checked += len(tokens)
            stats.choices_checked += 1
            if tokens != want:
                at = next(i for i, (a, b) in enumerate(zip(tokens, want)) if a != b)
                stats.violation(f"{kind} {rid} choice {index}: token {at} is {tokens[at]}, the engine's is "
                                f"{want[at]} ({len(tokens)} received)")
        if code != "OK":
            return
        for index in range(meta["n"]):
            reason, tokens = finish.get(index), got.get(index, [])
            if reason is None:
                stats.violation(f"{kind} {rid} choice {index}: OK without a complete")
            elif reason == "length" and len(tokens) != meta["max_tokens"]:
                stats.violation(f"{kind} {rid} choice {index}: length with {len(tokens)} of {meta['max_tokens']} tokens")
            elif kind in ("greedy", "seeded", "n", "logprobs", "structured") and reason != "length":
                stats.violation(f"{kind} {rid} choice {index}: finish {reason!r}, expected length")
            elif kind == "eos" and reason == "stop" and (not tokens or tokens[-1] != eos):
                stats.violation(f"{kind} {rid} choice {index}: stop without the EOS id last")

    async def one(kind: str, the_stub=None) -> str:
        req, meta = request(kind)
        call = (the_stub or stub).Generate(req)
        got: dict[int, list[int]] = {}
        finish: dict[int, str] = {}
        cut_after = rng.randint(1, 6) if kind in ("cancel", "abort") else None
        chunks = 0
        code = "OK"
        try:
            async for response in call:
                which = response.WhichOneof("response")
                if which == "chunk":
                    got.setdefault(response.chunk.index, []).extend(response.chunk.token_ids)
                    chunks += 1
                    if cut_after is not None and chunks == cut_after:
                        cut_after = None
                        if kind == "cancel":
                            call.cancel()
                        else:
                            await stub.Abort(pb.AbortRequest(request_ids=[meta["rid"]]), timeout=10)
                elif which == "complete":
                    finish[response.complete.index] = response.complete.finish_reason
        except asyncio.CancelledError:
            if kind != "cancel":
                raise
            code = "CANCELLED"
        except grpc.aio.AioRpcError as error:
            code = error.code().name
        if kind == "abort" and code == "OK" and any(r != "abort" for r in finish.values()) and \
                all(len(got.get(i, [])) < meta["max_tokens"] for i in finish):
            stats.violation(f"abort {meta['rid']}: ended {finish} before max_tokens without 'abort'")
        check(kind, meta, got, finish, code)
        stats.count(kind, code)
        return code

    async def worker() -> None:
        while time.monotonic() < stop_at:
            kind = rng.choices(names, weights)[0]
            code = await one(kind)
            if code == "UNAVAILABLE":
                await asyncio.sleep(0.2 + rng.random() * 0.3)  # the servicer is restarting: as a router backs off

    async def disconnector() -> None:
        """A connection dropped with calls open, every few seconds."""
        while time.monotonic() < stop_at:
            await asyncio.sleep(3 + rng.random() * 4)
            extra = grpc.aio.insecure_channel(plan["target"], options=options)
            extra_stub = VllmEngineStub(extra)
            tasks = [asyncio.ensure_future(one("greedy", extra_stub)) for _ in range(rng.randint(2, 6))]
            await asyncio.sleep(0.2 + rng.random() * 0.8)
            await extra.close(grace=None)
            await asyncio.gather(*tasks, return_exceptions=True)
            stats.disconnects += 1

    async def kv_comer() -> None:
        """KV subscribers that come and go."""
        while time.monotonic() < stop_at:
            call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=0))
            stats.kv_subscriptions += 1
            deadline = time.monotonic() + 1 + rng.random() * 6
            try:
                async for _ in call:
                    stats.kv_batches += 1
                    if time.monotonic() > deadline:
                        call.cancel()
                        break
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                pass
            await asyncio.sleep(rng.random() * 3)

    async def kv_slow() -> None:
        """One subscriber that reads a batch a second for the whole run."""
        while time.monotonic() < stop_at:
            call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=0))
            try:
                async for _ in call:
                    stats.slow_reader_batches += 1
                    if time.monotonic() > stop_at:
                        call.cancel()
                        break
                    await asyncio.sleep(1.0)
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                pass
            stats.slow_reader_restarts += 1
            await asyncio.sleep(1.0)

    await asyncio.gather(*(worker() for _ in range(plan["concurrency"])), disconnector(), kv_comer(), kv_slow())
    await channel.close()
    return stats.__dict__


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
            client = ctx.Process(target=_client_main, args=(child, plan), daemon=False)
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
    lines.append(f"  {'run':>3s}  {'quantity':14s} {'samples':>7s} {'first':>10s} {'last':>10s} "
                 f"{'slope / hour':>13s} {'growth':>9s} {'allowed':>9s}")
    for row in report["slopes"]:
        def f(v, spec=".2f"):
            return "-" if v is None else format(v, spec)

        verdict = "" if "ok" not in row else ("ok" if row["ok"] else "OVER")
        lines.append(f"  {row['run']:3d}  {row['quantity']:14s} {row['samples']:7d} {f(row['first']):>10s} "
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
                              ("records_per_s", "journal records/s", "records/s")):
        series = []
        keys = (("trio_tasks", "trio"), ("asyncio_tasks", "asyncio")) if name == "trio_tasks" else ((name, title),)
        for key, label in keys:
            pts = [(m, s[key]) for m, s in zip(minutes, samples) if s.get(key) is not None]
            series.append((label, [p[0] for p in pts], [p[1] for p in pts]))
        panels.append(LinePanel(title, "minutes", unit, series, marks))
    write(path, panels, f"enginelink bench --soak {report['duration_s'] / 60:g} min, c={report['concurrency']}",
          columns=3, note="sim engine " + " ".join(report["engine_args"]) + "; dashed: the engine killed, "
          "the servicer exits 1 and is started again on the same journal")
