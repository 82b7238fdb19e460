"""``enginelink inspect``: a servicer's state, read from its journal file.

Works on a live servicer and on the journal a dead one left, with no
cooperation from the process: the file is opened read-only (SQLite WAL lets
a reader see every committed batch while the writer goes on), the state is
``fold`` (the same function the servicer's snapshots use) over the latest
snapshot and the records after it, and the rest comes from the file itself
(meta table, counts, sizes) and from ``/proc`` (is the pid still alive).

What the journal cannot show: the records the servicer appended since its
last flush (at most one flush interval, 50 ms, plus a batch being written).
So on a live servicer this view lags by up to that much; on a killed one it
is the state as of the last committed batch.

Also the home of the state rendering that ``enginelink journal replay``
prints, so the two tools show a state the same way.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from enginelink.journal.records import KIND_KV_BATCH, KIND_KV_INCARNATION, KIND_KV_LOST, KIND_TRANSITION
from enginelink.journal.fold import TERMINAL_REQUEST_STATES, FoldState, fold
from enginelink.journal.files import JOURNAL_KEEP_MAX, default_journal_path, previous_path, read_run_file
from enginelink.journal.journal import FLUSH_INTERVAL_S
from enginelink.journal.store import Reader, StoreError, open_reader
from enginelink.journal.store_health import read_health
from enginelink.machines.link import WARMUP_REQUEST_PREFIX
from enginelink.runtime.engine.placement import describe_placement, describe_priority
from enginelink.runtime.engine.socket_files import pid_alive

T = TypeVar("T")

DEFAULT_PORT = 50051
WATCH_DEFAULT_S = 2.0
# Facts worth a line in the human view (the JSON view has them all).
FACTS_SHOWN = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_gpu_blocks",
               "dtype", "vllm_version", "instance_id")
ENDED_SHOWN = 20
# How long before its run.start record a servicer process may have started
# (interpreter and imports), and the slack for clock granularity (/proc
# counts in clock ticks, boot time in whole seconds).
PROCESS_START_SLACK_S = 600.0
CLOCK_SLACK_S = 2.0


def add_journal_arguments(p: argparse.ArgumentParser) -> None:
    """``--journal PATH`` / ``--port N`` / ``--previous K``: which journal (shared with ``enginelink journal``)."""
    p.add_argument("--journal", type=Path, default=None,
                   help="journal file (default: the one the servicer on --port writes)")
    p.add_argument("--port", type=int, default=int(os.environ.get("ENGINELINK_PORT", DEFAULT_PORT)),
                   help=f"port of the servicer whose journal to read: the one its run file names "
                        f"(serve-<port>.json in the state dir, which --journal may have moved), else "
                        f"journal-<port>.sqlite (default {DEFAULT_PORT}; ENGINELINK_PORT)")
    p.add_argument("--previous", type=_run_count, default=0, metavar="K",
                   help="the K-th previous run's journal instead (1: the newest, kept as .prev; "
                        "ENGINELINK_JOURNAL_KEEP of them are kept)")


def _run_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of runs back, 0 or more")
    return value


def journal_path(args: argparse.Namespace) -> Path:
    """The journal the arguments name: --journal, else the one the servicer on --port records."""
    if args.journal is not None:
        path = args.journal
    else:
        recorded = read_run_file(args.port)
        path = Path(recorded["journal"]) if recorded else default_journal_path(args.port)
    previous = getattr(args, "previous", 0)
    return previous_path(path, previous) if previous else path


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_journal_arguments(p)
    p.add_argument("--watch", nargs="?", type=float, const=WATCH_DEFAULT_S, default=None, metavar="SECONDS",
                   help=f"refresh every SECONDS (default {WATCH_DEFAULT_S:g}) until interrupted")
    p.add_argument("--json", action="store_true", help="one JSON object (per refresh with --watch)")


def run(args: argparse.Namespace) -> int:
    path = journal_path(args)
    folder = JournalFolder(path)
    try:
        while True:
            try:
                view = folder.view() if args.watch is None else interruptible(folder.view)
            except (FileNotFoundError, StoreError) as error:
                print(f"enginelink inspect: {error}", file=sys.stderr)
                return 1
            if args.json:
                print(json.dumps(view, default=_json_default), flush=True)
            else:
                if args.watch is not None and sys.stdout.isatty():
                    sys.stdout.write("\x1b[H\x1b[2J")
                print(render_view(view), flush=True)
            if args.watch is None:
                return 0
            time.sleep(args.watch)
            if not args.json and not sys.stdout.isatty():
                print()
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `| head`
        quiet_stdout()
        return 0


def interruptible(call: Callable[[], T]) -> T:
    """``call()`` in a worker thread while this one waits, so Ctrl-C ends ``--watch`` at once.

    Python runs a signal's handler in the main thread between bytecodes: while
    the main thread is inside a SQLite call (a query over a large journal, or
    a busy wait of up to ``BUSY_TIMEOUT_MS`` while the writer checkpoints) a
    SIGINT waits for that call to return, seconds on a loaded machine. Waiting
    on an event instead is interrupted at once. The worker is a daemon thread
    so that exiting does not wait for the read it was doing (it only reads).
    """
    done = threading.Event()
    outcome: list[Any] = []

    def work() -> None:
        try:
            outcome.append((True, call()))
        except Exception as error:  # handed to the main thread, raised there
            outcome.append((False, error))
        finally:
            done.set()

    threading.Thread(target=work, name="inspect-read", daemon=True).start()
    done.wait()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def quiet_stdout() -> None:
    """After a broken pipe: send what is left to /dev/null, so exiting prints no second error."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


# -- reading -----------------------------------------------------------------------


class JournalFolder:
    """Folds one journal path, incrementally across refreshes.

    First call: the latest snapshot, then the records after it; later calls
    fold only the new records. Starts over when the path holds a different
    file (the servicer restarted and set the old one aside) or the store
    pruned records it had not folded yet.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.state: FoldState | None = None
        self.inode: int | None = None
        self.snapshot_seq = 0

    def view(self) -> dict[str, Any]:
        with open_reader(self.path) as reader:
            inode = os.stat(self.path).st_ino
            first = reader.first_seq()
            st = self.state
            if st is None or inode != self.inode or first > st.last_seq + 1 or reader.last_seq() < st.last_seq:
                snap = reader.last_snapshot()
                st = FoldState.from_snapshot(snap) if snap is not None else FoldState()
                self.snapshot_seq = 0 if snap is None else snap.seq
                self.inode = inode
            fold(reader.iter_records(after_seq=st.last_seq), st)
            self.state = st
            return describe(st, reader, self.path)


def describe(st: FoldState, reader: Reader, path: Path) -> dict[str, Any]:
    """The state as one JSON-able dict: run, journal, links, requests."""
    run = st.run
    # The servicer started before its run.start (imports); its engine after.
    wall0 = run.wall_time
    alive = run.stopped_at is None and pid_alive(
        run.pid, started_after=None if wall0 is None else wall0 - PROCESS_START_SLACK_S,
        started_before=None if wall0 is None else wall0 + CLOCK_SLACK_S)
    end_time = _last_time(reader)
    if alive and run.started_at is not None and run.wall_time is not None:
        now = run.started_at + (time.time() - run.wall_time)  # the servicer's trio clock, now
        as_of = "live"
    else:
        now = end_time
        as_of = "journal end"
    origin = run.started_at
    status = "stopped" if run.stopped_at is not None else "running" if alive else "dead"
    requests = []
    ended: dict[str, int] = {}
    warmup: dict[str, int] = {}
    for rid, v in st.requests.items():
        if rid.startswith(WARMUP_REQUEST_PREFIX):
            state = v.state or "admitted"
            warmup[state] = warmup.get(state, 0) + 1
        if v.state in TERMINAL_REQUEST_STATES:
            if not rid.startswith(WARMUP_REQUEST_PREFIX):
                ended[v.state] = ended.get(v.state, 0) + 1
            continue
        start = v.admitted_at if v.admitted_at is not None else v.since
        requests.append({
            "id": rid, "state": v.state or "admitted", "age_s": _round(None if now is None else now - start),
            "n": v.n, "prompt_tokens": v.prompt_tokens, "tokens": v.tokens, "engine_ids": v.engine_ids,
            "admitted_t": _round(_rel(start, origin)), "since_t": _round(_rel(v.since, origin)),
            # Engine restarts (docs/resume.md): held for the restarted engine; resumed so far.
            "held": v.held, "resumes": v.resumes, "reprefilled": v.reprefilled,
        })
    links = [{
        "name": name, "state": link.state or "starting", "since_t": _round(_rel(link.since, origin)),
        "for_s": _round(None if now is None else now - link.since), "engine_pid": link.pid,
        "engine_alive": pid_alive(link.pid, started_after=None if wall0 is None else wall0 - CLOCK_SLACK_S),
        "facts": link.facts, "priority": link.priority, "placement": link.placement, "ranks": link.ranks,
        "restarts": link.restarts, "last_crash": link.last_crash,
    } for name, link in st.links.items()]
    return {
        "as_of": {"basis": as_of, "seq": st.last_seq, "t": _round(_rel(now, origin)),
                  "journal_end_t": _round(_rel(end_time, origin))},
        "run": {
            "status": status, "pid": run.pid, "pid_alive": alive, "version": run.version, "engine": run.engine,
            "started_wall": run.wall_time, "started": _iso(run.wall_time),
            "stopped_t": _round(_rel(run.stopped_at, origin)), "exit_status": run.exit_status, "reason": run.reason,
            "media": run.media,
        },
        "links": links,
        "requests": requests,
        "ended_recently": ended,  # client requests; warm-up requests are counted under "warmup"
        "warmup": warmup,
        "fold": {"frames": st.frames, "frames_undecodable": st.frames_undecodable, "unmatched": st.unmatched},
        "journal": journal_facts(reader, path),
        "kv": kv_facts(reader),
    }


def journal_facts(reader: Reader, path: Path) -> dict[str, Any]:
    counts = reader.counts()
    meta = reader.meta()
    wal = Path(f"{path}-wal")
    snap = reader.last_snapshot()
    return {
        "path": str(path),
        "file_bytes": path.stat().st_size,
        "wal_bytes": wal.stat().st_size if wal.exists() else 0,
        "records": counts.records,
        "stored_bytes": counts.bytes,  # what its blocks take in the file: the byte budget's measure
        "first_seq": counts.first_seq,
        "last_seq": counts.last_seq,
        "pruned_at_start": max(0, counts.first_seq - 1),
        "by_kind": counts.by_kind,
        "records_max": meta.get("records_max"),
        "bytes_max": meta.get("bytes_max"),
        "schema_version": meta.get("schema_version"),
        "last_snapshot_seq": None if snap is None else snap.seq,
        # Whether the servicer can write this file: the journal cannot say so itself on a full disk.
        "health": read_health(path),
        "previous_runs": [str(p) for p in previous_journals(path)],
    }


def previous_journals(path: Path) -> list[Path]:
    """The previous runs' journals kept beside ``path`` (newest first; ENGINELINK_JOURNAL_KEEP of them)."""
    kept = []
    for n in range(1, JOURNAL_KEEP_MAX + 1):
        prev = previous_path(path, n)
        if not prev.exists():
            break
        kept.append(prev)
    return kept


# How far back from the journal's end to look for each rank's newest KV batch.
KV_TAIL_RECORDS = 20_000


def kv_facts(reader: Reader) -> dict[str, Any] | None:
    """The KV relay as its journal records show it: window, holes, incarnations, subscribers.

    None when the run relayed no KV events. The window is what the journal
    holds; the relay's in-memory window is at most SMG_KV_EVENT_HISTORY_BATCHES
    of the newest of these.
    """
    batches = reader.counts().by_kind.get(KIND_KV_BATCH, 0)
    ranks: dict[str, dict[str, Any]] = {}
    subscribers: dict[str, str] = {}
    for rec in reader.records(stream_prefix="kv/", kinds=[KIND_TRANSITION, KIND_KV_LOST, KIND_KV_INCARNATION]):
        p = rec.payload
        if rec.kind == KIND_TRANSITION and p["machine"] == "kv_subscriber":
            subscribers[p["id"]] = p["dest"]
        elif rec.kind == KIND_TRANSITION and p["machine"] == "kv_rank":
            ranks.setdefault(p["id"], {})["state"] = p["dest"]
        elif rec.kind == KIND_KV_LOST:
            ranks.setdefault(str(p["rank"]), {}).setdefault("holes", []).append([p["first"], p["last"], p["why"]])
        elif rec.kind == KIND_KV_INCARNATION:
            ranks.setdefault(str(p["rank"]), {})["incarnation"] = p["inc"]
    last = reader.last_seq()
    for rec in reader.records(kinds=[KIND_KV_BATCH], after_seq=max(0, last - KV_TAIL_RECORDS)):
        rank = ranks.setdefault(str(rec.payload["rank"]), {})
        rank["newest_seq"] = rec.payload["seq"]
        rank.setdefault("oldest_seq_in_tail", rec.payload["seq"])
    if not batches and not ranks and not subscribers:
        return None
    open_subscribers = sorted((sid for sid, state in subscribers.items() if state != "ended"), key=int)
    return {"batches_journaled": batches, "ranks": ranks, "subscribers_open": open_subscribers,
            "subscribers_seen": len(subscribers)}


def _last_time(reader: Reader) -> float | None:
    last = reader.last_seq()
    recs = reader.records(after_seq=last - 1, limit=1) if last else []
    return recs[0].time if recs else None


# -- rendering ---------------------------------------------------------------------


def render_view(view: dict[str, Any]) -> str:
    run, jr = view["run"], view["journal"]
    lines = [_run_line(run, view["as_of"])]
    lines.append(
        f"journal {jr['path']}: {jr['records']:,} records (seq {jr['first_seq']}..{jr['last_seq']}"
        + (f", {jr['pruned_at_start']:,} pruned at the start" if jr["pruned_at_start"] else "")
        + f"), {_bytes(jr['stored_bytes'])} in blocks; file {_bytes(jr['file_bytes'])} + WAL {_bytes(jr['wal_bytes'])}"
    )
    if jr["records_max"]:
        lines.append(
            f"  budgets: {jr['records_max']:,} records ({100 * jr['records'] / jr['records_max']:.1f}% used), "
            f"{_bytes(jr['bytes_max'])} of file ({100 * jr['stored_bytes'] / max(1, jr['bytes_max']):.1f}% used); "
            f"last snapshot: {'none' if jr['last_snapshot_seq'] is None else 'seq ' + str(jr['last_snapshot_seq'])}"
        )
    lines += render_media(run.get("media"))
    lines += render_health(jr.get("health"), run.get("pid"))
    if jr.get("previous_runs"):
        lines.append(f"  previous runs' journals kept: {len(jr['previous_runs'])} "
                     f"({Path(jr['previous_runs'][0]).name} is the newest; --previous K reads one)")
    lines += render_links(view["links"])
    lines += render_requests(view["requests"])
    if view["ended_recently"]:
        lines.append("recently ended: " + ", ".join(f"{n} {s}" for s, n in sorted(view["ended_recently"].items())))
    if view["warmup"]:
        lines.append("warm-up requests: " + ", ".join(f"{n} {s}" for s, n in sorted(view["warmup"].items())))
    lines += render_kv(view.get("kv"))
    return "\n".join(lines)


def render_media(media: dict[str, Any] | None) -> list[str]:
    """Worker-side media processing and each of its bounds, as the servicer started with them."""
    if not media:
        return []
    bounds = ", ".join(f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}"
                       for name, value in sorted((media.get("bounds") or {}).items()))
    return [f"media: mm_processor={media.get('mm_processor')} (source={media.get('mm_processor_source')}); "
            f"bounds: {bounds}"]


def render_health(health: dict[str, Any] | None, pid: int | None) -> list[str]:
    """The journal file's health as the servicer last wrote it (``journal/store_health.py``)."""
    if health is None or health.get("pid") != pid:
        return []  # none, or another run's
    if not health.get("writing", True):
        return [f"  NOT WRITING to this file since {_iso(health.get('since'))} ({health.get('error')}): "
                f"{health.get('dropped_in_episode', 0):,} records dropped from it so far; the servicer keeps "
                "serving, and this view lacks what it could not write"]
    if health.get("episodes"):
        return [f"  writing (it failed {health['episodes']} time(s) before, last: {health.get('error')}; "
                f"the dropped records are a gap in seq)"]
    return []


def render_kv(kv: dict[str, Any] | None) -> list[str]:
    if kv is None:
        return ["KV events: none relayed"]
    lines = [f"KV events: {kv['batches_journaled']:,} batches journaled; subscribers open "
             f"{len(kv['subscribers_open'])} {kv['subscribers_open'] or ''} of {kv['subscribers_seen']} seen"]
    for rank, facts in sorted(kv["ranks"].items()):
        holes = facts.get("holes", [])
        lines.append(f"  rank {rank}: {facts.get('state', '?')}, incarnation {facts.get('incarnation', 0)}, "
                     f"newest seq {facts.get('newest_seq', '-')}, {len(holes)} hole(s)"
                     + (f" {holes[-3:]}" if holes else ""))
    return lines


def _run_line(run: dict[str, Any], as_of: dict[str, Any]) -> str:
    head = f"servicer pid {run['pid']} (enginelink {run['version']}, engine wire {run['engine']}), started {run['started']}"
    if run["status"] == "stopped":
        return f"{head}\n  STOPPED at t={run['stopped_t']} s: exit status {run['exit_status']} ({run['reason']})"
    if run["status"] == "running":
        return f"{head}\n  RUNNING (pid alive), up {as_of['t']} s; journal lags the process by up to one flush ({FLUSH_INTERVAL_S * 1000:g} ms)"
    return (f"{head}\n  DEAD: pid {run['pid']} is gone and the journal has no run.stop (killed or crashed);"
            f" state as of the journal's end, t={as_of['journal_end_t']} s, seq {as_of['seq']}")


def render_links(links: list[dict[str, Any]]) -> list[str]:
    lines = [f"links ({len(links)})"]
    for link in links:
        facts = " ".join(f"{k}={link['facts'][k]}" for k in FACTS_SHOWN if link["facts"].get(k) is not None)
        pid = f"engine pid {link['engine_pid']}"
        if link["engine_alive"] is not None:
            pid += " (alive)" if link["engine_alive"] else " (gone)"
        if link["facts"].get("address"):  # the router link of `enginelink headless`: where it dialled
            pid = f"router {link['facts']['address']}"
        lasting = "" if link["for_s"] is None else f" (for {link['for_s']} s)"
        lines.append(f"  {link['name']:<10} {link['state']:<11} since t={link['since_t']} s{lasting}  {pid}")
        if link.get("restarts"):
            lines.append(f"             engine restarts: {link['restarts']}; the last after: {link.get('last_crash')}")
        if facts:
            lines.append(f"             {facts}")
        if link.get("priority"):
            lines.append(f"             priority: engine {describe_priority(link['priority'])}")
        if link.get("placement"):
            lines.append(f"             placement: {describe_placement(link['placement'])}")
        if len(link.get("ranks") or ()) > 1:
            ranks = ", ".join(f"{r['rank']} ({r.get('instance_id')})" for r in link["ranks"])
            lines.append(f"             DP ranks ({len(link['ranks'])}): {ranks}")
    return lines


def render_requests(requests: list[dict[str, Any]]) -> list[str]:
    held = sum(1 for q in requests if q.get("held"))
    lines = [f"requests in flight ({len(requests)})" + (f", {held} held for the restarting engine" if held else "")]
    if requests:
        width = max(10, *(len(q["id"]) for q in requests))
        resumed = any(q.get("held") or q.get("resumes") for q in requests)
        extra = f" {'RESUME':<7} {'REPREFILLED':>11}" if resumed else ""
        lines.append(f"  {'ID':<{width}} {'STATE':<9} {'AGE_S':>8} {'N':>3} {'PROMPT':>7} {'TOKENS':>7}{extra}")
        for q in requests:
            age = "-" if q["age_s"] is None else f"{q['age_s']:.3f}"
            more = ""
            if resumed:
                status = "HELD" if q.get("held") else f"x{q['resumes']}" if q.get("resumes") else "-"
                more = f" {status:<7} {q.get('reprefilled', 0):>11}"
            lines.append(f"  {q['id']:<{width}} {q['state']:<9} {age:>8} {q['n']:>3} {q['prompt_tokens']:>7} "
                         f"{q['tokens']:>7}{more}")
    return lines


def render_state(st: FoldState) -> str:
    """A folded state (``journal replay``), without the live facts ``inspect`` adds."""
    origin = st.run.started_at
    run = st.run
    lines = [f"state at seq {st.last_seq}: run pid {run.pid}, started {_iso(run.wall_time)}"
             + ("" if run.stopped_at is None else
                f", stopped at t={_round(_rel(run.stopped_at, origin))} s: exit {run.exit_status} ({run.reason})")]
    lines += render_links([{
        "name": n, "state": v.state or "starting", "since_t": _round(_rel(v.since, origin)), "for_s": None,
        "engine_pid": v.pid, "engine_alive": None, "facts": v.facts, "priority": v.priority,
        "placement": v.placement, "ranks": v.ranks, "restarts": v.restarts, "last_crash": v.last_crash}
        for n, v in st.links.items()])
    live = {rid: v for rid, v in st.requests.items() if v.state not in TERMINAL_REQUEST_STATES}
    lines += render_requests([{
        "id": rid, "state": v.state or "admitted", "age_s": None, "n": v.n, "prompt_tokens": v.prompt_tokens,
        "tokens": v.tokens, "held": v.held, "resumes": v.resumes, "reprefilled": v.reprefilled}
        for rid, v in live.items()])
    ended = [(rid, v) for rid, v in st.requests.items() if rid not in live]
    lines.append(f"requests ended (newest {min(len(ended), ENDED_SHOWN)} of the {len(ended)} kept)")
    for rid, v in ended[-ENDED_SHOWN:]:
        lines.append(f"  {rid:<10} {v.state:<9} at t={_round(_rel(v.since, origin))} s  n={v.n} "
                     f"sent={v.tokens_sent} engine={v.tokens} finish={v.finish_reason}"
                     + (f" resumed={v.resumes} reprefilled={v.reprefilled}" if v.resumes else ""))
    lines.append(f"frames {st.frames} ({st.frames_undecodable} undecodable), client.sent unmatched {st.unmatched}")
    return "\n".join(lines)


def _rel(t: float | None, origin: float | None) -> float | None:
    if t is None:
        return None
    return t - origin if origin is not None else t


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _iso(wall: float | None) -> str | None:
    if wall is None:
        return None
    return dt.datetime.fromtimestamp(wall, dt.timezone.utc).isoformat(timespec="milliseconds")


def _bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        import base64

        return base64.b64encode(bytes(obj)).decode("ascii")
    raise TypeError(f"{type(obj).__name__} is not JSON-able")
