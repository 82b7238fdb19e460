"""CPU per test, for finding where a CPU-bound suite's time goes (docs/testing.md, "CPU per test").

    tools/run-tests -p tests.cpu_account --cpu-log=DIR

writes one JSON line per test to ``DIR/<xdist worker>.jsonl``: its node id, when it began, its wall time,
and the CPU seconds of the test process and of every process it reaped meanwhile (``getrusage``:
``RUSAGE_SELF`` and ``RUSAGE_CHILDREN``). A process reaped late (a fixture's, or one a later test's
``wait`` collects) is booked to the test that reaped it: totals are right, a single row may not be.
Wall times alone mislead on a box whose cores are busy from start to end: a test waiting for the CPU
looks as slow as one using it.

Write it with the "=": a plugin loaded by ``-p`` adds its options after pytest has chosen its rootdir from
the arguments that look like paths, so a bare ``--cpu-log DIR`` makes DIR the rootdir (the repository's
pytest settings unread: hundreds of failures).
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest


def pytest_addoption(parser):
    parser.addoption("--cpu-log", metavar="DIR", help="write each test's CPU seconds to DIR/<worker>.jsonl")


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, reaped.ru_utime + reaped.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    folder = item.config.getoption("--cpu-log")
    if not folder:
        return (yield)
    began, (own, reaped) = time.time(), _cpu()
    try:
        return (yield)
    finally:
        own_after, reaped_after = _cpu()
        row = {"id": item.nodeid, "began": began, "wall_s": time.time() - began,
               "cpu_s": own_after - own, "reaped_cpu_s": reaped_after - reaped}
        Path(folder).mkdir(parents=True, exist_ok=True)
        name = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(Path(folder) / f"{name}.jsonl", "a") as log:
            log.write(json.dumps(row) + "\n")
