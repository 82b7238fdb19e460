"""``enginelink bench --soak``, two minutes of it: churn, an engine restart, and nothing that grows.

The one-hour soak is run by hand (docs/benchmarks-history.md, "Issue 36", "An hour that stays flat"); this is
its short form, in the suite so that a leak fails a test. A leak shows within two minutes because
the churn is fast (hundreds of calls a second) and the bounds are on growth, not on absolute size;
the journal's in-memory ring and the KV history, which grow by design until they are full, are made
small (``ENGINELINK_JOURNAL_RING_RECORDS``, ``SMG_KV_EVENT_HISTORY_BATCHES``) so they are full within
the warm-up. What it catches: a task, fd or thread per call at once; memory from about 2 KB a call
(24 MiB over the half-minute judged, at this churn); the hour-long soak's slope is the finer check.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.harness import VENV_BIN

pytestmark = [pytest.mark.process, pytest.mark.slow]


def test_two_minutes_of_churn_stay_flat_and_every_stream_is_the_engines(tmp_path):
    # What fills by design, made small so it is full within the warm-up: the journal's ring, the KV history.
    env = {**os.environ, "ENGINELINK_JOURNAL_RING_RECORDS": "5000", "SMG_KV_EVENT_HISTORY_BATCHES": "500"}
    plot = tmp_path / "soak.svg"
    done = subprocess.run(
        [str(VENV_BIN / "enginelink"), "bench", "--soak", "120s", "--concurrency", "128",
         "--soak-sample-s", "5", "--soak-warmup-s", "25", "--plot", str(plot)],
        capture_output=True, text=True, timeout=600, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "flat: every bound held, every stream matched, both journals verify" in out
    # The run had what it is for: an engine restart, streams checked, KV subscribers, refusals.
    assert "the servicer exited 1 and is serving again" in out
    checked = int(re.search(r"(\d+) choices, \d+ tokens; violations 0", out).group(1))
    assert checked > 1000, out[-3000:]
    assert re.search(r"bad\s+.*INVALID_ARGUMENT \d+", out)
    assert "journal verify, the journal of the run before (--previous 1): exit 0" in out
    # The journal's records per call were judged (not only its records a second, which follow the load).
    judged = re.findall(r"^\s+\d+\s+records_per_call\s+(\d+)\s.*\b(ok|OVER)$", out, re.M)
    assert judged and all(int(samples) >= 3 and verdict == "ok" for samples, verdict in judged), out[-3000:]
    assert plot.read_text().startswith("<svg")
