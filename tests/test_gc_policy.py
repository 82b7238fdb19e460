"""The servicer's garbage-collector policy, as an operator sees it: the metrics, and a bad knob refused.

At SERVING the servicer freezes its start-up heap and raises the young
collection threshold (runtime/lifetime/gc_policy.py; the cause in
docs/benchmarks-history.md, "Stop 17"); ``ENGINELINK_GC_FREEZE=0`` with
``ENGINELINK_GC_YOUNG=700`` gives Python's own collector back.
"""

from __future__ import annotations

import pytest

from enginelink.runtime.lifetime.gc_policy import YOUNG_DEFAULT, GcPolicy
from tests.harness import Servicer, free_port, generate_request, scrape
from tests.test_operator import refused_with_one_line, serve
from tests.test_readiness_metrics import sample

PROMPT = [318, 283, 1552, 10, 90, 305]


def gc_gauges(metrics_port: int) -> dict[str, float]:
    samples = scrape(metrics_port)
    return {name: sample(samples, f"smg_servicer_gc_{name}")
            for name in ("frozen_objects", "young_threshold", "collections_young", "collections_full")}


def gc_gauges_after_calls(servicer: Servicer, metrics_port: int, calls: int = 20) -> dict[str, float]:
    """``calls`` calls of 64 tokens, then the gauges."""
    for i in range(calls):
        list(servicer.stub.Generate(generate_request(f"r-{i}", PROMPT, max_tokens=64, ignore_eos=True), timeout=30))
    return gc_gauges(metrics_port)


def serving_with_metrics(tmp_path, test_model_dir, env: dict[str, str]) -> tuple[Servicer, int]:
    metrics_port = free_port()
    servicer = Servicer(tmp_path, model_dir=test_model_dir, extra=["--metrics-port", str(metrics_port)],
                        env={"ENGINELINK_WARMUP": "off", **env}).start()
    return servicer, metrics_port


@pytest.mark.process
def test_a_serving_servicer_has_frozen_its_start_up_heap_and_collects_young_objects_less_often(tmp_path,
                                                                                              test_model_dir):
    servicer, metrics_port = serving_with_metrics(tmp_path, test_model_dir, {})
    try:
        before = gc_gauges(metrics_port)
        # Start-up's heap (tokenizer, protobuf descriptors, grpclib, ...) is tens of thousands of objects.
        assert before["frozen_objects"] > 10_000, before
        assert before["young_threshold"] == YOUNG_DEFAULT
        after = gc_gauges_after_calls(servicer, metrics_port)
        # Python's own threshold (700) takes about 5 young collections for 20 such calls (the test below).
        assert after["collections_young"] - before["collections_young"] <= 2, (before, after)
        # Frozen once, at SERVING: the count only falls, as frozen objects are freed.
        assert after["frozen_objects"] <= before["frozen_objects"], (before, after)
    finally:
        servicer.stop()


@pytest.mark.process
def test_the_knobs_give_pythons_own_collector_back(tmp_path, test_model_dir):
    servicer, metrics_port = serving_with_metrics(tmp_path, test_model_dir,
                                                  {"ENGINELINK_GC_FREEZE": "0", "ENGINELINK_GC_YOUNG": "700"})
    try:
        before = gc_gauges(metrics_port)
        assert before["frozen_objects"] == 0 and before["young_threshold"] == 700, before
        # 80 calls: about 20 young collections at Python's threshold (5 per 20 calls, measured), where the
        # default policy's threshold makes at most 2 for 20 calls (the test above).
        after = gc_gauges_after_calls(servicer, metrics_port, calls=80)
        assert after["collections_young"] - before["collections_young"] >= 10, (before, after)
    finally:
        servicer.stop()


@pytest.mark.process
@pytest.mark.parametrize("env, named", [
    ({"ENGINELINK_GC_YOUNG": "lots"}, "ENGINELINK_GC_YOUNG='lots'"),
    ({"ENGINELINK_GC_YOUNG": "0"}, "ENGINELINK_GC_YOUNG=0"),
    ({"ENGINELINK_GC_FREEZE": "sometimes"}, "ENGINELINK_GC_FREEZE='sometimes'"),
])
def test_a_bad_gc_knob_is_refused_before_anything_starts(tmp_path, test_model_dir, env, named):
    line = refused_with_one_line(serve(tmp_path, "--port", free_port(), "--model", test_model_dir, env=env))
    assert named in line, line


def test_the_policy_reads_its_knobs():
    assert GcPolicy.from_env({}) == GcPolicy(freeze=True, young=YOUNG_DEFAULT)
    assert GcPolicy.from_env({"ENGINELINK_GC_FREEZE": "off", "ENGINELINK_GC_YOUNG": " 700 "}) == GcPolicy(False, 700)
