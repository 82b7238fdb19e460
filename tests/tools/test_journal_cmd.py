"""``enginelink journal show|replay|verify|export`` on the journal of a finished run.

One servicer serves a mix (streaming, n = 2, a stop string, an Abort, a
stream still running when SIGTERM drains it), writes snapshots every 0.5 s,
and exits; the tools then read its journal exactly as a user would. Copies of
the journal, damaged on purpose, show that ``verify`` names each violation.
"""

from __future__ import annotations

import base64
import json
import signal
import sqlite3

import msgspec
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.journal.fold import FoldState
from enginelink.journal.store import decode_block, encode_block, open_reader
from tests.harness import Servicer, generate_request, wait_until
from tests.tools.helpers import (WARMUP_PREFIX, PROMPT, Stream, copy_journal, enginelink, journal_has,
                                 verify_report, warmup_admitted)

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)


@pytest.fixture(scope="module")
def journal(tmp_path_factory, test_model_dir):
    servicer = Servicer(tmp_path_factory.mktemp("journal-cmd"), model_dir=test_model_dir,
                        engine_args=["--step-us", "10000"],
                        env={"ENGINELINK_SNAPSHOT_INTERVAL_SECS": "0.5", "ENGINELINK_DRAIN_SECS": "0.2"})
    try:
        servicer.start()
        stub = servicer.stub
        drained = Stream(servicer, "drained", max_tokens=1500, ignore_eos=True)
        cut = Stream(servicer, "cut", max_tokens=1500, ignore_eos=True)
        list(stub.Generate(generate_request("short", PROMPT, stream=True, max_tokens=5, ignore_eos=True)))
        list(stub.Generate(generate_request("pair", PROMPT, n=2, temperature=1.0, max_tokens=4, ignore_eos=True)))
        list(stub.Generate(generate_request("stopped", PROMPT, stream=True, max_tokens=300, ignore_eos=True,
                                            stop=["e"])))
        assert cut.streaming.wait(5) and drained.streaming.wait(5)
        stub.Abort(pb.AbortRequest(request_ids=["cut"]))
        cut.join(5)
        # A snapshot taken while "drained" is still open, so replay resumes mid-request.
        wait_until(lambda: journal_has(servicer.journal, lambda recs: any(
            r.kind == "snapshot" and getattr(FoldState.from_snapshot(r).requests.get("cut"), "state", None) == "aborted"
            for r in recs)), 5, "a snapshot after the abort")
        servicer.signal(signal.SIGTERM)
        assert servicer.wait(15) == 0, servicer.log()
        drained.join(5)
    finally:
        servicer.stop()
    return servicer.journal


def show(journal, *args) -> list[list[str]]:
    done = enginelink("journal", "show", "--journal", journal, *args)
    assert done.returncode == 0, done.stderr
    return [line.split(None, 4) for line in done.stdout.splitlines()]


def test_verify_passes_on_a_clean_run(journal):
    done = enginelink("journal", "verify", "--journal", journal)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "run.stop present (the run ended)" in lines[0]
    assert lines[1].startswith("ok    sequence     seq 1..") and lines[1].endswith("from seq 1, no holes")
    assert lines[2].startswith("ok    terminals    ") and lines[2].endswith(" ended exactly once, 0 open at the end")
    assert lines[3].startswith("ok    tokens       ") and " completed choices conserved" in lines[3]
    assert lines[4].startswith("ok    transitions  4 link and ")
    assert lines[-1] == "all invariants hold"
    report, warm = verify_report(journal), warmup_admitted(journal)
    assert (report["admitted"], report["ended"], report["open_at_end"]) == (5 + warm, 5 + warm, [])
    assert report["choices_checked"] >= 6  # short, pair (2), stopped, cut, drained
    assert report["tokens_sent"] <= report["tokens_engine"]


def test_show_filters_by_request_kind_stream_seq_and_time(journal):
    rows = show(journal, "--request", "pair")
    kinds = [row[3] for row in rows]
    assert kinds[:2] == ["client.generate", "engine.request"]
    assert kinds[-1] == "client.sent"
    # Each choice's tokens come one per engine step, 4 in all, and its last frame says it finished.
    # The two choices usually share every step; when the engine takes their ADDs in two steps (a
    # loaded machine), choice 0 finishes a frame earlier and its complete goes out before the
    # other's last frame, so the order is checked per choice.
    tokens, finished_at, sent_at, sent = {0: 0, 1: 0}, {}, {}, {}
    for at, row in enumerate(rows):
        if row[3] == "engine.frame":
            for part in row[4].split("; "):
                choice = int(part.split(":", 1)[0].removeprefix("pair#"))
                assert part.startswith(f"pair#{choice}: 1 tokens ["), part
                tokens[choice] += 1
                if "finish length" in part:
                    finished_at[choice] = at
        elif row[3] == "client.sent":
            choice = int(row[4].split(":", 1)[0].removeprefix("choice "))
            sent_at[choice], sent[choice] = at, row[4]
    assert tokens == {0: 4, 1: 4}
    assert sent == {c: f"choice {c}: 4 tokens sent (engine 4), finish length" for c in (0, 1)}
    assert all(finished_at[c] < sent_at[c] for c in (0, 1))  # a complete only after its finish

    links = show(journal, "--stream", "link/", "--kind", "transition")
    assert [row[4] for row in links] == [
        "link vllm-0: starting -[handshake_done]-> warming_up",
        "link vllm-0: warming_up -[warmup_done]-> serving",
        "link vllm-0: serving -[drain]-> draining",
        "link vllm-0: draining -[drained]-> stopped",
    ]
    frames = show(journal, "--kind", "engine.frame", "--limit", "3")
    assert len(frames) == 3 and all(row[2] == "engine/0" for row in frames)
    assert all(" outputs, " in row[4] and " tokens" in row[4] for row in frames)

    window = show(journal, "--from-seq", "10", "--to-seq", "19")
    assert [int(row[0]) for row in window] == list(range(10, 20))
    t0, t1 = float(window[2][1]), float(window[7][1])
    timed = [(int(row[0]), float(row[1])) for row in show(journal, "--since", str(t0), "--until", str(t1))]
    assert timed and all(t0 - 1e-6 <= t <= t1 + 1e-6 for _, t in timed)  # printed times are rounded
    inside = {int(row[0]) for row in show(journal) if t0 + 1e-6 < float(row[1]) < t1 - 1e-6}
    assert inside <= {seq for seq, _ in timed}

    bad = enginelink("journal", "show", "--journal", journal, "--kind", "nonsense")
    assert bad.returncode == 2 and "unknown kind(s) nonsense" in bad.stderr


def test_replay_from_a_snapshot_equals_replay_from_the_start(journal):
    with open_reader(journal) as reader:
        snapshots = [rec.seq for rec in reader.records(kinds=["snapshot"])]
        last = reader.last_seq()
    assert len(snapshots) >= 2, "the servicer wrote no snapshots (ENGINELINK_SNAPSHOT_INTERVAL_SECS)"
    for to_seq in (snapshots[0] + 3, snapshots[-1] + 1, last):
        fast = enginelink("journal", "replay", "--journal", journal, "--to-seq", to_seq, "--json")
        slow = enginelink("journal", "replay", "--journal", journal, "--to-seq", to_seq, "--json", "--from-start")
        assert fast.returncode == slow.returncode == 0, fast.stderr + slow.stderr
        assert "replayed from the snapshot at seq" in fast.stderr
        assert "replayed from the first record" in slow.stderr
        assert json.loads(fast.stdout) == json.loads(slow.stdout)
        assert fast.stdout == slow.stdout  # byte for byte, key order included
    state = json.loads(fast.stdout)
    assert state["last_seq"] == last and state["run"]["exit_status"] == 0
    assert {rid: v["state"] for rid, v in state["requests"].items() if not rid.startswith(WARMUP_PREFIX)} == {
        "drained": "aborted", "cut": "aborted", "short": "finished", "pair": "finished", "stopped": "finished"}
    assert state["requests"]["pair"]["engine_tokens"] == [4, 4]

    human = enginelink("journal", "replay", "--journal", journal, "--to-time", "0.0")
    assert human.returncode == 0 and human.stdout.startswith("state at seq 1: run pid ")


def test_export_writes_every_record_as_json_lines(journal):
    done = enginelink("journal", "export", "--journal", journal)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    with open_reader(journal) as reader:
        records = reader.records()
    assert [line["seq"] for line in lines] == [rec.seq for rec in records]
    for line, rec in zip(lines, records):
        if line["kind"] == "engine.frame":
            assert line["payload_encoding"] == "base64" and base64.b64decode(line["payload"]) == rec.payload
        elif line["kind"] != "snapshot":
            # bytes inside a payload (kv.batch's publisher payload) go out as base64
            b64 = lambda raw: base64.b64encode(raw).decode("ascii")  # noqa: E731
            assert line["payload"] == json.loads(json.dumps(rec.payload, default=b64))
    decoded = enginelink("journal", "export", "--journal", journal, "--kind", "engine.frame", "--frames", "decoded")
    frames = [json.loads(line) for line in decoded.stdout.splitlines()]
    assert len(frames) == sum(line["kind"] == "engine.frame" for line in lines)
    assert all(frame["payload_encoding"] == "decoded" for frame in frames)
    # The first step of "drained" (a warm-up, if any, came before it).
    first = next(frame for frame in frames if any(o["request_id"] == "drained" for o in frame["payload"]["outputs"]))
    outputs = first["payload"]["outputs"]
    assert {o["request_id"] for o in outputs} <= {"drained", "cut", "short"}
    assert all(len(o["new_token_ids"]) == 1 and o["finish_reason"] is None for o in outputs)


def _tamper(path, edit) -> None:
    """Rewrite the journal file's records through ``edit`` (a row in, the row to keep or None out), block by
    block, as a hand on the file would: the store's own block format, its snapshots table rebuilt."""
    with sqlite3.connect(path) as db:
        blocks = [decode_block(body) for (body,) in db.execute("SELECT body FROM blocks ORDER BY first_seq")]
        db.execute("DELETE FROM blocks")
        db.execute("DELETE FROM snapshots")
        for rows in blocks:
            rows = [row for row in map(edit, rows) if row is not None]
            if rows:
                db.execute("INSERT INTO blocks (first_seq, last_seq, count, bytes, body) VALUES (?, ?, ?, ?, ?)",
                           encode_block(rows))
                db.executemany("INSERT INTO snapshots (seq, block) VALUES (?, ?)",
                               [(row[0], rows[0][0]) for row in rows if row[3] == "snapshot"])


def _at(seq: int, kind: str | None = None, payload: dict | None = None):
    """An edit for ``_tamper``: the record ``seq`` gone, or given another kind and payload."""
    def edit(row):
        if row[0] != seq:
            return row
        return None if payload is None else (row[0], row[1], row[2], kind or row[3], msgspec.msgpack.encode(payload))
    return edit


def _seq_of(path, kind: str, predicate) -> tuple[int, dict]:
    with open_reader(path) as reader:
        for rec in reader.records(kinds=[kind]):
            if predicate(rec.payload):
                return rec.seq, rec.payload
    raise AssertionError(f"no {kind} record matched")


def test_verify_names_each_violation(journal, tmp_path):
    bad = copy_journal(journal, tmp_path / "bad.sqlite")
    # A hole: one record gone from the middle (while only "drained" runs).
    hole, _ = _seq_of(bad, "transition", lambda p: p["machine"] == "link" and p["event"] == "drain")
    hole += 1
    _tamper(bad, _at(hole))
    # Tokens: a choice claims one token more than it got.
    seq, payload = _seq_of(bad, "client.sent", lambda p: p["request_id"] == "short")
    _tamper(bad, _at(seq, payload={**payload, "tokens_sent": payload["tokens_sent"] + 1}))
    # An illegal link transition, and a request that ends twice.
    seq, payload = _seq_of(bad, "transition", lambda p: p["machine"] == "link" and p["event"] == "drained")
    _tamper(bad, _at(seq, payload={**payload, "dest": "serving"}))
    seq, payload = _seq_of(bad, "transition", lambda p: p["id"] == "pair" and p["dest"] == "finished")
    _tamper(bad, _at(seq + 1, "transition", payload))  # the next record (a client.sent) becomes a second finish

    done = enginelink("journal", "verify", "--journal", bad)
    assert done.returncode == 1, done.stdout
    out = done.stdout
    assert "FAIL  sequence" in out and f"hole: records {hole} missing" in out
    assert "FAIL  tokens" in out and "request 'short' choice 0 (short, finish length): 6 tokens sent, but the engine produced 5" in out
    assert "FAIL  transitions" in out and "link 'vllm-0': draining -[drained]-> serving is not in the link table" in out
    assert "FAIL  terminals" in out and "request 'pair' ended twice" in out
    assert out.splitlines()[-1].endswith(" violations")

    report = json.loads(enginelink("journal", "verify", "--journal", bad, "--json").stdout)
    assert report["ok"] is False
    assert {v["check"] for v in report["violations"]} == {"sequence", "tokens", "transitions", "terminals"}


def test_verify_accepts_a_journal_pruned_at_the_start(journal, tmp_path):
    pruned = copy_journal(journal, tmp_path / "pruned.sqlite")
    seq, _ = _seq_of(pruned, "client.generate", lambda p: p["request_id"] == "pair")
    _tamper(pruned, lambda row: row if row[0] >= seq + 3 else None)  # mid-request: its admission is gone
    done = enginelink("journal", "verify", "--journal", pruned)
    assert done.returncode == 0, done.stdout
    assert f"{seq + 2} pruned at the start (budget)" in done.stdout
    view = json.loads(enginelink("inspect", "--journal", pruned, "--json").stdout)
    assert view["journal"]["pruned_at_start"] == seq + 2 and view["run"]["status"] == "stopped"
