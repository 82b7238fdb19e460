"""Tracing's configuration and bounds: where ``--otlp-traces-endpoint`` comes from, what is refused, a full queue.

- ``vllm serve --grpc --servicer-impl enginelink --otlp-traces-endpoint URL``:
  vLLM's own flag (an engine argument) reaches the servicer, and the engine
  keeps it (``tools/vllm_grpc_launcher.py``), as ``--allowed-media-domains``;
- ``enginelink serve --engine vllm -- --otlp-traces-endpoint URL`` the same;
  two different ones are refused;
- the SDK's variables that would fail later exit 2 at start;
- a collector that stalls: the SDK's span queue is bounded
  (``OTEL_BSP_MAX_QUEUE_SIZE``), a span that would find it full is dropped
  at once (the handler never waits), counted, and said at 1, 2, 4, 8, …
  drops.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time

import pytest
import trio

from enginelink.runtime.lifetime.tracing import Tracing, TracingError, TracingPlan, check_settings, queue_max
from enginelink.tools import serve, vllm_plugin
from enginelink.tools.vllm_grpc_launcher import serve_namespace, split_engine_args
from tests.test_vllm_plugin import ENGINE_DESTS, serve_parser

URL = "http://collector.example:4317"


def test_vllms_own_flag_reaches_the_servicer_and_the_engine_keeps_it():
    parser = serve_parser()
    parser.add_argument("--otlp-traces-endpoint")  # vLLM's engine argument (ObservabilityConfig), as its parser has it
    vllm_plugin.add_flags(parser)
    args = ["/models/m", "--grpc", "--servicer-impl", "enginelink", "--otlp-traces-endpoint", URL,
            "--max-model-len", "1024"]
    parsed = parser.parse_args(args)
    parsed.model = parsed.model_tag
    kept, unused = split_engine_args(parser, args, ENGINE_DESTS | {"otlp_traces_endpoint"})
    assert kept == ["--otlp-traces-endpoint", URL, "--max-model-len", "1024"] and unused == []
    ns = serve_namespace(parsed, kept, selected_by="flag")
    assert ns.otlp_traces_endpoint == URL
    assert serve._traces_endpoint(argparse.Namespace(**{**vars(ns), "engine": "vllm"})) == URL
    # Without the flag, tracing stays off.
    plain = parser.parse_args(["/models/m", "--grpc"])
    plain.model = plain.model_tag
    assert serve_namespace(plain, []).otlp_traces_endpoint is None


def test_serve_takes_its_flag_else_a_vllm_engines_and_refuses_two_that_differ():
    def endpoint(engine: str, ours: str | None, engine_args: list[str]) -> str | None:
        return serve._traces_endpoint(argparse.Namespace(engine=engine, otlp_traces_endpoint=ours,
                                                         engine_args=engine_args))

    assert endpoint("sim", None, []) is None
    assert endpoint("sim", URL, []) == URL
    assert endpoint("vllm", None, ["--otlp-traces-endpoint", URL]) == URL
    assert endpoint("vllm", URL, [f"--otlp-traces-endpoint={URL}"]) == URL
    assert endpoint("sim", None, ["--otlp-traces-endpoint", URL]) is None  # the sim engine's args are its own
    with pytest.raises(serve.ConfigError, match="differ"):
        endpoint("vllm", URL, ["--otlp-traces-endpoint", "http://other:4317"])
    with pytest.raises(serve.ConfigError, match="no collector"):
        endpoint("sim", " ", [])


@pytest.mark.parametrize("environ, words", [
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTLP/gRPC only"),
    ({"OTEL_BSP_MAX_QUEUE_SIZE": "lots"}, "OTEL_BSP_MAX_QUEUE_SIZE='lots': expected a positive number"),
    ({"OTEL_BSP_MAX_QUEUE_SIZE": "100"}, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE=512 is more than OTEL_BSP_MAX_QUEUE_SIZE=100"),
    ({"ENGINELINK_TRACE_CHUNKS_MAX": "-1"}, "ENGINELINK_TRACE_CHUNKS_MAX='-1': expected 0 to 65536 chunks"),
])
def test_settings_that_would_fail_later_are_refused_at_start(environ, words):
    with pytest.raises(TracingError, match=words.replace("(", r"\(").replace(")", r"\)")):
        check_settings(environ)


def test_the_settings_the_sdk_takes_as_they_are():
    check_settings({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    check_settings({"OTEL_BSP_MAX_QUEUE_SIZE": "16", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "8"})
    assert queue_max({}) == 2048 and queue_max({"OTEL_BSP_MAX_QUEUE_SIZE": "16"}) == 16


class StalledExporter:
    """A collector that takes the first batch and never answers (until released)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.batches = 0

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.batches += 1
        self.release.wait(30)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        self.release.set()

    def force_flush(self, timeout_millis=None):
        return True


async def test_a_full_queue_drops_spans_at_once_counts_them_and_says_so_at_each_doubling(monkeypatch, caplog):
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "4")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2")
    exporter = StalledExporter()
    tracing = Tracing(TracingPlan("http://unused:4317"), wall_time=lambda now: 1.7e9 + now,
                      decode=lambda frames: None, exporter=exporter)
    ends = []
    with caplog.at_level(logging.WARNING):
        for index in range(40):
            started = time.perf_counter()
            with tracing.call({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}):
                pass
            ends.append(time.perf_counter() - started)  # the span's start and end, the queue's hand-off included
            await trio.sleep(0)
    stats = tracing.stats()
    taken = tracing.exporter.taken  # 0, or the one batch the stalled export holds
    exporter.release.set()
    await tracing.aclose()
    said = [r.getMessage() for r in caplog.records if "trace export queue full" in r.getMessage()]
    assert stats.queue_max == 4 and taken in (0, 2) and stats.spans == 4 + taken and stats.spans_queued == 4
    assert max(ends) < 0.05, max(ends)  # never the stalled export's 30 s
    assert stats.spans_dropped == 40 - stats.spans  # the rest: dropped at once, not waited for
    assert len(said) == stats.spans_dropped.bit_length(), said  # at 1, 2, 4, 8, 16, 32 drops: one line each
    assert said[0] == ("trace export queue full (OTEL_BSP_MAX_QUEUE_SIZE=4; the collector at http://unused:4317 "
                       "is slow or away): 1 spans dropped so far")
    assert not [r for r in caplog.records if r.getMessage().startswith("Queue full")]  # the SDK's never overflowed


class EncodingExporter:
    """A collector's view of each batch: its size on the wire, as the OTLP/gRPC exporter would send it."""

    def __init__(self) -> None:
        self.sizes: list[tuple[int, int]] = []  # (spans, bytes)

    def export(self, spans):
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.sizes.append((len(spans), len(encode_spans(spans).SerializeToString())))
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass

    def force_flush(self, timeout_millis=None):
        return True


async def test_a_default_batch_of_long_calls_fits_a_collectors_default_message_limit():
    """512 spans (the SDK's batch) of calls with 256 chunks each (ENGINELINK_TRACE_CHUNKS_MAX) stay under the
    4 MiB a gRPC server (the OpenTelemetry Collector's default too) takes in one message; an event per chunk
    made a 128-chunk call's batch 6.7 MB, which the bench's receiver refused."""
    exporter = EncodingExporter()
    tracing = Tracing(TracingPlan("http://unused:4317", rpc_service="vllm.grpc.engine.VllmEngine", model="m"),
                      wall_time=lambda now: 1.7e9 + now, decode=lambda frames: None, exporter=exporter, environ={})

    class Frame:  # what an output's fold reads of its batch: no engine events here
        timestamp = 0.0

    for index in range(512):
        with tracing.call({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}) as trace:
            trace.rid = f"long-call-{index:08d}"
            trace._admitted(trace.started_at, {"n": 1, "prompt_tokens": 1000, "max_tokens": 4096, "stream": True})
            trace.queued_at, trace.ranks = trace.started_at, [0]
            for step in range(300):
                trace._output(trace.started_at + 0.05 + step * 0.0123, 0, 1, None, Frame)
            trace.finished.append((trace.started_at + 4.0, 0, "length", 300))
    await tracing.aclose()
    assert sum(spans for spans, _ in exporter.sizes) == 512
    spans, size = max(exporter.sizes, key=lambda batch: batch[1])
    assert size < 4 * 1024 * 1024, (spans, size)
    assert trace.chunks_total == 300 and len(trace.chunks) == 256
