"""Periodic snapshot records, so replay never has to start from the beginning.

The task folds the journal's new records (from the in-memory ring, off the
hot path) into a running ``FoldState`` every ``fold_every_s``, and appends
that state as a ``snapshot`` record every ``interval_s``. Replay =
fold(latest snapshot, records after it), and equals the fold from the start:
``tests/journal`` checks the fold side, and the contract tests the live side.

If the ring pruned records before the task saw them (more than the ring's
budget within ``fold_every_s``), the running fold would be wrong, so the task
stops writing snapshots and says so; replay then starts from the beginning.
"""

from __future__ import annotations

import logging
import os

import trio

from enginelink.journal.fold import FoldState, fold, snapshot_payload
from enginelink.journal.records import KIND_SNAPSHOT

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
    last_snapshot = trio.current_time()
    task_status.started(state)
    while True:
        await trio.sleep(fold_every_s)
        records = journal.records(after_seq=state.last_seq)
        if records and records[0].seq != state.last_seq + 1:
            log.warning(
                "journal ring pruned records %d..%d before they were folded; no more snapshots this run",
                state.last_seq + 1,
                records[0].seq - 1,
            )
            return
        fold(records, state)
        now = trio.current_time()
        if now - last_snapshot >= interval_s:
            journal.append(now, "run", KIND_SNAPSHOT, snapshot_payload(state))
            last_snapshot = now
