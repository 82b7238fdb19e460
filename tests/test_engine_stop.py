"""Stopping the engine: nothing of its session outlives the servicer, and the stop is bounded (issue 22, item 3).

A real vLLM engine once took 21 s to stop (its launcher sat on SIGTERM for
11 s) and left its Worker running, reparented to PID 1. The property: when
``enginelink serve`` exits, no process whose session id is the engine's is
left, and it exits within its drain time plus the documented bound
(docs/running.md, "Lifecycle, readiness and metrics": ``ENGINELINK_ENGINE_STOP_GRACE_SECS`` + 8 s).

The sim engine plays the stubborn parts on request: a child that ignores
SIGTERM and leaves the engine's process group (``--fault-stray-child``, a
worker that outlives its parent), and an engine deaf to SIGTERM
(``--fault-ignore-sigterm``). The real-engine version is in
``tests/vllm/test_vllm_lifecycle.py``.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from enginelink.runtime.engine.session import session_members
from tests.harness import Servicer, engine_pid, generate_request, wait_until
from tests.test_lifecycle import PROMPT, SLOW_ENGINE, StreamReader

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

# docs/running.md: after the drain, a SIGTERMed servicer exits within the stop grace + this
# (1 s for the drain's aborts, 5 s for a SIGKILLed process to vanish, 2 s to close gRPC).
STOP_BOUND_OVER_GRACE_S = 8.0
DRAIN_S = 1.0
GRACE_S = 1.0
ENV = {"ENGINELINK_DRAIN_SECS": str(DRAIN_S), "ENGINELINK_ENGINE_STOP_GRACE_SECS": str(GRACE_S),
       "SMG_VLLM_SERVICER_WARMUP": "off"}  # fmt: skip


def process_group(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[2])
    except (OSError, ValueError, IndexError):
        return None


def wait_for_stray(session: int) -> int:
    """The stray child, once it is in a process group of its own inside the engine's session."""

    def stray():
        return next((pid for pid in session_members(session) if pid != session and process_group(pid) == pid), None)

    return wait_until(stray, 20, f"a stray child in its own process group in session {session}")


def stop_under_load(servicer: Servicer) -> tuple[int, float, list[int]]:
    """SIGTERM with a stream in flight: (exit status, seconds to exit, the session's processes left at exit)."""
    session = engine_pid(servicer.journal)
    reader = StreamReader(servicer.stub, generate_request("long", PROMPT, stream=True, max_tokens=1500, ignore_eos=True))
    reader.start()
    assert reader.started_streaming.wait(10)
    signalled = time.monotonic()
    servicer.signal(signal.SIGTERM)
    status = servicer.wait(60)
    took = time.monotonic() - signalled
    left = session_members(session)
    reader.join(5)
    assert reader.completes and reader.completes[0].finish_reason == "abort"
    return status, took, left


@pytest.mark.slow
@pytest.mark.parametrize("faults", [["--fault-stray-child"], ["--fault-stray-child", "--fault-ignore-sigterm"]],
                         ids=["stray-child", "stray-child-and-deaf-engine"])  # fmt: skip
def test_sigterm_leaves_no_process_of_the_engine_session_and_is_bounded(tmp_path, test_model_dir, faults):
    servicer = Servicer(tmp_path, model_dir=test_model_dir, engine_args=[*SLOW_ENGINE, *faults], env=ENV).start()
    try:
        wait_for_stray(engine_pid(servicer.journal))
        status, took, left = stop_under_load(servicer)
        assert status == 0
        assert left == [], f"processes of the engine's session outlived the servicer: {left}"
        assert took <= DRAIN_S + GRACE_S + STOP_BOUND_OVER_GRACE_S, f"stop took {took:.1f} s"
        assert "SIGKILL" in servicer.log()  # the stray (and the deaf engine) needed it
    finally:
        servicer.stop()


@pytest.mark.slow
def test_an_engine_that_dies_leaves_no_stray_behind_the_failed_servicer(tmp_path, test_model_dir):
    # The engine's own process dies; its stray child (a Worker whose EngineCore
    # was killed) lives on, deaf to SIGTERM. The servicer fails (exit 1) but
    # does not leave before the stray is gone.
    servicer = Servicer(tmp_path, model_dir=test_model_dir, engine_args=["--fault-stray-child"], env=ENV).start()
    try:
        session = engine_pid(servicer.journal)
        wait_for_stray(session)
        os.kill(session, signal.SIGKILL)
        assert servicer.wait(30) == 1
        assert session_members(session) == [], "the engine's stray child outlived the servicer"
    finally:
        servicer.stop()
