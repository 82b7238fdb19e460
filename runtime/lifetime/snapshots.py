"""Periodic snapshot records, so replay never has to start from the beginning.

The task folds the journal's new records (from the in-memory ring, off the
hot path) into a running ``FoldState`` every ``fold_every_s``, and appends
that state as a ``snapshot`` record every ``interval_s``. Replay =
fold(latest snapshot, records after it), and equals the fold from the start:
``tests/journal`` checks the fold side, and the contract tests the live side.

A snapshot is written only when something other than snapshots was journaled
since the previous one: an idle servicer does not repeat its state into the
journal every interval (it used to, and a few large request ids then filled
a 1 GB journal with copies of one state). Each snapshot's size is bounded
whatever the clients send (the compact form of ``fold.snapshot_payload``,
request ids capped by validation, requests by the in-flight cap and the
fold's ``terminal_max``; docs/limits.md).

The fold never decodes an engine frame the link already decoded: the link
hands its ``OutputBatch`` of each one-part frame to the journal
(``Journal.note_decoded``, kept only while this task runs, bounded by
``DECODED_OUTPUTS_MAX``), and the task folds that in place of the bytes. Same
outputs, so the same state as replay's fold of the bytes; a frame whose
decode was not kept is decoded here, as replay does. (It used to decode every
frame again: 13% of the servicer's CPU against a zero-cost engine; docs/benchmarks.md.)

If the ring pruned records before the task saw them (more than the ring's
budget within ``fold_every_s``), the running fold would be wrong, so the task
stops writing snapshots and says so; replay then starts from the beginning.
"""

from __future__ import annotations

import logging
import os

import trio

from enginelink.journal.fold import FoldState, fold, snapshot_payload
from enginelink.journal.records import KIND_ENGINE_FRAME, KIND_SNAPSHOT, Record, row_to_record

log = logging.getLogger("enginelink.snapshots")

# ENGINELINK_SNAPSHOT_INTERVAL_SECS overrides it (tests use a short period to get snapshots).
SNAPSHOT_INTERVAL_S = float(os.environ.get("ENGINELINK_SNAPSHOT_INTERVAL_SECS") or 30.0)
FOLD_EVERY_S = 0.5


async def run_snapshots(
    journal,
    *,
    interval_s: float = SNAPSHOT_INTERVAL_S,
    fold_every_s: float = FOLD_EVERY_S,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    state = FoldState()
    journal.keep_decoded()
    try:
        await _fold_and_snapshot(journal, state, interval_s, fold_every_s, task_status)
    finally:
        journal.keep_decoded(False)  # nobody takes them any more: keep none


async def _fold_and_snapshot(journal, state: FoldState, interval_s: float, fold_every_s: float, task_status) -> None:
    last_snapshot = trio.current_time()
    news = False  # a record other than a snapshot was appended since the last snapshot
    task_status.started(state)
    while True:
        await trio.sleep(fold_every_s)
        rows = journal.ring.rows(after_seq=state.last_seq)
        decoded = journal.take_decoded(rows[-1][0]) if rows else {}
        if rows and rows[0][0] != state.last_seq + 1:
            log.warning(
                "journal ring pruned records %d..%d before they were folded; no more snapshots this run",
                state.last_seq + 1,
                rows[0][0] - 1,
            )
            return
        news = news or any(row[3] != KIND_SNAPSHOT for row in rows)
        fold((_live_record(row, decoded) for row in rows), state)
        now = trio.current_time()
        if now - last_snapshot >= interval_s and news:
            journal.append(now, "run", KIND_SNAPSHOT, snapshot_payload(state))
            news = False
            last_snapshot = now


def _live_record(row, decoded: dict) -> Record:
    """The row as the fold takes it; an engine frame the link decoded comes as that decode."""
    seq, time, stream, kind, blob = row
    if kind == KIND_ENGINE_FRAME:
        batch = decoded.get(seq)
        if batch is not None:
            return Record(seq, time, stream, kind, batch)
    return row_to_record(row)
