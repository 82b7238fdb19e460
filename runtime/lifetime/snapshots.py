"""Periodic snapshot records, so replay never has to start from the beginning.

The journal's live fold (``Journal.fold_live``) advances a ``FoldState`` by
each record, at the end of the receive wake-up that appended it
(``Journal.catch_up``); every ``interval_s`` this task appends that state as a
``snapshot`` record. Replay = fold(latest snapshot, records after
it), and equals the fold from the start: ``tests/journal`` checks the fold
side, and the contract tests the live side.

A snapshot is written only when something other than snapshots was journaled
since the previous one: an idle servicer does not repeat its state into the
journal every interval (it used to, and a few large request ids then filled
a 1 GB journal with copies of one state), and the task wakes once per
interval, not more. Each snapshot's size is bounded whatever the clients
send (the compact form of ``fold.snapshot_payload``, request ids capped by
validation, requests by the in-flight cap and the fold's ``terminal_max``;
docs/limits.md).

The fold never decodes an engine frame the link already decoded: the link
hands its ``OutputBatch`` of each one-part frame to the journal right after
journaling it (``Journal.note_decoded``), and the live fold folds that in
place of the bytes. Same outputs, so the same state as replay's fold of the
bytes. (It used to decode every frame again, 13% of the servicer's CPU
against a zero-cost engine; then to keep each decode for a fold every half
second, which freed them cold and stalled the loop for the whole batch:
docs/benchmarks-history.md.)
"""

from __future__ import annotations

import logging
import os

import trio

from enginelink.journal.fold import snapshot_payload
from enginelink.journal.journal import LiveFoldUnavailable
from enginelink.journal.records import KIND_SNAPSHOT

# ENGINELINK_SNAPSHOT_INTERVAL_SECS overrides it (tests use a short period to get snapshots).
log = logging.getLogger("enginelink.snapshots")

SNAPSHOT_INTERVAL_S = float(os.environ.get("ENGINELINK_SNAPSHOT_INTERVAL_SECS") or 30.0)


async def run_snapshots(
    journal,
    *,
    interval_s: float = SNAPSHOT_INTERVAL_S,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Start the journal's live fold, then write its state as a snapshot every ``interval_s``
    when anything but snapshots was journaled since the last one. ``task_status``: the live state."""
    try:
        state = journal.fold_live()
    except LiveFoldUnavailable as error:
        # Started long after the run began (never in serve): replay then starts from the beginning.
        log.warning("%s, so no snapshots this run; replay folds the journal from its start", error)
        task_status.started(None)
        return
    task_status.started(state)
    try:
        snapshot_seq = 0  # the seq of the last snapshot this task wrote
        while True:
            await trio.sleep(interval_s)
            if journal.last_seq > snapshot_seq:
                state = journal.live_state()
                snapshot_seq = journal.append(trio.current_time(), "run", KIND_SNAPSHOT, snapshot_payload(state))
    finally:
        journal.end_live_fold()  # nobody reads it any more: appends stop paying for it
