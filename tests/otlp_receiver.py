"""An OTLP trace receiver for tests: ``opentelemetry.proto.collector.trace.v1.TraceService/Export`` over gRPC.

A grpcio server on 127.0.0.1 (a port of its own) that keeps every span it
is sent, with its resource's ``service.name``, as a collector would get
them. ``wait_for(predicate)`` polls (bounded) until a span matches. Used by
the tracing tests, in front of which a servicer, the SMG router or both
export (``--otlp-traces-endpoint http://127.0.0.1:<port>``).
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.harness import wait_until


@dataclass
class ReceivedSpan:
    """One span as the receiver got it: ids as hex, attributes and events as plain values."""

    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)  # (name, time ns, attributes)
    dropped_events: int = 0


def _value(any_value) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    if kind is None:
        return None
    return getattr(any_value, kind)


def _attributes(pairs) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


class _Service(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: "OtlpReceiver") -> None:
        self.receiver = receiver

    def Export(self, request, context):
        spans = []
        for resource_spans in request.resource_spans:
            service = _attributes(resource_spans.resource.attributes).get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(ReceivedSpan(
                        service=service, name=span.name, kind=span.kind, trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(), parent_span_id=span.parent_span_id.hex(),
                        start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano,
                        status_code=span.status.code, status_message=span.status.message,
                        attributes=_attributes(span.attributes),
                        events=[(e.name, e.time_unix_nano, _attributes(e.attributes)) for e in span.events],
                        dropped_events=span.dropped_events_count,
                    ))  # fmt: skip
        with self.receiver.lock:
            self.receiver.spans.extend(spans)
            self.receiver.exports += 1
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """``with OtlpReceiver() as receiver:`` a collector on ``receiver.endpoint`` until the block ends."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[ReceivedSpan] = []
        self.exports = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Service(self), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "OtlpReceiver":
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop(grace=None)

    def received(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)

    def wait_for(self, predicate: Callable[[ReceivedSpan], bool], timeout_s: float = 20.0,
                 what: str = "a span") -> ReceivedSpan:
        def find():
            return next((span for span in self.received() if predicate(span)), None)

        return wait_until(find, timeout_s, what)
