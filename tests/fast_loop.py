"""The fast inner loop (``tools/run-tests --fast``, ``pytest --fast``): the tests that start no process.

The rule is one a test can be held to: a test in the fast loop runs in this
process only. It starts no servicer, engine, router, tool or helper
interpreter (``subprocess``, ``os.fork``, ``os.posix_spawn``, ``os.system``,
``os.exec*``), directly or through a fixture. A test that does is marked
``process`` (or ``vllm``, ``mlx``, ``router``, which start one too), or uses
one of the shared fixtures that start one (``PROCESS_FIXTURES``), and stays
in the full suite only.

The marks cannot drift: under ``--fast`` an audit hook (PEP 578, which sees
every process start whatever library asks for it) refuses the start, and the
test fails, naming what it started and the mark it lacks. A test marked
``process`` that starts none is only a test the fast loop skips: the cheap
direction.

The simulation's seed sweeps run a slice (``FAST_SIM_SEEDS`` seeds a sweep,
the first ones) unless ``--sim-seed(s)`` / ``ENGINELINK_SIM_SEED(S)`` name
their own.
"""

from __future__ import annotations

import os
import re
import sys
import threading

import pytest

# The marks of tests that start a process; the fast loop deselects them.
PROCESS_MARKS = ("process", "vllm", "mlx", "router")
# The shared fixtures (conftest.py files) that start a servicer or an engine: a test that uses one
# starts a process without a mark of its own. A module's own fixtures are covered by its tests' marks.
PROCESS_FIXTURES = frozenset({"servicer", "slow_servicer", "kv_default", "vllm_stack", "vllm_quiet", "mlx_stack"})
# Seeds per simulation sweep in the fast loop (the full suite runs tests/sim/conftest.py's 400).
FAST_SIM_SEEDS = 10
SEED_ID = re.compile(r"\[seed=(\d+)\]$")
# The audit events of a process start (https://docs.python.org/3/library/audit_events.html).
SPAWN_EVENTS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
                          "os.system", "os.exec"})


class ProcessInFastLoop(RuntimeError):
    """A test in the fast loop started a process."""


class Guard:
    """Refuses process starts while a fast-loop test runs, and remembers them for its report.

    An audit hook cannot be removed, so it is installed once (``--fast``
    only) and checks ``test`` (the running test's node id, or None between
    tests). It refuses the start by raising, and also records it: a test
    that catches the error still fails.
    """

    def __init__(self) -> None:
        self.test: str | None = None
        self.started: list[str] = []
        self._lock = threading.Lock()  # starts may come from a test's worker threads

    def install(self) -> None:
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if event not in SPAWN_EVENTS or self.test is None:
            return
        what = f"{event} {_describe(event, args)}"
        with self._lock:
            self.started.append(what)
        raise ProcessInFastLoop(
            f"the fast loop runs no process, and this test started one ({what}); "
            f"mark the test `@pytest.mark.process` (docs/testing.md, tests/fast_loop.py) or keep it in-process")

    def take(self) -> list[str]:
        with self._lock:
            started, self.started = self.started, []
        return started


def _describe(event: str, args: tuple) -> str:
    if event == "subprocess.Popen" and len(args) >= 2:
        argv = args[1]
        argv = [argv] if isinstance(argv, (str, bytes, os.PathLike)) else list(argv or [])
        return " ".join(str(a) for a in argv[:4])[:200]
    return repr(args[:2])[:200]


GUARD = Guard()


def add_option(parser) -> None:
    parser.addoption("--fast", action="store_true", default=False,
                     help="the fast loop: only the tests that start no process, and a slice of the "
                          "simulation's seeds (tests/fast_loop.py, docs/testing.md)")


def configure(config) -> None:
    config.addinivalue_line("markers", "process: starts a process (a servicer, an engine, a tool, a helper "
                                       "interpreter): not in the fast loop (tests/fast_loop.py)")
    if config.getoption("fast"):
        GUARD.install()


def starts_a_process(item) -> bool:
    return (any(item.get_closest_marker(mark) for mark in PROCESS_MARKS)
            or not PROCESS_FIXTURES.isdisjoint(getattr(item, "fixturenames", ())))


def _own_seeds(config) -> bool:
    """Whether the caller chose the simulation's seeds (then the fast loop keeps them all)."""
    if os.environ.get("ENGINELINK_SIM_SEED") or os.environ.get("ENGINELINK_SIM_SEEDS"):
        return True
    for name in ("sim_seed", "sim_seeds"):
        try:
            if config.getoption(name) is not None:
                return True
        except ValueError:  # tests/sim/conftest.py's options: registered only for a run of tests/sim
            pass
    return False


def select(config, items: list) -> None:
    """Under ``--fast``: drop the tests marked as starting a process, and seeds past the slice."""
    if not config.getoption("fast"):
        return
    own_seeds = _own_seeds(config)
    kept, dropped = [], []
    for item in items:
        seed = SEED_ID.search(item.nodeid)
        beyond = (not own_seeds and item.nodeid.startswith("tests/sim/") and seed is not None
                  and int(seed.group(1)) >= FAST_SIM_SEEDS)
        (dropped if starts_a_process(item) or beyond else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def watch(item):
    """A hook wrapper's body for one phase of a test (setup, call, teardown): the guard is on
    during it; a start it saw fails that phase's report (``fail_report``)."""
    if not item.config.getoption("fast"):
        return (yield)
    GUARD.test = item.nodeid
    try:
        return (yield)
    finally:
        GUARD.test = None


def fail_report(item, report) -> None:
    if not item.config.getoption("fast"):
        return
    started = GUARD.take()
    if started and not report.failed:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} started a process in the fast loop ({'; '.join(started[:3])}): "
                           "mark it `@pytest.mark.process` (tests/fast_loop.py)")
