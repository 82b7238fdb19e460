"""The real SMG router in front, tracing: enginelink's span joins the router's trace, under the router's span.

SMG 1.13.0 with ``--enable-trace --otlp-traces-endpoint`` puts a W3C
``traceparent`` (its own span as the parent) in the gRPC metadata of each
call to its worker; it continues an HTTP client's ``traceparent``, else
starts a trace. Here one OTLP receiver (``tests/otlp_receiver.py``) takes
both the router's spans and ``enginelink serve --otlp-traces-endpoint``'s;
an HTTP client sends a trace context of its own. What a tracing backend
would show: the servicer's span in the client's trace, its parent a span the
router exported, its token counts the ones the client's usage says. Without
``--enable-trace`` the router sends no context: the servicer's span starts a
trace of its own.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.harness import Router, Servicer
from tests.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.router

TRACE_ID = "5b8efff798038103d269b633813fc60c"
CLIENT_SPAN = "eee19b7ec3c1b174"
# The router's batch exporter sends every few seconds; the servicer's every 0.1 s here.
WAIT_S = 30


def _completion(router: Router, model: str, headers: dict[str, str]) -> dict:
    body = json.dumps({"model": model, "prompt": "def foo(x):", "max_tokens": 5, "ignore_eos": True}).encode()
    request = urllib.request.Request(router.url + "/v1/completions", data=body, method="POST",
                                     headers={"content-type": "application/json", **headers})
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert reply.status == 200
        return json.loads(reply.read())


def test_the_servicers_span_is_the_routers_child_in_the_clients_trace(tmp_path, test_model_dir):
    with OtlpReceiver() as receiver:
        servicer = Servicer(tmp_path, model_dir=test_model_dir,
                            extra=["--otlp-traces-endpoint", receiver.endpoint],
                            env={"OTEL_BSP_SCHEDULE_DELAY": "100", "ENGINELINK_WARMUP": "fast"}).start()
        try:
            router = Router(tmp_path, servicer.port, test_model_dir,
                            extra=["--enable-trace", "--otlp-traces-endpoint", f"127.0.0.1:{receiver.port}"]).start()
            try:
                answer = _completion(router, test_model_dir.name,
                                     {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
                ours = receiver.wait_for(lambda s: s.service == "enginelink" and s.trace_id == TRACE_ID, WAIT_S,
                                         "the servicer's span in the client's trace")
                parent = receiver.wait_for(lambda s: s.span_id == ours.parent_span_id, WAIT_S,
                                           f"the router's span {ours.parent_span_id}, the servicer's parent")
            finally:
                router.stop()
        finally:
            servicer.stop()
    # The router's span, between the client's and ours, in the client's trace: the context went through.
    assert parent.service != "enginelink" and parent.trace_id == TRACE_ID
    assert ours.parent_span_id != CLIENT_SPAN
    assert ours.name == "llm_request" and ours.status_code == 0
    usage = answer["usage"]
    assert ours.attributes["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 5
    assert ours.attributes["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert ours.attributes["enginelink.finish_reasons"] == [answer["choices"][0]["finish_reason"]] == ["length"]
    names = [name for name, _, _ in ours.events]
    assert names[:2] == ["admitted", "engine.queued"] and names[-1] == "finished", names
    assert parent.start_ns <= ours.start_ns and ours.end_ns <= parent.end_ns + 50_000_000  # clocks of one host


def test_a_router_that_does_not_trace_sends_no_context_and_the_servicer_starts_a_trace(tmp_path, test_model_dir):
    with OtlpReceiver() as receiver:
        with Servicer(tmp_path, model_dir=test_model_dir, extra=["--otlp-traces-endpoint", receiver.endpoint],
                      env={"OTEL_BSP_SCHEDULE_DELAY": "100", "ENGINELINK_WARMUP": "fast"}) as servicer:
            router = Router(tmp_path, servicer.port, test_model_dir).start()
            try:
                _completion(router, test_model_dir.name, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
                ours = receiver.wait_for(lambda s: s.service == "enginelink", WAIT_S, "the servicer's span")
            finally:
                router.stop()
    assert ours.parent_span_id == "" and ours.trace_id != TRACE_ID
