"""``enginelink journal show|replay|verify|export|timeline``: post-mortem tools on a journal file.

All five open the file read-only (``open_reader``), so they work on a live
servicer's journal, a cleanly closed one and the one a killed servicer left.

- ``show``: one line per record, payload summarised (an engine frame as
  "N outputs, M tokens"); filters by stream prefix, request id (its records
  plus the engine frames that carry its engine ids), kind, time, seq, limit;
- ``replay``: the state at a seq or time: the latest snapshot at or before
  it, then the records after it, through ``fold`` (``--from-start`` ignores
  snapshots; both give the same state);
- ``verify``: the invariants of ``journal/verify.py``; exit 0 when all hold,
  1 with the violations listed;
- ``export``: JSON lines, one per record; engine frames as base64 bytes or
  as decoded summaries;
- ``timeline --out FILE.json``: the records as a Chrome/Perfetto trace (a
  track per request, per engine link and per engine rank;
  ``tools/journal_timeline.py``), with the filters of ``show``.

Times on the command line and in output are seconds since the run started
(``t``, from the ``run.start`` record), or an ISO 8601 wall time on input.
Exit status: 0 success, 1 verify found violations (or the file is not a
journal), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import itertools
import json
import sys
from collections.abc import Iterator
from typing import Any

import msgspec

from enginelink.journal import records as r
from enginelink.journal.fold import TERMINAL_REQUEST_STATES, FoldState, fold
from enginelink.journal.records import Record
from enginelink.journal.store import Reader, StoreError, open_reader
from enginelink.journal.verify import CHECKS, Report, verify
from enginelink.tools.inspect import add_journal_arguments, journal_path, quiet_stdout, render_state
from enginelink.tools.journal_timeline import write_timeline
from enginelink.wire import codecs
from enginelink.wire.engine import EngineDead, FinishReason, WireError

SUMMARY_CHARS_MAX = 200
TOKENS_LISTED_MAX = 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    common = argparse.ArgumentParser(add_help=False)
    add_journal_arguments(common)
    filters = argparse.ArgumentParser(add_help=False)
    filters.add_argument("--stream", help="only streams starting with this (e.g. req/, link/, engine/0)")
    filters.add_argument("--request", metavar="ID", help="one request: its records and the frames for it")
    filters.add_argument("--kind", action="append", metavar="KIND",
                         help=f"only this kind (repeatable, or comma-separated): {', '.join(sorted(r.KINDS))}")
    filters.add_argument("--since", metavar="TIME", help="from this time: seconds since run start, or ISO 8601")
    filters.add_argument("--until", metavar="TIME", help="up to this time: seconds since run start, or ISO 8601")
    filters.add_argument("--from-seq", type=int, default=None)
    filters.add_argument("--to-seq", type=int, default=None)
    filters.add_argument("--limit", type=int, default=None, help="at most this many records")

    sub.add_parser("show", parents=[common, filters], help="records, one line each, payloads summarised")
    replay = sub.add_parser("replay", parents=[common], help="the state folded up to a seq or time")
    replay.add_argument("--to-seq", type=int, default=None, help="fold records up to and including this seq")
    replay.add_argument("--to-time", metavar="TIME", help="fold records up to this time (seconds since run start, or ISO 8601)")
    replay.add_argument("--from-start", action="store_true", help="ignore snapshots: fold from the first record")
    replay.add_argument("--json", action="store_true", help="the fold state as JSON")
    check = sub.add_parser("verify", parents=[common], help="check the journal's invariants (exit 1 on a violation)")
    check.add_argument("--json", action="store_true", help="the report as JSON")
    export = sub.add_parser("export", parents=[common, filters], help="JSON lines, one per record")
    export.add_argument("--frames", choices=["base64", "decoded"], default="base64",
                        help="engine frames as their bytes (base64, default) or decoded summaries")
    timeline = sub.add_parser("timeline", parents=[common, filters],
                              help="a Chrome/Perfetto trace (JSON) of the run: a track per request, link and rank")
    timeline.add_argument("--out", metavar="FILE.json", required=True,
                          help="where to write the trace (open it in https://ui.perfetto.dev); - for stdout")
    timeline.add_argument("--frames", choices=["counters", "none"], default="counters",
                          help="engine frames as counters on their rank's track (default), or left out")


def run(args: argparse.Namespace) -> int:
    path = journal_path(args)
    try:
        reader = open_reader(path)
    except (FileNotFoundError, StoreError) as error:
        print(f"enginelink journal: {error}", file=sys.stderr)
        return 1
    with reader:
        try:
            return {"show": _show, "replay": _replay, "verify": _verify, "export": _export,
                    "timeline": _timeline}[args.action](reader, args)
        except UsageError as error:
            print(f"enginelink journal {args.action}: {error}", file=sys.stderr)
            return 2
        except BrokenPipeError:  # `| head`
            quiet_stdout()
            return 0


class UsageError(Exception):
    """Arguments that make no sense for this journal."""


# -- time ------------------------------------------------------------------------


class Origin(msgspec.Struct, frozen=True):
    """Maps the servicer's trio time to run-relative and wall time."""

    trio: float | None = None  # trio time of run.start
    wall: float | None = None  # wall clock at that moment

    def rel(self, t: float) -> float:
        return t - self.trio if self.trio is not None else t

    def parse(self, text: str) -> float:
        """A command-line time (seconds since run start, or ISO 8601) as trio time."""
        try:
            return float(text) + (self.trio or 0.0)
        except ValueError:
            pass
        try:
            when = dt.datetime.fromisoformat(text)
        except ValueError:
            raise UsageError(f"time {text!r}: expected seconds since run start or an ISO 8601 time") from None
        if self.trio is None or self.wall is None:
            raise UsageError("this journal has no run.start record, so wall times cannot be mapped; use seconds")
        if when.tzinfo is None:
            when = when.astimezone()
        return self.trio + (when.timestamp() - self.wall)


def origin_of(reader: Reader) -> Origin:
    start = reader.records(kinds=[r.KIND_RUN_START], limit=1)
    # Engine frames are decoded with the wire the run spoke (run.start's engine: vllm, sglang, ...).
    use_codec(start[0].payload.get("engine") if start else None)
    if start:
        return Origin(start[0].time, start[0].payload.get("wall_time"))
    snap = reader.last_snapshot()  # pruned at the start: a snapshot remembers the run
    if snap is not None:
        run = snap.payload["state"].get("run", {})
        return Origin(run.get("started_at"), run.get("wall_time"))
    return Origin()


def seq_at_time(reader: Reader, t: float) -> int:
    """The newest seq whose time is <= t (0 if none): a binary search on seq
    (record times never decrease along seq)."""
    lo, hi, best = reader.first_seq(), reader.last_seq(), 0
    while lo <= hi:
        mid = (lo + hi) // 2
        found = reader.records(after_seq=mid - 1, limit=1)  # the first record at or after mid
        if not found or found[0].seq > hi:
            hi = mid - 1
        elif found[0].time <= t:
            best, lo = found[0].seq, found[0].seq + 1
        else:
            hi = mid - 1
    return best


# -- selecting records -----------------------------------------------------------


def select(reader: Reader, args: argparse.Namespace, origin: Origin) -> Iterator[Record]:
    kinds = None
    if args.kind:
        kinds = {k.strip() for arg in args.kind for k in arg.split(",") if k.strip()}
        unknown = kinds - r.KINDS
        if unknown:
            raise UsageError(f"unknown kind(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(r.KINDS))}")
    filters: dict[str, Any] = {
        "after_seq": (args.from_seq - 1) if args.from_seq else 0,
        "until_seq": args.to_seq,
        "kinds": kinds,
        "time_min": None if args.since is None else origin.parse(args.since),
        "time_max": None if args.until is None else origin.parse(args.until),
    }
    if args.request is None:
        records: Iterator[Record] = reader.iter_records(stream_prefix=args.stream, **filters)
    else:
        records = _request_records(reader, args.request, filters)
    return itertools.islice(records, args.limit) if args.limit is not None else records


def _request_records(reader: Reader, rid: str, filters: dict[str, Any]) -> Iterator[Record]:
    """A request's own records merged with the engine frames that mention it."""
    stream = r.request_stream(rid)
    own = list(reader.iter_records(streams=[stream], **{**filters, "kinds": None}))
    engine_ids = {i for rec in own if rec.kind == r.KIND_ENGINE_REQUEST for i in rec.payload["request_ids"]}
    kinds = filters["kinds"]
    if kinds is not None:
        own = [rec for rec in own if rec.kind in kinds]
    frames: list[Record] = []
    if engine_ids and (kinds is None or r.KIND_ENGINE_FRAME in kinds):
        first = min(rec.seq for rec in own) if own else 0
        frame_filters = {**filters, "kinds": [r.KIND_ENGINE_FRAME], "after_seq": max(filters["after_seq"], first)}
        for rec in reader.iter_records(**frame_filters):
            mine = _frame_for(rec.payload, engine_ids)
            if mine is not None:
                frames.append(Record(rec.seq, rec.time, rec.stream, rec.kind, mine))
    return iter(sorted(own + frames, key=lambda rec: rec.seq))


# -- engine frames ---------------------------------------------------------------

_codec = codecs.get("vllm")


def use_codec(engine: str | None) -> None:
    """Decode frames as engine wire ``engine`` from now on (vLLM's when unknown, as ``journal/fold.py``)."""
    global _codec
    _codec = codecs.get(engine if engine in codecs.NAMES else "vllm")


def decode_frame(payload: bytes) -> dict[str, Any]:
    """One engine frame as a JSON-able summary (what the servicer read from it)."""
    try:
        batch = _codec.decode_output([payload])
    except WireError as error:
        return {"undecodable": str(error), "bytes": len(payload)}
    if isinstance(batch, EngineDead):
        return {"engine_dead": True}
    return {
        "engine_index": batch.engine_index,
        "outputs": [{"request_id": o.request_id, "new_token_ids": list(o.new_token_ids),
                     "finish_reason": o.finish_reason, "stop_reason": o.stop_reason} for o in batch.outputs],
        "finished_requests": None if batch.finished_requests is None else list(batch.finished_requests),
        "utility": None if batch.utility is None else msgspec.to_builtins(batch.utility),
        "stats": None if batch.stats is None else msgspec.to_builtins(batch.stats),
    }


def _frame_for(payload: bytes, engine_ids: set[str]) -> dict[str, Any] | None:
    frame = decode_frame(payload)
    outputs = [o for o in frame.get("outputs", ()) if o["request_id"] in engine_ids]
    return {**frame, "outputs": outputs, "only_request": True} if outputs else None


def _finish_name(code: int) -> str:
    try:
        return FinishReason(code).contract_name
    except ValueError:
        return str(code)


def frame_summary(frame: dict[str, Any]) -> str:
    if "undecodable" in frame:
        return f"undecodable ({frame['bytes']} bytes): {frame['undecodable']}"
    if frame.get("engine_dead"):
        return "ENGINE_CORE_DEAD"
    outputs = frame["outputs"]
    tokens = sum(len(o["new_token_ids"]) for o in outputs)
    if frame.get("only_request"):
        parts = []
        for o in outputs:
            ids = o["new_token_ids"]
            listed = ids if len(ids) <= TOKENS_LISTED_MAX else [*ids[:TOKENS_LISTED_MAX], "..."]
            finish = "" if o["finish_reason"] is None else f" finish {_finish_name(o['finish_reason'])}"
            parts.append(f"{o['request_id']}: {len(ids)} tokens {listed}{finish}")
        return "; ".join(parts)
    text = f"{len(outputs)} outputs, {tokens} tokens"
    finished = sum(1 for o in outputs if o["finish_reason"] is not None)
    if finished:
        text += f", {finished} finished"
    if frame["utility"] is not None:
        text += f", utility reply #{frame['utility']['call_id']}"
    stats = frame["stats"]
    if stats is not None:
        text += f" (running {stats['num_running_reqs']}, waiting {stats['num_waiting_reqs']})"
    return text


# -- show ------------------------------------------------------------------------


def summary(rec: Record, origin: Origin) -> str:
    p = rec.payload
    match rec.kind:
        case r.KIND_ENGINE_FRAME:
            return frame_summary(p if isinstance(p, dict) else decode_frame(p))
        case r.KIND_TRANSITION:
            text = f"{p['machine']} {p['id']}: {p['source']} -[{p['event']}]-> {p['dest']}"
            return text + (f" ({p['reason']})" if p.get("reason") else "")
        case r.KIND_CLIENT_GENERATE:
            return f"n={p['n']} prompt_tokens={p['prompt_tokens']} stream={p['stream']} max_tokens={p['max_tokens']}"
        case r.KIND_CLIENT_SENT:
            engine = "" if p.get("tokens_engine") is None else f" (engine {p['tokens_engine']})"
            return f"choice {p['index']}: {p['tokens_sent']} tokens sent{engine}, finish {p['finish_reason']}"
        case r.KIND_CLIENT_ABORT:
            return f"abort {', '.join(p['request_ids'])} ({p['reason']})"
        case r.KIND_ENGINE_REQUEST:
            return f"ADD {', '.join(p['request_ids'])} on {p['link']} ({p['prompt_tokens']} prompt tokens)"
        case r.KIND_ENGINE_FACTS:
            facts = " ".join(f"{k}={v}" for k, v in p["facts"].items() if isinstance(v, (int, float, str)))
            return _clip(f"{p['link']} engine pid {p['pid']}: {facts}")
        case r.KIND_ERROR:
            return _clip(f"[{p['whose']}] {p['code']}: {p['message']}")
        case r.KIND_INTERNAL_ERROR:
            return _clip(f"[bug] {p['rpc']} (request {p.get('request_id')!r}): {p['type']}: {p['message']}")
        case r.KIND_SNAPSHOT:
            st = FoldState.from_snapshot(rec)
            live = sum(1 for v in st.requests.values() if v.state not in TERMINAL_REQUEST_STATES)
            return f"state as of seq {rec.seq - 1}: {len(st.links)} links, {len(st.requests)} requests ({live} open)"
        case r.KIND_RUN_START:
            wall = p.get("wall_time")
            when = "?" if wall is None else dt.datetime.fromtimestamp(wall, dt.timezone.utc).isoformat(timespec="milliseconds")
            return f"pid {p['pid']}, enginelink {p.get('version')}, engine {p.get('engine')}, started {when}"
        case r.KIND_RUN_STOP:
            return f"exit status {p['exit_status']}: {p['reason']}"
        case _:
            return _clip(" ".join(f"{k}={json.dumps(v, default=_b64)}" for k, v in p.items()))


def _show(reader: Reader, args: argparse.Namespace) -> int:
    origin = origin_of(reader)
    out = sys.stdout
    for rec in select(reader, args, origin):
        out.write(f"{rec.seq:>8} {origin.rel(rec.time):>11.6f}  {rec.stream:<16} {rec.kind:<16} {summary(rec, origin)}\n")
    out.flush()
    return 0


def _clip(text: str) -> str:
    return text if len(text) <= SUMMARY_CHARS_MAX else text[: SUMMARY_CHARS_MAX - 3] + "..."


# -- replay ----------------------------------------------------------------------


def replay(reader: Reader, *, to_seq: int | None = None, from_start: bool = False) -> tuple[FoldState, int]:
    """The state after record ``to_seq`` (the end if None); also the snapshot seq used (0: none)."""
    snap = None if from_start else reader.last_snapshot(until_seq=to_seq)
    state = FoldState() if snap is None else FoldState.from_snapshot(snap)
    fold(reader.iter_records(after_seq=state.last_seq, until_seq=to_seq), state)
    return state, 0 if snap is None else snap.seq


def _replay(reader: Reader, args: argparse.Namespace) -> int:
    if args.to_seq is not None and args.to_time is not None:
        raise UsageError("give --to-seq or --to-time, not both")
    to_seq = args.to_seq
    if args.to_time is not None:
        to_seq = seq_at_time(reader, origin_of(reader).parse(args.to_time))
    state, snap_seq = replay(reader, to_seq=to_seq, from_start=args.from_start)
    how = f"from the snapshot at seq {snap_seq}" if snap_seq else "from the first record"
    print(f"replayed {how} to seq {state.last_seq}", file=sys.stderr)
    if args.json:
        print(json.dumps(state.to_dict(), default=_b64))
    else:
        print(render_state(state))
    return 0


# -- verify ----------------------------------------------------------------------


def _verify(reader: Reader, args: argparse.Namespace) -> int:
    from enginelink.machines.link import LINK_TABLE
    from enginelink.machines.router_link import ROUTER_LINK_TABLE
    from enginelink.machines.request import REQUEST_TABLE

    report = verify(reader.iter_records(), tables={"link": LINK_TABLE, "request": REQUEST_TABLE,
                                                   "router": ROUTER_LINK_TABLE})
    if args.json:
        print(json.dumps({"ok": report.ok, **msgspec.to_builtins(report)}))
    else:
        print(render_report(report, journal_path(args)))
    return 0 if report.ok else 1


def render_report(rep: Report, path) -> str:
    end = "run.stop present (the run ended)" if rep.run_stopped else "no run.stop (the servicer is running, or died)"
    lines = [f"journal {path}: {rep.records} records, seq {rep.first_seq}..{rep.last_seq}; {end}"]
    detail = {
        "sequence": f"seq {rep.first_seq}..{rep.last_seq}"
        + (f", {rep.pruned_at_start} pruned at the start (budget)" if rep.pruned_at_start else ", from seq 1")
        + (f", {len(rep.holes)} holes" if rep.holes else ", no holes"),
        "terminals": f"{rep.admitted} admitted, {rep.ended} ended exactly once, {len(rep.open_at_end)} open at the end"
        + (f" ({', '.join(rep.open_at_end[:10])}{', ...' if len(rep.open_at_end) > 10 else ''})" if rep.open_at_end else ""),
        "tokens": f"{rep.choices_checked} completed choices conserved ({rep.tokens_sent} tokens sent,"
        f" {rep.tokens_engine} from the engine)" + (f", {rep.choices_skipped} not checkable" if rep.choices_skipped else "")
        + (f"; {rep.frames_undecodable} undecodable frames" if rep.frames_undecodable else ""),
        "transitions": f"{rep.link_transitions} link and {rep.request_transitions} request transitions",
    }
    for check in CHECKS:
        bad = rep.violations_of(check)
        lines.append(f"{'ok  ' if not bad else 'FAIL'}  {check:<12} {detail[check]}")
        for v in bad:
            lines.append(f"        seq {v.seq}: {v.message}")
    if rep.internal_errors:
        lines.append(f"note  {rep.internal_errors} internal errors (servicer bugs answered INTERNAL; "
                     "`journal show --kind internal_error` has their tracebacks)")
    lines.append("all invariants hold" if rep.ok else f"{len(rep.violations)} violations")
    return "\n".join(lines)


# -- export ----------------------------------------------------------------------


def _export(reader: Reader, args: argparse.Namespace) -> int:
    origin = origin_of(reader)
    out = sys.stdout
    for rec in select(reader, args, origin):
        line: dict[str, Any] = {"seq": rec.seq, "time": rec.time, "t": origin.rel(rec.time),
                                "stream": rec.stream, "kind": rec.kind}
        if isinstance(rec.payload, bytes):
            if args.frames == "decoded" and rec.kind == r.KIND_ENGINE_FRAME:
                line["payload"], line["payload_encoding"] = decode_frame(rec.payload), "decoded"
            else:
                line["payload"], line["payload_encoding"] = base64.b64encode(rec.payload).decode("ascii"), "base64"
        else:
            line["payload"] = rec.payload
            if rec.kind == r.KIND_ENGINE_FRAME:  # --request: already decoded, only its outputs
                line["payload_encoding"] = "decoded"
        out.write(json.dumps(line, default=_b64) + "\n")
    out.flush()
    return 0


# -- timeline --------------------------------------------------------------------


def _timeline(reader: Reader, args: argparse.Namespace) -> int:
    origin = origin_of(reader)
    decode = decode_frame if args.frames == "counters" else None
    if args.out == "-":
        stats = write_timeline(select(reader, args, origin), sys.stdout, rel=origin.rel, decode_frame=decode)
    else:
        try:
            with open(args.out, "w", encoding="utf-8") as out:
                stats = write_timeline(select(reader, args, origin), out, rel=origin.rel, decode_frame=decode)
        except OSError as error:
            print(f"enginelink journal timeline: cannot write {args.out}: {error}", file=sys.stderr)
            return 1
    print(f"wrote {args.out}: {stats.events} events; {stats.requests} requests, {stats.links} links, "
          f"{stats.ranks} engine ranks, {stats.frames} frames", file=sys.stderr)
    return 0


def _b64(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(obj)).decode("ascii")
    raise TypeError(f"{type(obj).__name__} is not JSON-able")
