"""The planned warm-up against a real vLLM engine (the session's servicer runs ``fast``)."""

from __future__ import annotations

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from enginelink.journal.records import KIND_ENGINE_FACTS
from enginelink.journal.store import open_reader
from enginelink.machines.warmup import StepKind, facts_from_ready, plan_warmup
from tests.harness import generate_request

pytestmark = pytest.mark.vllm

VOCAB = 4096


def test_fast_warmup_ran_its_steps_then_serving_and_flushed_the_prefix_cache(vllm_stack):
    servicer, _ = vllm_stack
    log = servicer.log()
    assert "warm-up fast" in log
    ready = open_reader(servicer.journal).records(kinds=[KIND_ENGINE_FACTS])[-1].payload["facts"]
    plan = plan_warmup(facts_from_ready(ready, VOCAB), "fast")
    request_steps = [step for step in plan if step.kind is not StepKind.FLUSH]
    # Steps log at DEBUG; the INFO summary counts the steps that ran: all of the plan's.
    total = len(request_steps)
    assert f": {total} of {total} steps, requests " in log
    assert "prefix cache flushed" in log
    health = health_pb2_grpc.HealthStub(servicer.channel)
    assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING

    # The flush is real: a warm-up prompt of two full blocks is not cached any
    # more, and caching itself works (the same prompt again hits the cache).
    block = int(ready["block_size"])
    warm = next(step.requests[0] for step in request_steps
                if step.kind is StepKind.PREFILL and step.tokens >= 2 * block)
    prompt = warm.prompt_token_ids

    def cached(request_id: str) -> int:
        replies = list(servicer.stub.Generate(generate_request(request_id, prompt, max_tokens=1), timeout=60))
        return replies[-1].complete.cached_tokens

    assert cached("after-warmup-1") == 0
    assert cached("after-warmup-2") >= block
