"""Attacks on liveness: an engine frozen while idle is noticed (issue 21, item 9).

Before: SIGSTOP the engine with nothing in flight, and health stayed SERVING
for ever while the next request waited the whole silence limit (300 s). Now
the link asks an idle engine a cheap utility call (``is_sleeping``) after
``ENGINELINK_IDLE_PROBE_SECS`` of quiet and fails when it is not answered
within ``ENGINELINK_IDLE_PROBE_TIMEOUT_SECS``: health NOT_SERVING, open calls
UNAVAILABLE, exit 1 (the supervisor restarts the pair). An engine only
paused for less than the timeout is not failed.

Real processes: ``enginelink serve`` over the sim engine, SIGSTOP / SIGCONT
on the engine's pid. Bounds are the knobs' values plus slack for a loaded
machine; every wait is a bounded poll.
"""

from __future__ import annotations

import os
import re
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from enginelink.runtime.engine.engine_processes import engine_members
from tests.harness import Pidfd, Servicer, engine_pid, free_port, frozen, generate_request, scrape, wait_until

pytestmark = [pytest.mark.process, pytest.mark.slow]

PROMPT = [318, 283, 1552, 10, 90, 305]
PROBE_S = 0.5
# The wake-up check of the link's probe loop (a quarter of the interval) and a loaded machine's delays.
SLACK_S = 3.0


def idle_servicer(tmp_path, model_dir, timeout_s: float, engine_args: list[str] | None = None) -> Servicer:
    metrics_port = free_port()
    servicer = Servicer(tmp_path, model_dir=model_dir, extra=["--metrics-port", str(metrics_port)],
                        engine_args=engine_args, env={
        "ENGINELINK_IDLE_PROBE_SECS": str(PROBE_S), "ENGINELINK_IDLE_PROBE_TIMEOUT_SECS": str(timeout_s),
        "ENGINELINK_ENGINE_STOP_GRACE_SECS": "1", "SMG_VLLM_SERVICER_WARMUP": "off",
    })  # fmt: skip
    servicer.metrics_port = metrics_port
    return servicer.start()


def probes_sent(servicer: Servicer) -> float:
    return probe_counts(servicer)[0]


def probe_counts(servicer: Servicer) -> tuple[float, float]:
    """(probes sent, probes answered): the difference is the probe awaiting its answer."""
    samples = scrape(servicer.metrics_port)
    sent = sum(v for name, v in samples.items() if name.startswith("smg_servicer_link_idle_probes{"))
    answered = sum(v for name, v in samples.items() if name.startswith("smg_servicer_link_idle_probes_answered{"))
    return sent, answered


def a_probe_awaits_the_stopped_engine(servicer: Servicer) -> bool:
    """A probe is outstanding and stays so: the stopped engine has it. Which probe does not matter:
    one sent just before the SIGSTOP and not yet answered is as good as one sent after (the count
    of probes sent then never moves, since one is outstanding at a time: the race CI met). Seen
    twice, a probe-loop check apart, so an answer the engine wrote before it stopped has been read."""
    sent, answered = probe_counts(servicer)
    if sent - answered < 1:
        return False
    time.sleep(0.3)
    return probe_counts(servicer) == (sent, answered)


def health_status(servicer: Servicer) -> int:
    stub = health_pb2_grpc.HealthStub(servicer.channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status


def not_serving(servicer: Servicer) -> bool:
    try:
        return health_status(servicer) == health_pb2.HealthCheckResponse.NOT_SERVING
    except grpc.RpcError:
        return servicer.process.poll() is not None  # already gone: not serving either


def test_a_frozen_idle_engine_goes_not_serving_and_the_servicer_exits_1(tmp_path, test_model_dir):
    timeout_s = 2.0
    servicer = idle_servicer(tmp_path, test_model_dir, timeout_s)
    try:
        engine = engine_pid(servicer.journal)
        # It is probed and answers while it runs: still serving after several rounds.
        wait_until(lambda: probes_sent(servicer) >= 3, 10 * PROBE_S + SLACK_S, "three answered probes")
        assert health_status(servicer) == health_pb2.HealthCheckResponse.SERVING
        frozen_at = time.monotonic()
        os.kill(engine, signal.SIGSTOP)
        wait_until(lambda: not_serving(servicer), PROBE_S + timeout_s + SLACK_S,
                   "health NOT_SERVING after the engine froze", interval_s=0.05)  # fmt: skip
        assert time.monotonic() - frozen_at >= timeout_s  # it waited for the answer the timeout allows
        assert servicer.wait(PROBE_S + timeout_s + SLACK_S + 10) == 1
        assert "answered no liveness probe" in servicer.log()
        assert engine_members(engine) == [], "the frozen engine outlived the servicer"
    finally:
        servicer.stop()


def test_a_request_sent_to_a_frozen_engine_fails_at_the_probe_timeout_not_the_silence_limit(tmp_path, test_model_dir):
    timeout_s = 3.0
    servicer = idle_servicer(tmp_path, test_model_dir, timeout_s)
    try:
        engine = engine_pid(servicer.journal)
        wait_until(lambda: probes_sent(servicer) >= 1, 5 * PROBE_S + SLACK_S, "a first probe")
        os.kill(engine, signal.SIGSTOP)
        # A precondition, not the property: a starved servicer (a loaded machine) may send it late.
        wait_until(lambda: a_probe_awaits_the_stopped_engine(servicer), PROBE_S + 5 * SLACK_S,
                   "a probe awaiting the frozen engine")  # fmt: skip
        sent_at = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            list(servicer.stub.Generate(generate_request("after-freeze", PROMPT, max_tokens=4), timeout=60))
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "liveness probe" in failed.value.details()
        assert time.monotonic() - sent_at <= timeout_s + SLACK_S  # not the 300 s silence limit
        assert servicer.wait(30) == 1
    finally:
        servicer.stop()


def test_an_engine_paused_for_less_than_the_timeout_stays_serving(tmp_path, test_model_dir):
    timeout_s = 6.0
    servicer = idle_servicer(tmp_path, test_model_dir, timeout_s)
    try:
        engine = engine_pid(servicer.journal)
        wait_until(lambda: probes_sent(servicer) >= 1, 5 * PROBE_S + SLACK_S, "a first probe")
        with frozen(engine):
            # A probe awaits it while it is stopped, then it runs again well inside the timeout.
            wait_until(lambda: a_probe_awaits_the_stopped_engine(servicer), PROBE_S + SLACK_S,
                       "a probe awaiting the paused engine")  # fmt: skip
        after = probes_sent(servicer)
        # Two more probes mean the one it got while stopped was answered (one is outstanding at a time).
        wait_until(lambda: probes_sent(servicer) >= after + 2, timeout_s + 4 * PROBE_S + SLACK_S,
                   "probes answered after SIGCONT", interval_s=0.05)  # fmt: skip
        assert health_status(servicer) == health_pb2.HealthCheckResponse.SERVING
        assert servicer.process.poll() is None
        replies = list(servicer.stub.Generate(generate_request("after-pause", PROMPT, max_tokens=4), timeout=30))
        assert replies[-1].complete.finish_reason == "length"
    finally:
        servicer.stop()


def test_one_frozen_dp_rank_is_noticed_though_the_other_answers(tmp_path, test_model_dir):
    """Two DP ranks, each its own process: SIGSTOP one while idle. The other rank's answers
    do not cover it; the servicer goes NOT_SERVING and exits 1, naming the frozen rank."""
    timeout_s = 2.0
    servicer = idle_servicer(tmp_path, test_model_dir, timeout_s, engine_args=["--data-parallel-size", "2"])
    ranks: dict[str, Pidfd] = {}
    try:
        pids = wait_until(lambda: dict(re.findall(r"DP rank (\d+) started: pid (\d+)", servicer.log())),
                          10, "both ranks' pids in the log")
        ranks = {rank: Pidfd(int(pid)) for rank, pid in pids.items()}
        wait_until(lambda: probes_sent(servicer) >= 3, 10 * PROBE_S + SLACK_S, "three answered probes")
        assert health_status(servicer) == health_pb2.HealthCheckResponse.SERVING
        ranks["1"].send(signal.SIGSTOP)
        wait_until(lambda: not_serving(servicer), PROBE_S + timeout_s + SLACK_S,
                   "health NOT_SERVING after one rank froze", interval_s=0.05)  # fmt: skip
        assert servicer.wait(PROBE_S + timeout_s + SLACK_S + 10) == 1
        assert "engine DP rank 1 answered no liveness probe" in servicer.log()
    finally:
        for rank in ranks.values():  # a stopped process would hold the servicer's stop to its grace
            rank.send(signal.SIGCONT)  # by pidfd: the servicer killed its ranks, their pids may be others' now
            rank.close()
        servicer.stop()
