"""The fast loop's rule (tests/fast_loop.py): under ``--fast`` a test that starts a process fails, naming it.

The real thing is checked in a pytest of its own (``pytest --fast`` on this
module's canary, a test that starts a process without the mark): it must
fail with the guard's message, and ``--collect-only`` must keep no test
marked as starting one, nor a seed past the slice.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fast_loop import FAST_SIM_SEEDS, PROCESS_MARKS, Guard, ProcessInFastLoop

ROOT = Path(__file__).resolve().parents[1]
CANARY = "ENGINELINK_FAST_LOOP_CANARY"


def _pytest(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "ENGINELINK_SIM_SEED"))}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env={**env, CANARY: "1"})


def test_the_guard_refuses_a_start_while_a_test_runs_and_remembers_it():
    guard = Guard()  # not installed: its hook is called by hand (a real start here would meet this run's guard)
    guard._hook("subprocess.Popen", ("/bin/true", ["/bin/true", "--x"], None, None))  # between tests: let through
    assert guard.take() == []
    guard.test = "tests/x.py::test_y"
    with pytest.raises(ProcessInFastLoop, match=r"started one \(subprocess.Popen /bin/true --x\).*pytest.mark.process"):
        guard._hook("subprocess.Popen", ("/bin/true", ["/bin/true", "--x"], None, None))
    with pytest.raises(ProcessInFastLoop):
        guard._hook("os.fork", ())
    guard._hook("open", ("/etc/hostname", "r", 0))  # not a process start
    assert guard.take() == ["subprocess.Popen /bin/true --x", "os.fork ()"] and guard.take() == []


def test_canary_starts_a_process_without_the_mark():
    if not os.environ.get(CANARY):
        pytest.skip("the canary runs only inside test_an_unmarked_test_that_starts_a_process_fails_the_fast_loop")
    subprocess.run([sys.executable, "-c", "pass"], check=False)


@pytest.mark.process
def test_an_unmarked_test_that_starts_a_process_fails_the_fast_loop():
    done = _pytest("--fast", "-q", f"{Path(__file__).relative_to(ROOT)}::test_canary_starts_a_process_without_the_mark")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed" in done.stdout, done.stdout
    assert "the fast loop runs no process, and this test started one (subprocess.Popen" in done.stdout, done.stdout
    # The full suite runs it as any test.
    done = _pytest("-q", f"{Path(__file__).relative_to(ROOT)}::test_canary_starts_a_process_without_the_mark")
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr


@pytest.mark.process
def test_the_fast_selection_keeps_no_process_test_and_a_slice_of_seeds():
    done = _pytest("--fast", "--collect-only", "-q", "tests/sim", "tests/test_fast_loop.py", "tests/journal")
    assert done.returncode == 0, done.stdout + done.stderr
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    seeds = [int(m.group(1)) for i in ids if (m := re.search(r"\[seed=(\d+)\]$", i)) and "test_grpc_seeds" not in i]
    assert seeds and max(seeds) == FAST_SIM_SEEDS - 1
    assert "tests/test_fast_loop.py::test_an_unmarked_test_that_starts_a_process_fails_the_fast_loop" not in ids
    assert "tests/test_fast_loop.py::test_the_guard_refuses_a_start_while_a_test_runs_and_remembers_it" in ids
    assert not [i for i in ids if "test_the_lock_is_per_process_and_names_its_holder" in i]  # marked: a second process
    assert set(PROCESS_MARKS) == {"process", "vllm", "mlx", "router"}
