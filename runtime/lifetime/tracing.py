"""Trace continuation: a span per Generate call in the router's trace, exported with the OpenTelemetry SDK.

On only with ``--otlp-traces-endpoint URL`` (vLLM's flag; ``vllm serve
--grpc --servicer-impl enginelink`` hands vLLM's own over). Off, nothing of
this module or of OpenTelemetry is imported, and the servicer pays one test
per Generate call (``app.tracing is None``) and one per journal append
(``Journal.tap is None``).

On, each Generate call (every contract: ``ContractService.Generate``) gets a
SERVER span named ``llm_request`` (vLLM's front end's name), whose parent is
the W3C ``traceparent``/``tracestate`` in the call's gRPC metadata (the SMG
router sends them when it traces, ``smg launch --enable-trace``), else a new
trace. The SDK's sampler decides (``OTEL_TRACES_SAMPLER``, default
parent-based always-on): an unsampled call costs its ``start_span`` and
nothing more. A sampled call's span is built from the records the servicer
journals anyway (``trace_fold.py``): events ``refused``, ``admitted``,
``engine.queued`` (the ADDs went out, with their ranks),
``engine.scheduled`` (where the engine reports it), ``first_token`` and
``finished`` (its finish reason) per choice, ``aborted`` (its reason);
attributes in vLLM's ``gen_ai.*`` names where vLLM has one, and the chunks
(each engine output with tokens: its time and token count) listed in one
string, ``enginelink.chunk.list`` = ``"<ms after the span's start>:<tokens>
…"`` (``:<choice>`` added where a call has several), the first
``ENGINELINK_TRACE_CHUNKS_MAX`` of them. One string, not an event per chunk
nor an array attribute: a 128-token call's events made a 13 KiB span (the
SDK's default batch of 512 such spans, 6.7 MB, was refused by a collector's
default 4 MiB gRPC receive limit), and the SDK's Python encoder spent 4-6
times as long on the span with two arrays (an AnyValue per element, in the
export thread, which holds the GIL the event loop needs) as with the same
list as one string (about 1.7 KiB). The span ends when the handler leaves,
with its gRPC status.

Export never waits on the event loop: ``span.end`` hands the span to the
SDK's ``BatchSpanProcessor``, a deque bounded by ``OTEL_BSP_MAX_QUEUE_SIZE``
(2048 by default) that its own thread exports in batches
(``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``, every ``OTEL_BSP_SCHEDULE_DELAY`` ms)
through the OTLP/gRPC exporter. Full, the SDK would drop the oldest queued
span for the new one and say so once per 20 s; enginelink keeps it from
filling instead: it knows how many spans it handed over and how many the
processor has taken off to export (``_Counted``, around the exporter), and
a span that would find the queue full is dropped before it is ended (the
newest, not the oldest), counted (``smg_servicer_trace_spans_dropped``) and
said at the 1st, 2nd, 4th, 8th, … drop. At exit the queue gets ``CLOSE_S``
to leave, in a worker thread.

Every ``OTEL_*`` variable is the SDK's own (docs/tracing.md lists the ones
that matter here), except the protocol: OTLP over gRPC only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import msgspec
import trio
from grpclib.exceptions import GRPCError

from enginelink.runtime.errors import to_grpc_error
from enginelink.runtime.lifetime.trace_fold import CallTrace, TraceTap

log = logging.getLogger("enginelink.tracing")

SPAN_NAME = "llm_request"  # vLLM's front end names its request span so
TRACER_NAME = "enginelink"
SERVICE_NAME_DEFAULT = "enginelink"
# At exit, how long the spans still queued get to reach the collector (a worker thread; abandoned after).
CLOSE_S = 5.0
CHUNKS_MAX_ENV = "ENGINELINK_TRACE_CHUNKS_MAX"
CHUNKS_MAX_DEFAULT = 256  # chunks listed per span (time and tokens: ~9 bytes each)
CHUNKS_MAX_LIMIT = 65_536
QUEUE_MAX_ENV = "OTEL_BSP_MAX_QUEUE_SIZE"
QUEUE_MAX_DEFAULT = 2048  # the SDK's default
BATCH_MAX_ENV = "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"
BATCH_MAX_DEFAULT = 512  # the SDK's default
PROTOCOL_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
INSECURE_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE")
# gRPC status codes that make a server span an error (OpenTelemetry's semantic conventions for gRPC).
_SERVER_ERRORS = frozenset({"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"})


class TracingError(ValueError):
    """The tracing configuration cannot work; the message names the setting."""


@dataclass(frozen=True)
class TracingPlan:
    """What ``--otlp-traces-endpoint`` asked: the collector, and what the spans say of this servicer."""

    endpoint: str
    rpc_service: str = ""  # the contract's gRPC service, e.g. vllm.grpc.engine.VllmEngine
    model: str = ""  # the served model name


def check_settings(environ: Mapping[str, str] = os.environ) -> None:
    """What would make the exporter fail later, refused at start (exit 2): a protocol other than OTLP/gRPC
    (rather than ignored), a queue bound that is no number or smaller than the export batch."""
    for name in PROTOCOL_ENVS:
        value = environ.get(name, "").strip().lower()
        if value:
            if value != "grpc":
                raise TracingError(f"{name}={value!r}: enginelink exports traces over OTLP/gRPC only (grpc)")
            break
    chunks_max(environ)
    bound = queue_max(environ)
    batch = _positive(environ, BATCH_MAX_ENV, BATCH_MAX_DEFAULT)
    if batch > bound:
        raise TracingError(f"{BATCH_MAX_ENV}={batch} is more than {QUEUE_MAX_ENV}={bound}: a batch comes out of "
                           "the queue")


def chunks_max(environ: Mapping[str, str] = os.environ) -> int:
    """``ENGINELINK_TRACE_CHUNKS_MAX``: chunks listed per span (0: none, only their count)."""
    raw = environ.get(CHUNKS_MAX_ENV, "").strip()
    if not raw:
        return CHUNKS_MAX_DEFAULT
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= CHUNKS_MAX_LIMIT:
        raise TracingError(f"{CHUNKS_MAX_ENV}={raw!r}: expected 0 to {CHUNKS_MAX_LIMIT} chunks")
    return value


def queue_max(environ: Mapping[str, str] = os.environ) -> int:
    """The span queue's bound: ``OTEL_BSP_MAX_QUEUE_SIZE`` (the SDK's variable, read here so that /metrics
    can show it), else the SDK's default."""
    return _positive(environ, QUEUE_MAX_ENV, QUEUE_MAX_DEFAULT)


def _positive(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise TracingError(f"{name}={raw!r}: expected a positive number of spans")
    return value


class TraceStats(msgspec.Struct, frozen=True):
    """``/metrics``: ``smg_servicer_trace_<field>``."""

    spans: int  # spans ended and handed to the export queue
    spans_unsampled: int  # calls the sampler left out (no span recorded)
    spans_dropped: int  # spans dropped because the export queue was full (OTEL_BSP_MAX_QUEUE_SIZE)
    spans_queued: int  # spans in the export queue now
    queue_max: int  # the queue's bound
    chunks_max: int  # chunks listed per span (ENGINELINK_TRACE_CHUNKS_MAX)
    errors: int  # tracing's own failures (a record it could not fold, a span it could not fill): a bug, the first logged


class _Counted:
    """The exporter, counting the spans the batch processor took off its queue to export (its worker
    thread's count; the trio thread reads it). A ``SpanExporter`` by its methods."""

    def __init__(self, exporter: Any) -> None:
        self.exporter = exporter
        self.taken = 0

    def export(self, spans):
        self.taken += len(spans)
        return self.exporter.export(spans)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        import inspect

        if "timeout_millis" in inspect.signature(self.exporter.shutdown).parameters:
            return self.exporter.shutdown(timeout_millis=timeout_millis)
        return self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.exporter.force_flush(timeout_millis)


class Tracing:
    """The tracer provider, its batch processor and exporter, and the journal tap that feeds the spans."""

    def __init__(self, plan: TracingPlan, *, wall_time: Callable[[float], float], decode: Callable,
                 exporter: Any = None, environ: Mapping[str, str] = os.environ) -> None:
        # Imported here: a servicer without tracing never loads OpenTelemetry.
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import SpanLimits, TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        check_settings(environ)
        self.plan = plan
        self._wall_time = wall_time
        self._kind = SpanKind.SERVER
        self._status, self._error = Status, StatusCode.ERROR
        self._propagator = TraceContextTextMapPropagator()
        resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": SERVICE_NAME_DEFAULT}))
        limits = SpanLimits()  # OTEL_SPAN_*_LIMIT
        self.events_max = limits.max_events if limits.max_events is not None else 128
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            # As vLLM's: plaintext unless the endpoint says https (or the SDK's INSECURE variables decide).
            insecure = None if any(name in environ for name in INSECURE_ENVS) else True
            exporter = OTLPSpanExporter(endpoint=plan.endpoint, insecure=insecure)
        self.queue_max = queue_max(environ)
        self.chunks_max = chunks_max(environ)
        self.exporter = _Counted(exporter)
        # The other OTEL_BSP_* are the SDK's to read.
        self.processor = BatchSpanProcessor(self.exporter, max_queue_size=self.queue_max)
        self.provider = TracerProvider(resource=resource, span_limits=limits, shutdown_on_exit=False)
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer(TRACER_NAME)
        self.tap = TraceTap(decode)
        self.spans = 0
        self.unsampled = 0
        self.dropped = 0
        self._journal = None
        self._closed = False

    def attach(self, journal) -> None:
        """Fold the journal's records into the traced calls' spans from now on."""
        journal.tap = self.tap
        self._journal = journal

    def stats(self) -> TraceStats:
        return TraceStats(self.spans, self.unsampled, self.dropped, self.queued, self.queue_max, self.chunks_max,
                          self.tap.errors)  # the tap counts every failure of tracing's, its own and end()'s

    @property
    def queued(self) -> int:
        """Spans in the export queue (an overcount by one batch while the worker has one popped but not sent)."""
        return self.spans - self.exporter.taken

    # -- a call ---------------------------------------------------------------------------

    def call(self, metadata: Mapping[str, Any] | None) -> "_CallScope | _Untraced":
        """The running Generate handler's span, for ``with``: continues ``metadata``'s trace context."""
        now = trio.current_time()
        carrier = {}
        if metadata is not None:
            for key in ("traceparent", "tracestate"):
                value = metadata.get(key)
                if isinstance(value, str):
                    carrier[key] = value
        context = self._propagator.extract(carrier) if carrier else None
        span = self.tracer.start_span(SPAN_NAME, context=context, kind=self._kind, start_time=self._ns(now),
                                      record_exception=False, set_status_on_exception=False)
        if not span.is_recording():
            self.unsampled += 1
            span.end()
            return _UNTRACED
        trace = CallTrace(span, now, self.chunks_max)
        return _CallScope(self, trace)

    def end(self, trace: CallTrace, error: BaseException | None) -> None:
        """The handler left (``error``: how, if not OK): the span gets what the records said, and ends."""
        now = trio.current_time()
        if self.queued >= self.queue_max:
            self._drop()  # never ended, so never queued: the SDK's queue does not overflow
            return
        span = trace.span
        try:
            code = _status_name(error)
            span.set_attributes(self._attributes(trace, now, code))
            for name, at, attributes in _events(trace, self.events_max):
                span.add_event(name, attributes, self._ns(at))
            if code in _SERVER_ERRORS:
                span.set_status(self._status(self._error, _describe(error)))
        except Exception as failure:  # tracing's bug: the span goes out as far as it got, the call never hears of it
            self.tap.failed(failure)
        finally:
            span.end(self._ns(now))
            self.spans += 1

    def _drop(self) -> None:
        self.dropped += 1
        if not self.dropped & (self.dropped - 1):  # the 1st, 2nd, 4th, 8th, ...
            log.warning("trace export queue full (OTEL_BSP_MAX_QUEUE_SIZE=%d; the collector at %s is slow or away): "
                        "%d spans dropped so far", self.queue_max, self.plan.endpoint, self.dropped)

    def _attributes(self, trace: CallTrace, now: float, code: str) -> dict[str, Any]:
        plan = self.plan
        attributes: dict[str, Any] = {
            "rpc.system": "grpc",
            "rpc.service": plan.rpc_service,
            "rpc.method": "Generate",
            "rpc.grpc.status_code": _STATUS_NUMBERS.get(code, 2),
            "gen_ai.response.model": plan.model,
            "gen_ai.latency.e2e": now - trace.started_at,
        }
        if trace.rid is not None:
            attributes.update({
                "gen_ai.request.id": trace.rid,
                "gen_ai.request.n": trace.n,
                "gen_ai.request.max_tokens": trace.max_tokens,
                "gen_ai.usage.prompt_tokens": trace.prompt_tokens,
                "gen_ai.usage.completion_tokens": trace.tokens_sent if trace.finished else sum(trace.tokens_engine),
                "enginelink.stream": trace.stream,
                "enginelink.engine.ranks": trace.ranks,
                "enginelink.chunks": trace.chunks_total,
            })  # fmt: skip
        if trace.chunks:
            attributes["enginelink.chunk.list"] = chunk_list(trace)
        firsts = [t for t in trace.first_token_at if t is not None]
        if firsts:
            first = min(firsts)
            attributes["gen_ai.latency.time_to_first_token"] = first - trace.started_at
            if trace.last_token_at is not None:
                attributes["gen_ai.latency.time_in_model_decode"] = trace.last_token_at - first
            if trace.engine_scheduled_at is not None:
                attributes["gen_ai.latency.time_in_model_prefill"] = first - trace.engine_scheduled_at
        if trace.engine_scheduled_at is not None and trace.engine_queued_at is not None:
            attributes["gen_ai.latency.time_in_queue"] = trace.engine_scheduled_at - trace.engine_queued_at
        if trace.finished:
            attributes["enginelink.finish_reasons"] = [reason for _, _, reason, _ in sorted(trace.finished,
                                                                                             key=lambda f: f[1])]
        if trace.aborted is not None:
            attributes["enginelink.abort_reason"] = trace.aborted[1]
        return attributes

    def _ns(self, now: float) -> int:
        return int(self._wall_time(now) * 1e9)

    # -- the end of the run -------------------------------------------------------------------

    async def aclose(self) -> None:
        """Every call has ended: the queued spans get ``CLOSE_S`` to leave (a worker thread), then the tap goes."""
        if self._closed:
            return
        self._closed = True
        journal = self._journal
        if journal is not None and journal.tap is self.tap:
            journal.tap = None
        with trio.move_on_after(CLOSE_S) as scope:
            await trio.to_thread.run_sync(self.provider.shutdown, abandon_on_cancel=True)
        if scope.cancelled_caught:
            log.warning("trace export: the collector at %s took more than %.0f s; spans still queued are lost",
                        self.plan.endpoint, CLOSE_S)


class _CallScope:
    """``with tracing.call(metadata):`` around a Generate handler's work."""

    __slots__ = ("tracing", "trace", "token")

    def __init__(self, tracing: Tracing, trace: CallTrace) -> None:
        self.tracing = tracing
        self.trace = trace
        self.token = None

    def __enter__(self) -> CallTrace:
        self.token = self.tracing.tap.begin(self.trace)
        return self.trace

    def __exit__(self, exc_type, error, tb) -> None:
        self.tracing.tap.end(self.trace, self.token)
        self.tracing.end(self.trace, error)


class _Untraced:
    """An unsampled call: nothing to fold, nothing to end."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


_UNTRACED = _Untraced()

# grpc.StatusCode's numbers (the span attribute ``rpc.grpc.status_code`` is the number).
_STATUS_NUMBERS = {
    "OK": 0, "CANCELLED": 1, "UNKNOWN": 2, "INVALID_ARGUMENT": 3, "DEADLINE_EXCEEDED": 4, "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6, "PERMISSION_DENIED": 7, "RESOURCE_EXHAUSTED": 8, "FAILED_PRECONDITION": 9, "ABORTED": 10,
    "OUT_OF_RANGE": 11, "UNIMPLEMENTED": 12, "INTERNAL": 13, "UNAVAILABLE": 14, "DATA_LOSS": 15,
    "UNAUTHENTICATED": 16,
}


def chunk_list(trace: CallTrace) -> str:
    """The listed chunks as ``enginelink.chunk.list``: ``"<ms after the span's start>:<tokens>[:<choice>] …"``
    (the choice only where the call has several)."""
    start = trace.started_at
    if trace.n > 1:
        return " ".join(f"{(at - start) * 1000:.3f}:{tokens}:{index}" for at, index, tokens in trace.chunks)
    return " ".join(f"{(at - start) * 1000:.3f}:{tokens}" for at, _, tokens in trace.chunks)


def _status_name(error: BaseException | None) -> str:
    """The gRPC status the call ends with, by the one status map (``runtime/errors.py``)."""
    if error is None:
        return "OK"
    if isinstance(error, GRPCError):
        return error.status.name
    if not isinstance(error, Exception):  # the client went away (asyncio's CancelledError), or we stop
        return "CANCELLED"
    return to_grpc_error(error).status.name


def _describe(error: BaseException | None) -> str:
    if error is None:
        return ""
    if isinstance(error, GRPCError):
        return error.message or error.status.name
    return str(error) or type(error).__name__


def _events(trace: CallTrace, events_max: int) -> list[tuple[str, float, dict[str, Any]]]:
    """The span's events, oldest first: the call's milestones (at most ``events_max``, the SDK's limit, which
    would otherwise keep the last ones)."""
    events: list[tuple[str, float, dict[str, Any]]] = []
    if trace.refused is not None:
        at, code, message, whose = trace.refused
        events.append(("refused", at, {"rpc.grpc.status_code": _STATUS_NUMBERS.get(code, 2), "enginelink.code": code,
                                       "enginelink.whose": whose, "enginelink.message": message}))
    if trace.admitted_at is not None:
        events.append(("admitted", trace.admitted_at, {"gen_ai.request.n": trace.n,
                                                       "gen_ai.usage.prompt_tokens": trace.prompt_tokens}))
    if trace.queued_at is not None:
        events.append(("engine.queued", trace.queued_at, {"enginelink.engine.ranks": trace.ranks}))
    if trace.engine_scheduled_at is not None:
        events.append(("engine.scheduled", trace.engine_scheduled_at, {}))
    for index, at in enumerate(trace.first_token_at):
        if at is not None:
            rank = trace.ranks[index] if index < len(trace.ranks) else 0
            events.append(("first_token", at, {"enginelink.choice": index, "enginelink.engine.rank": rank}))
    for at, index, reason, tokens in trace.finished:
        events.append(("finished", at, {"enginelink.choice": index, "enginelink.finish_reason": reason,
                                        "gen_ai.usage.completion_tokens": tokens}))
    events.extend(trace.seams)  # an engine restart under the call: held, then resumed
    if trace.aborted is not None:
        events.append(("aborted", trace.aborted[0], {"enginelink.abort_reason": trace.aborted[1]}))
    events.sort(key=lambda event: event[1])  # stable: the same time keeps the order above
    return events[:events_max]
