"""The real SMG router (1.13.0) subscribed to two enginelink workers routes by their KV events.

Each prefix is first generated *directly* on one worker (the router never
sees that request), so the router can only know where it lives from that
worker's SubscribeKvEvents stream. Then requests sharing each prefix go
through the router with ``--policy cache_aware``: each lands on the worker
that holds its prefix (the journals tell which, by prompt length). With KV
events off the router falls back to its approximate tree, which knows
nothing of the primed prefixes. The router keeps its subscriptions (no
"disabling KV event subscription" in its debug log) and takes the
``load_only`` heartbeats.
"""

from __future__ import annotations

import urllib.request

import pytest

from enginelink.journal.records import KIND_CLIENT_GENERATE
from enginelink.journal.store import open_reader
from tests.harness import Router, wait_until
from tests.kv.conftest import NO_WARMUP, kv_servicer
from tests.kv.kv_client import generate, prompt
from tests.router.openai_http import post

pytestmark = pytest.mark.router

PREFIX = 96  # six sim blocks
PRIMED = 6


def router_metric(router: Router, family: str, worker_port: int, **labels) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{router.prometheus_port}/metrics", timeout=2).read().decode()
    for line in text.splitlines():
        if line.startswith(family + "{") and f'worker="grpc://127.0.0.1:{worker_port}"' in line and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def prompt_lengths(servicer) -> list[int]:
    records = open_reader(servicer.journal).records(kinds=[KIND_CLIENT_GENERATE])
    return [r.payload["prompt_tokens"] for r in records]


def test_cache_aware_routing_follows_the_workers_kv_events(tmp_path, test_model_dir):
    workers = [kv_servicer(tmp_path, test_model_dir, env=NO_WARMUP) for _ in range(2)]
    router = None
    try:
        for w in workers:
            w.start()
        router = Router(tmp_path, workers[0].port, test_model_dir, log_level="debug", extra=["--policy", "cache_aware"])
        router.argv.insert(router.argv.index(router.worker_url) + 1, f"grpc://127.0.0.1:{workers[1].port}")
        router.start()
        for w in workers:
            wait_until(lambda: "KV event subscriber" in w.log(), 15, f"the router's subscription to {w.port}")

        prefixes = [prompt(300 + i, PREFIX) for i in range(PRIMED)]
        for i, p in enumerate(prefixes):
            generate(workers[i % 2], f"prime-{i}", p)  # behind the router's back
        for w in workers:
            wait_until(lambda: router_metric(router, "smg_kv_event_batches_total", w.port, disposition="applied") >= 3,
                       15, f"the router applying {w.port}'s batches")  # fmt: skip

        for i, p in enumerate(prefixes):
            body = {"model": test_model_dir.name, "input_ids": p + prompt(400 + i, 8 + i),
                    "sampling_params": {"max_new_tokens": 1}}  # fmt: skip
            status, reply = post(router.url, "/generate", body)
            assert status == 200, reply
        for i in range(PRIMED):
            length = PREFIX + 8 + i
            holder, other = workers[i % 2], workers[1 - i % 2]
            assert wait_until(lambda: length in prompt_lengths(holder), 5, f"request {i} on its prefix's worker")
            assert length not in prompt_lengths(other)

        for w in workers:
            wait_until(lambda: router_metric(router, "smg_kv_event_batches_total", w.port, disposition="load_only") > 0,
                       10, "a load_only heartbeat taken")  # fmt: skip
        log = router.log()
        assert "KV event stream connected" in log
        assert "disabling KV event subscription" not in log
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()
