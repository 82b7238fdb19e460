"""Trace continuation, in process: a Generate call's span, continued from the client's ``traceparent``.

The real gRPC front (``tests/grpc_pair.py``: grpclib with the fast path on
or off, the sim engine in memory) with tracing on, exporting through the
OpenTelemetry SDK's OTLP/gRPC exporter to a receiver this test starts
(``tests/otlp_receiver.py``); a grpcio client sends the W3C trace context in
its metadata, as the SMG router does when it traces. What is asserted is
what a tracing backend would show: the span's trace and parent, its
attributes and its events, against what the client itself received.
``tests/router/test_router_traces.py`` puts the real router in front;
``tests/test_tracing_contracts.py`` runs the other contracts.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest
import trio
from smg_grpc_proto.generated import mlx_engine_pb2, mlx_engine_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb, vllm_engine_pb2_grpc as pb_grpc

from enginelink.runtime.engine.model_dir import load_tokenizer, read_model_facts
from enginelink.runtime.lifetime.tracing import Tracing, TracingError, TracingPlan, check_settings
from enginelink.runtime.contracts.mlx.service import MlxEngineService
from tests.grpc_pair import grpc_pair
from tests.harness import generate_request
from tests.otlp_receiver import OtlpReceiver

PROMPT = [318, 283, 1552, 10, 90, 305]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
SERVER = 2  # SpanKind.SERVER in OTLP's numbering
# Short batches: the receiver sees a span within ~0.1 s of its end (the SDK's default waits 5 s).
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


@pytest.fixture(scope="module")
def model(test_model_dir):
    facts = read_model_facts(test_model_dir)
    return facts, load_tokenizer(facts.tokenizer_path)


@pytest.fixture
def receiver():
    with OtlpReceiver() as running:
        yield running


def _trace(pair, endpoint: str, monkeypatch, service: str = "vllm.grpc.engine.VllmEngine") -> Tracing:
    for name, value in FAST_EXPORT.items():
        monkeypatch.setenv(name, value)
    tracing = Tracing(TracingPlan(endpoint, rpc_service=service, model="test-model"),
                      wall_time=pair.app.wall_time, decode=pair.link.codec.decode_output)
    tracing.attach(pair.app.journal)
    pair.app.tracing = tracing
    return tracing


def _call(port: int, request, metadata=(), cancel_after: int | None = None):
    """The replies of one Generate (a thread: grpcio blocks); ``cancel_after`` replies: the client hangs up."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.VllmEngineStub(channel)
        call = stub.Generate(request, metadata=list(metadata), timeout=20)
        replies = []
        try:
            for reply in call:
                replies.append(reply)
                if cancel_after is not None and len(replies) >= cancel_after:
                    call.cancel()
                    break
        except grpc.RpcError as error:
            return replies, error.code()
        return replies, grpc.StatusCode.OK if cancel_after is None else grpc.StatusCode.CANCELLED


async def _span_of(receiver: OtlpReceiver, request_id: str):
    return await trio.to_thread.run_sync(
        lambda: receiver.wait_for(lambda s: s.attributes.get("gen_ai.request.id") == request_id, 10,
                                  f"the span of {request_id}"))


def _chunks(attributes) -> list[tuple]:
    """``enginelink.chunk.list`` read back: (ms after the span's start, tokens[, choice]) per chunk."""
    return [(float(at), *map(int, rest)) for at, *rest in
            (entry.split(":") for entry in attributes["enginelink.chunk.list"].split())]


def _names(span) -> list[str]:
    return [name for name, _, _ in span.events]


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "grpclib"])
async def test_a_streamed_call_continues_the_clients_trace_with_its_life_as_events(model, receiver, monkeypatch,
                                                                                    fast_path):
    facts, tokenizer = model
    async with grpc_pair(facts, tokenizer, fast_path=fast_path) as pair:
        tracing = _trace(pair, receiver.endpoint, monkeypatch)
        request = generate_request("traced-1", PROMPT, stream=True, max_tokens=12, ignore_eos=True)
        replies, code = await trio.to_thread.run_sync(
            lambda: _call(pair.port, request, [("traceparent", TRACEPARENT), ("tracestate", "vendor=x")]))
        assert code == grpc.StatusCode.OK
        span = await _span_of(receiver, "traced-1")
        await tracing.aclose()
    # The router's trace, continued: its trace id, the caller's span as parent; a server span of its own.
    assert (span.trace_id, span.parent_span_id) == (TRACE_ID, PARENT_ID)
    assert span.span_id != PARENT_ID and span.name == "llm_request" and span.kind == SERVER
    assert span.service == "enginelink" and span.status_code == 0
    chunks = [r.chunk for r in replies if r.WhichOneof("response") == "chunk"]
    streamed = sum(len(c.token_ids) for c in chunks)
    attributes = span.attributes
    assert attributes["gen_ai.request.id"] == "traced-1"
    assert attributes["gen_ai.request.n"] == 1 and attributes["gen_ai.request.max_tokens"] == 12
    assert attributes["gen_ai.usage.prompt_tokens"] == len(PROMPT)
    assert attributes["gen_ai.usage.completion_tokens"] == streamed == 12
    assert attributes["enginelink.finish_reasons"] == ["length"]
    assert attributes["enginelink.engine.ranks"] == [0] and attributes["enginelink.stream"] is True
    assert attributes["rpc.system"] == "grpc" and attributes["rpc.method"] == "Generate"
    assert attributes["rpc.service"] == "vllm.grpc.engine.VllmEngine" and attributes["rpc.grpc.status_code"] == 0
    assert attributes["gen_ai.response.model"] == "test-model"
    assert 0 < attributes["gen_ai.latency.time_to_first_token"] <= attributes["gen_ai.latency.e2e"]
    assert attributes["gen_ai.latency.time_in_queue"] >= 0 and attributes["gen_ai.latency.time_in_model_prefill"] >= 0
    # The call's life, in order, within the span: admitted, queued in the engine (its rank), scheduled by
    # the engine, the first token, the finish.
    assert _names(span) == ["admitted", "engine.queued", "engine.scheduled", "first_token", "finished"]
    events = {name: (at, attrs) for name, at, attrs in span.events}
    assert events["engine.queued"][1] == {"enginelink.engine.ranks": [0]}
    assert events["first_token"][1] == {"enginelink.choice": 0, "enginelink.engine.rank": 0}
    assert events["finished"][1] == {"enginelink.choice": 0, "enginelink.finish_reason": "length",
                                     "gen_ai.usage.completion_tokens": 12}
    times = [at for _, at, _ in span.events]
    assert span.start_ns <= times[0] and times == sorted(times) and times[-1] <= span.end_ns
    # Each chunk (an engine output with tokens): when, in ms after the span's start, and its token count.
    chunks = _chunks(attributes)
    assert all(len(chunk) == 2 for chunk in chunks)  # one choice: no choice named
    offsets, tokens = [at for at, _ in chunks], [n for _, n in chunks]
    assert sum(tokens) == 12 and len(chunks) == attributes["enginelink.chunks"] and offsets == sorted(offsets)
    first_ms = (events["first_token"][0] - span.start_ns) / 1e6
    assert abs(offsets[0] - first_ms) < 0.01 and offsets[-1] <= (span.end_ns - span.start_ns) / 1e6


async def test_a_call_without_a_trace_context_starts_a_trace_and_an_unsampled_one_is_not_exported(
        model, receiver, monkeypatch):
    facts, tokenizer = model
    async with grpc_pair(facts, tokenizer, fast_path=True) as pair:
        tracing = _trace(pair, receiver.endpoint, monkeypatch)
        unsampled = f"00-{TRACE_ID}-{PARENT_ID}-00"
        for request_id, metadata in (("unsampled", [("traceparent", unsampled)]), ("root", [])):
            _, code = await trio.to_thread.run_sync(
                lambda: _call(pair.port, generate_request(request_id, PROMPT, max_tokens=3), metadata))
            assert code == grpc.StatusCode.OK
        span = await _span_of(receiver, "root")
        await tracing.aclose()
        stats = tracing.stats()
    assert span.parent_span_id == "" and span.trace_id not in ("", TRACE_ID)
    assert [s.attributes.get("gen_ai.request.id") for s in receiver.received()] == ["root"]
    assert (stats.spans, stats.spans_unsampled, stats.spans_dropped) == (1, 1, 0)


async def test_refused_aborted_and_n_2_calls_say_how_they_went(model, receiver, monkeypatch):
    facts, tokenizer = model
    monkeypatch.setenv("ENGINELINK_TRACE_CHUNKS_MAX", "3")
    async with grpc_pair(facts, tokenizer, fast_path=True) as pair:
        tracing = _trace(pair, receiver.endpoint, monkeypatch)
        parent = [("traceparent", TRACEPARENT)]
        bad = generate_request("bad-temperature", PROMPT, max_tokens=3, temperature=-1.0)
        _, code = await trio.to_thread.run_sync(lambda: _call(pair.port, bad, parent))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        two = generate_request("two", PROMPT, max_tokens=4, n=2, ignore_eos=True)
        _, code = await trio.to_thread.run_sync(lambda: _call(pair.port, two, parent))
        assert code == grpc.StatusCode.OK
        long = generate_request("hung-up", PROMPT, stream=True, max_tokens=2000, ignore_eos=True)
        _, code = await trio.to_thread.run_sync(lambda: _call(pair.port, long, parent, cancel_after=2))
        spans = await trio.to_thread.run_sync(lambda: _wait_count(receiver, 3))
        await tracing.aclose()
    by_id = {s.attributes.get("gen_ai.request.id"): s for s in spans}
    refused = next(s for s in spans if "refused" in _names(s))
    assert refused.trace_id == TRACE_ID and refused.attributes["rpc.grpc.status_code"] == 3
    assert refused.status_code == 0  # the client's error: not the server span's (OpenTelemetry's gRPC rules)
    (_, _, said), = [e for e in refused.events if e[0] == "refused"]
    assert said["enginelink.code"] == "INVALID_ARGUMENT" and "temperature" in said["enginelink.message"]
    assert _names(refused) == ["refused"]
    pair_span = by_id["two"]
    assert pair_span.attributes["enginelink.finish_reasons"] == ["length", "length"]
    assert pair_span.attributes["gen_ai.usage.completion_tokens"] == 8
    assert sorted(a["enginelink.choice"] for n, _, a in pair_span.events if n in ("first_token",)) == [0, 1]
    assert sorted(a["enginelink.choice"] for n, _, a in pair_span.events if n in ("finished",)) == [0, 1]
    # 8 chunks (4 tokens a choice, one a step), the first 3 listed, each with its choice.
    assert pair_span.attributes["enginelink.chunks"] == 8
    listed = _chunks(pair_span.attributes)
    assert len(listed) == 3 and all(n == 1 and choice in (0, 1) for _, n, choice in listed), listed
    gone = by_id["hung-up"]
    assert gone.attributes["enginelink.abort_reason"] == "client_gone"
    assert gone.attributes["rpc.grpc.status_code"] == 1  # CANCELLED
    assert "aborted" in _names(gone) and "finished" not in _names(gone)


def _wait_count(receiver: OtlpReceiver, count: int, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        spans = receiver.received()
        if len(spans) >= count:
            return spans
        time.sleep(0.05)
    raise TimeoutError(f"{count} spans not received within {timeout_s} s: {receiver.received()}")


async def test_the_mlx_contract_traces_its_calls_too(model, receiver, monkeypatch):
    """MlxEngine's Generate is the shared one (``ContractService.Generate``): its calls get the same span."""
    facts, tokenizer = model
    async with grpc_pair(facts, tokenizer, fast_path=True, service=MlxEngineService) as pair:
        tracing = _trace(pair, receiver.endpoint, monkeypatch, service="mlx.grpc.engine.MlxEngine")
        request = mlx_engine_pb2.GenerateRequest(
            request_id="mlx-1", tokenized=mlx_engine_pb2.TokenizedInput(input_ids=PROMPT), stream=True,
            sampling_params=mlx_engine_pb2.SamplingParams(max_tokens=5, ignore_eos=True))

        def call():
            with grpc.insecure_channel(f"127.0.0.1:{pair.port}") as channel:
                return list(mlx_engine_pb2_grpc.MlxEngineStub(channel).Generate(
                    request, metadata=[("traceparent", TRACEPARENT)], timeout=20))

        replies = await trio.to_thread.run_sync(call)
        span = await _span_of(receiver, "mlx-1")
        await tracing.aclose()
    assert replies[-1].WhichOneof("response") == "complete"
    assert (span.trace_id, span.parent_span_id) == (TRACE_ID, PARENT_ID)
    assert span.attributes["rpc.service"] == "mlx.grpc.engine.MlxEngine"
    assert span.attributes["gen_ai.usage.completion_tokens"] == 5
    assert _names(span)[:2] == ["admitted", "engine.queued"] and _names(span)[-1] == "finished"


async def test_a_failure_of_tracings_own_never_reaches_the_call(model, receiver, monkeypatch):
    """A bug in the fold or in filling the span is counted and logged once; the client's call ends as it would."""
    from enginelink.runtime.lifetime.trace_fold import CallTrace

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in tracing")

    monkeypatch.setattr(CallTrace, "_output", broken)
    monkeypatch.setattr(Tracing, "_attributes", broken)
    facts, tokenizer = model
    async with grpc_pair(facts, tokenizer, fast_path=True) as pair:
        tracing = _trace(pair, receiver.endpoint, monkeypatch)
        request = generate_request("unlucky", PROMPT, stream=True, max_tokens=4, ignore_eos=True)
        replies, code = await trio.to_thread.run_sync(
            lambda: _call(pair.port, request, [("traceparent", TRACEPARENT)]))
        spans = await trio.to_thread.run_sync(lambda: _wait_count(receiver, 1))
        await tracing.aclose()
        stats = tracing.stats()
    assert code == grpc.StatusCode.OK and replies[-1].complete.finish_reason == "length"
    assert sum(len(r.chunk.token_ids) for r in replies if r.WhichOneof("response") == "chunk") == 4
    assert stats.errors >= 2 and stats.spans == 1  # each output's fold, and the span's attributes
    assert spans[0].trace_id == TRACE_ID  # it still went out, with what it had


def test_an_engine_restart_under_a_call_is_two_events_on_its_span_held_then_resumed():
    """The journal's engine.held / engine.resume of a call (docs/resume.md) fold into its span's events: a
    tracing backend shows the seam where the stream waited for the restarted engine."""
    from enginelink.journal import records as r
    from enginelink.runtime.lifetime.trace_fold import CallTrace, TraceTap
    from enginelink.runtime.lifetime.tracing import _events

    tap, call = TraceTap(decode=lambda frames: None), CallTrace(span=None, started_at=0.0, chunks_max=16)
    token = tap.begin(call)
    stream = r.request_stream("resumed-1")
    tap.record(1, 1.0, stream, r.KIND_CLIENT_GENERATE, {"request_id": "resumed-1", "n": 1, "prompt_tokens": 6,
                                                         "stream": True, "max_tokens": 40})
    tap.record(2, 1.1, stream, r.KIND_ENGINE_REQUEST, {"request_ids": ["resumed-1"], "ranks": [0]})
    tap.record(3, 2.0, stream, r.KIND_ENGINE_HELD, {"link": "engine-0", "request_id": "resumed-1",
                                                     "engine_ids": ["resumed-1"], "tokens": [17]})
    tap.record(4, 5.0, stream, r.KIND_ENGINE_RESUME, {"link": "engine-0", "request_id": "resumed-1",
                                                       "engine_ids": ["resumed-1"], "indexes": [0], "reprefilled": [17],
                                                       "prompt_tokens": [23], "ranks": [0], "resumes": 1})
    tap.end(call, token)
    assert [(name, at, attrs) for name, at, attrs in _events(call, 128) if name.startswith("engine.")] == [
        ("engine.queued", 1.1, {"enginelink.engine.ranks": [0]}),
        ("engine.held", 2.0, {"enginelink.tokens": [17]}),
        ("engine.resumed", 5.0, {"enginelink.reprefilled": [17], "enginelink.engine.ranks": [0]}),
    ]
