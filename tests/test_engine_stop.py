"""Stopping the engine: nothing of it outlives the servicer, and the stop is bounded (issue 22, item 3).

A real vLLM engine once took 21 s to stop (its launcher sat on SIGTERM for
11 s) and left its Worker running, reparented to PID 1. The property: when
``enginelink serve`` exits, no process of the engine is left (its process
group, every descendant of it, a child that left the group and outlived its
parent), and it exits within its drain time plus the documented bound
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

from enginelink.runtime.engine.engine_processes import engine_members
from tests.harness import Servicer, alive, engine_pid, generate_request, wait_until
from tests.test_lifecycle import PROMPT, SLOW_ENGINE, StreamReader

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

# docs/running.md: after the drain, a SIGTERMed servicer exits within the stop grace + this
# (1 s for the drain's aborts, 5 s for a SIGKILLed process to vanish, 2 s to close gRPC).
STOP_BOUND_OVER_GRACE_S = 8.0
DRAIN_S = 1.0
GRACE_S = 1.0
ENV = {"ENGINELINK_DRAIN_SECS": str(DRAIN_S), "ENGINELINK_ENGINE_STOP_GRACE_SECS": str(GRACE_S),
       "SMG_VLLM_SERVICER_WARMUP": "off"}  # fmt: skip


def wait_for_stray(group: int) -> int:
    """The stray child: the engine's, once it has left the engine's process group for one of its own."""

    def stray():
        return next((pid for pid in engine_members(group) if pid != group and os.getpgid(pid) == pid), None)

    return wait_until(stray, 20, f"a child of engine {group} in a process group of its own")


def stop_under_load(servicer: Servicer, stray: int) -> tuple[int, float, list[int]]:
    """SIGTERM with a stream in flight: (exit status, seconds to exit, the engine's processes left at exit)."""
    group = engine_pid(servicer.journal)
    reader = StreamReader(servicer.stub, generate_request("long", PROMPT, stream=True, max_tokens=1500, ignore_eos=True))
    reader.start()
    assert reader.started_streaming.wait(10)
    signalled = time.monotonic()
    servicer.signal(signal.SIGTERM)
    status = servicer.wait(60)
    took = time.monotonic() - signalled
    left = engine_members(group) + [stray] * alive(stray)
    reader.join(5)
    assert reader.completes and reader.completes[0].finish_reason == "abort"
    return status, took, left


@pytest.mark.slow
@pytest.mark.parametrize("faults", [["--fault-stray-child"], ["--fault-stray-child", "--fault-ignore-sigterm"]],
                         ids=["stray-child", "stray-child-and-deaf-engine"])  # fmt: skip
def test_sigterm_leaves_no_process_of_the_engine_and_is_bounded(tmp_path, test_model_dir, faults):
    servicer = Servicer(tmp_path, model_dir=test_model_dir, engine_args=[*SLOW_ENGINE, *faults], env=ENV).start()
    try:
        stray = wait_for_stray(engine_pid(servicer.journal))
        status, took, left = stop_under_load(servicer, stray)
        assert status == 0
        assert left == [], f"processes of the engine outlived the servicer: {left}"
        assert took <= DRAIN_S + GRACE_S + STOP_BOUND_OVER_GRACE_S, f"stop took {took:.1f} s"
        assert "SIGKILL" in servicer.log()  # the stray (and the deaf engine) needed it
    finally:
        servicer.stop()


@pytest.mark.slow
def test_an_engine_that_dies_leaves_no_stray_behind_the_failed_servicer(tmp_path, test_model_dir):
    # The engine's own process dies; its stray child (a Worker whose EngineCore
    # was killed), outside the engine's process group, lives on, deaf to SIGTERM,
    # an orphan the servicer adopted. The servicer fails (exit 1) but does not
    # leave before the stray is gone.
    servicer = Servicer(tmp_path, model_dir=test_model_dir, engine_args=["--fault-stray-child"], env=ENV).start()
    try:
        group = engine_pid(servicer.journal)
        stray = wait_for_stray(group)
        os.kill(group, signal.SIGKILL)
        assert servicer.wait(30) == 1
        assert engine_members(group) == [] and not alive(stray), "the engine's stray child outlived the servicer"
    finally:
        servicer.stop()
