"""``enginelink bench-journal``: the hot-path cost of one journal append.

What every engine frame and every transition pays in the servicer's thread:
``Journal.append`` into the ring and the pending buffer. The budgets are
small on purpose, so every append also prunes the ring and drops from the
pending buffer: the worst case of the hot path. Nothing is flushed to disk
during the loop (the flusher is a trio task, and none runs here).

It was a test that printed and asserted nothing; figures belong here and in
docs/benchmarks-history.md, not in the test suite. Its output is one JSON object per
payload kind (``--json``) or one line for a person.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from enginelink.journal import records as r
from enginelink.journal.journal import Journal

DEFAULT_APPENDS = 200_000
RING_RECORDS_MAX = 50_000
PENDING_RECORDS_MAX = 50_000


def cases() -> list[tuple[str, str, object]]:
    """(label, record kind, payload): a request transition, and a 200-byte engine frame."""
    transition = r.Transition("request", "req-0123456789", "admitted", "running", "first_output").payload()
    return [
        ("transition", r.KIND_TRANSITION, transition),
        ("engine.frame 200 B", r.KIND_ENGINE_FRAME, bytes(200)),
    ]


def measure(directory: Path, appends: int) -> list[dict]:
    """One timed loop of ``appends`` appends per case, each into a fresh journal."""
    results = []
    for number, (label, kind, payload) in enumerate(cases()):
        journal = Journal(directory / f"bench-{number}.sqlite", ring_records_max=RING_RECORDS_MAX,
                          pending_records_max=PENDING_RECORDS_MAX)  # fmt: skip
        append = journal.append
        start = time.perf_counter()
        for i in range(appends):
            append(i * 1e-5, "req/req-0123456789", kind, payload)
        elapsed_s = time.perf_counter() - start
        journal.close()
        results.append({"case": label, "appends": appends, "us_per_append": elapsed_s / appends * 1e6})
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--appends", type=int, default=DEFAULT_APPENDS,
                   help=f"appends timed per case (default {DEFAULT_APPENDS})")
    p.add_argument("--json", action="store_true", help="print one JSON object per case")


def run(args: argparse.Namespace) -> int:
    if args.appends < 1:
        raise SystemExit("enginelink bench-journal: --appends must be at least 1")
    with tempfile.TemporaryDirectory(prefix="enginelink-bench-journal-") as directory:
        results = measure(Path(directory), args.appends)
    for result in results:
        if args.json:
            print(json.dumps(result))
        else:
            print(f"journal append, {result['case']}: {result['us_per_append']:.2f} us ({result['appends']} appends)")
    return 0
