"""The real SMG router never takes an idle worker for a wedged one (issue 22, item 2).

The router judges a worker's liveness from the ``EngineLoad`` records of its
``SubscribeKvEvents`` stream: a record whose ``engine_silence_ms`` is past
the router's wedge bound (``worker_wedge_secs``, 3 s by default in smg
1.13.0) vetoes the worker ("Worker vetoed by liveness … reason=\"wedged\"").
The field means silence *while requests are in flight* (common.proto, field
19); an idle engine is silent by nature. enginelink used to send the time
since the engine's last frame in every heartbeat, so the router vetoed its
one worker at start-up and a few seconds after every burst, and routed the
next request by its "all stalled" fallback.

Here one sim worker behind the router idles after start-up and after a
burst, each time for longer than the wedge bound, until the router has
received a load record sent after that much idleness; the router must never
log a veto, and a request after the idle spell must be routed normally.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.harness import Router, Servicer, wait_until
from tests.router.openai_http import post

pytestmark = [pytest.mark.router, pytest.mark.slow]

COMPLETIONS = "/v1/completions"
# smg 1.13.0's default ``worker_wedge_secs``: engine silence (with work) past it vetoes a worker.
ROUTER_WEDGE_S = 3.0
# enginelink's heartbeats back off to one per 5 s (runtime/kv/kv_loads.py HEARTBEAT_BACKOFF_S).
HEARTBEAT_WAIT_S = 15.0
VETO = re.compile(r"vetoed by liveness|Veto fallback")
LOAD_RECORD = "update_dp_loads"


def _load_records(router: Router) -> int:
    """How many load records the router has taken in so far (one DEBUG line each)."""
    return router.log().count(LOAD_RECORD)


def _idle_past_the_wedge_bound(router: Router, idle_since: float) -> None:
    """Stay idle past the router's wedge bound, then until the router has a load record sent after it."""
    wait_until(lambda: time.monotonic() - idle_since > ROUTER_WEDGE_S + 1.0, ROUTER_WEDGE_S + 5.0,
               "the worker idle past the router's wedge bound", interval_s=0.1)  # fmt: skip
    seen = _load_records(router)
    wait_until(lambda: _load_records(router) > seen, HEARTBEAT_WAIT_S,
               "a load record the router received after the idle spell", interval_s=0.1)  # fmt: skip


def _vetoes(router: Router) -> list[str]:
    return [line for line in router.log().splitlines() if VETO.search(line)]


def test_an_idle_worker_stays_routable_after_start_up_and_after_a_burst(tmp_path, test_model_dir):
    servicer = Servicer(tmp_path, model_dir=test_model_dir).start()
    router = None
    try:
        router = Router(tmp_path, servicer.port, test_model_dir).start()
        wait_until(lambda: _load_records(router) > 0, HEARTBEAT_WAIT_S, "the router's first load record")
        _idle_past_the_wedge_bound(router, time.monotonic())  # start-up: no request yet
        assert _vetoes(router) == []

        body = {"model": test_model_dir.name, "max_tokens": 16, "ignore_eos": True, "temperature": 0}
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda i: post(router.url, COMPLETIONS, {**body, "prompt": f"burst {i}"}),
                                    range(16)))  # fmt: skip
        assert [status for status, _ in replies] == [200] * 16, replies
        _idle_past_the_wedge_bound(router, time.monotonic())

        status, reply = post(router.url, COMPLETIONS, {**body, "prompt": "after the idle spell"})
        assert status == 200, reply
        assert reply["choices"][0]["finish_reason"] == "length"
        # Routed as a live worker, not by the "all workers stalled" fallback, and never vetoed.
        assert _vetoes(router) == [], "\n".join(_vetoes(router))
    finally:
        if router is not None:
            router.stop()
        servicer.stop()
