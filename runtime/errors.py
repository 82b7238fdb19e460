"""Errors that say whose fault they are, and the one place they become gRPC statuses.

- ``ClientError``: the caller sent something invalid → INVALID_ARGUMENT; the
  engine never sees the request.
- ``DuplicateRequest``: the id is already in flight → ALREADY_EXISTS.
- ``Unavailable``: retryable capacity or lifecycle refusal (starting, warming
  up, draining, engine gone) → UNAVAILABLE; the router retries elsewhere.
- ``EngineFailure``: the engine died, went silent or broke its wire while
  the request was open → UNAVAILABLE (nothing to fix in the request).
- ``Precondition``: the servicer cannot do this here (no tokenizer files) →
  FAILED_PRECONDITION.
- ``ConstraintFailed``: the engine ended a constrained request with an error
  (its grammar backend could not compile the constraint, or rejected a
  token) → FAILED_PRECONDITION with the trailing metadata
  ``smg-constraint-failed: engine`` (the reference servicers' shape,
  ``engine_status.py``): the SMG router answers 400 and retries nothing
  (1.13.0), 422 ``constraint_failed`` (newer); the same constraint would
  fail on any worker, so a retryable code would only repeat it.
- ``ResourceExhausted``: the caller went past a per-client bound (a message
  larger than the receive limit) → RESOURCE_EXHAUSTED.
- ``NotThisEngine``: the engine does not run this kind of request (Embed on a
  generation model, Generate on a pooling model) → UNIMPLEMENTED.
- ``EngineRequestFailed``: the engine ended a unary request (Embed) without a
  result → INTERNAL, as the reference; the engine's failure, not reported as our bug.
- ``CallAborted``: a unary call (Embed) ended by the Abort RPC → CANCELLED.
- a request message that does not decode (protobuf ``DecodeError``), or
  ends before its length prefix said, is the client's → INVALID_ARGUMENT; a
  compressed one → UNIMPLEMENTED (grpclib does not decompress);
- anything else is our bug → INTERNAL, and ``grpc_errors`` reports it: the
  traceback logged (in full the first time a bug is seen, one line with its
  count after), an ``internal_error`` journal record, and
  ``smg_servicer_internal_errors_total{rpc}`` (plus ``errors_total{code="INTERNAL"}``
  for Generate). A bug must never leave only a status behind.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import traceback

import trio
from google.protobuf.message import DecodeError
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from enginelink.journal.records import KIND_INTERNAL_ERROR, RUN_STREAM

log = logging.getLogger("enginelink.errors")

# A journaled traceback keeps its last this many characters (the innermost frames).
TRACEBACK_CHARS_MAX = 8192
# Distinct bugs (type and raising line) whose traceback is logged in full; past
# it every bug gets the one-line form, so a client that keeps hitting bugs
# cannot grow this table or flood the log with tracebacks.
BUG_SITES_MAX = 256
# The request id a handler is serving, for the report of a bug it hits (set per
# grpclib handler task, so concurrent calls do not see each other's).
current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "enginelink_request_id", default=None
)
_bug_sites: dict[tuple[str, str, int], int] = {}


class ServicerError(Exception):
    status = Status.INTERNAL
    whose = "servicer"

    @property
    def reason(self) -> str:
        """A short label for metrics (``refusals_total{reason}``)."""
        return self.status.name.lower()


class ClientError(ServicerError):
    status = Status.INVALID_ARGUMENT
    whose = "client"

    def __init__(self, field: str, problem: str, *, words: str | None = None) -> None:
        # ``words``: the whole message, where the engine's own front end has words a client may match on.
        super().__init__(words if words is not None else f"{field}: {problem}")
        self.field = field


class DuplicateRequest(ServicerError):
    status = Status.ALREADY_EXISTS
    whose = "client"


class Unavailable(ServicerError):
    status = Status.UNAVAILABLE
    whose = "servicer"

    def __init__(self, message: str, reason: str = "unavailable") -> None:
        super().__init__(message)
        self._reason = reason

    @property
    def reason(self) -> str:
        return self._reason


class EngineFailure(ServicerError):
    status = Status.UNAVAILABLE
    whose = "engine"


class Precondition(ServicerError):
    status = Status.FAILED_PRECONDITION
    whose = "servicer"


# The reference's trailer for "the engine could not continue under the constraint" (engine_status.py).
CONSTRAINT_FAILED_METADATA = ("smg-constraint-failed", "engine")


class ConstraintFailed(ServicerError):
    """The engine could not continue a request under its constraint → FAILED_PRECONDITION + trailer."""

    status = Status.FAILED_PRECONDITION
    whose = "client"
    trailing_metadata = (CONSTRAINT_FAILED_METADATA,)

    def __init__(self, field: str, detail: str) -> None:
        # The reference's wording, naming the constraint's field.
        super().__init__(f"the engine could not continue the request under its constraint: {field}: {detail}")
        self.field = field

    @property
    def reason(self) -> str:
        return "constraint_failed"


class ResourceExhausted(ServicerError):
    """The caller asked for more than a per-client bound allows (a message too large) → RESOURCE_EXHAUSTED."""

    status = Status.RESOURCE_EXHAUSTED
    whose = "client"


class NotThisEngine(ServicerError):
    """The engine behind this worker does not run this kind of request: Embed on a
    generation model, Generate on a pooling model → UNIMPLEMENTED (router: 501, not
    retried; a 400 would tell the client its body was wrong)."""

    status = Status.UNIMPLEMENTED
    whose = "servicer"

    @property
    def reason(self) -> str:
        return "wrong_runner"


class EngineRequestFailed(ServicerError):
    """The engine ended a unary request (Embed) without a result: its own failure →
    INTERNAL, as the reference servicer answers; not our bug, so not reported as one."""

    status = Status.INTERNAL
    whose = "engine"


class CallAborted(ServicerError):
    """A unary call (Embed) ended by the Abort RPC → CANCELLED (it has no stream to end with a complete)."""

    status = Status.CANCELLED
    whose = "client"


def from_refusal(refusal) -> ServicerError:
    """The request core's ``Refusal`` (machines/request_api.py) as the error it is."""
    if refusal.kind == "duplicate":
        return DuplicateRequest(refusal.message)
    return Unavailable(refusal.message, reason=refusal.reason or "unavailable")


class EngineStatus(ServicerError):
    """The engine ended a request with a status of its own (SGLang's abort with an HTTP status: 400 bad
    input → INVALID_ARGUMENT, 503 queue full → UNAVAILABLE, …; ``wire/sglang.py``'s table) → that status."""

    whose = "engine"

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.status = Status[code]


def from_failure(failure) -> ServicerError:
    """The request core's ``Failure`` (machines/request_api.py) as the error the call ends with."""
    if failure.kind == "constraint":
        return ConstraintFailed(failure.constraint, failure.message)
    if failure.kind == "status":
        return EngineStatus(failure.code, failure.message)
    return EngineFailure(failure.message)


def to_grpc_error(error: BaseException) -> GRPCError:
    """Map any exception to the status the caller sees (the only such map)."""
    if isinstance(error, GRPCError):
        return error
    if isinstance(error, ServicerError):
        return GRPCError(error.status, str(error))
    if isinstance(error, DecodeError):
        # grpclib decodes the request in ``recv_message``: bytes that are not the
        # RPC's message are the client's fault, whatever the handler does next.
        return GRPCError(Status.INVALID_ARGUMENT, f"request: the message does not decode: {error}")
    if _raised_reading_the_request(error):
        # grpclib's recv_message asserts the body was as long as its 5-byte prefix
        # said (a stream that ended early), and refuses the compressed flag.
        if isinstance(error, NotImplementedError):
            return GRPCError(Status.UNIMPLEMENTED, "request: compressed messages are not supported; send them uncompressed")
        return GRPCError(Status.INVALID_ARGUMENT, f"request: the message ended before the length its prefix gave ({error})")
    return GRPCError(Status.INTERNAL, f"internal error in enginelink: {type(error).__name__}: {error}")


def _raised_reading_the_request(error: BaseException) -> bool:
    """Whether ``error`` was raised by grpclib reading a request message (not by our code)."""
    if not isinstance(error, (AssertionError, NotImplementedError)):
        return False
    codes = []
    tb = error.__traceback__
    while tb is not None:
        codes.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    # Raised inside grpclib (its last frame), below its recv_message: nothing of ours ran in between.
    return (bool(codes) and "grpclib" in codes[-1].co_filename
            and any(c.co_name == "recv_message" and "grpclib" in c.co_filename for c in codes))


def report_bug(rpc: str, error: BaseException, *, journal=None, metrics=None) -> None:
    """An unexpected exception in a handler: log it, journal it, count it (once each)."""
    request_id = current_request_id.get()
    frames = traceback.extract_tb(error.__traceback__)
    where = frames[-1] if frames else None
    site = (type(error).__name__, where.filename if where else "?", where.lineno or 0 if where else 0)
    seen = _bug_sites.get(site)
    if seen is None and len(_bug_sites) < BUG_SITES_MAX:
        _bug_sites[site] = 1
        log.error("bug in %s (request %r): %s: %s", rpc, request_id, type(error).__name__, error, exc_info=error)
    elif seen is not None:
        count = _bug_sites[site] = seen + 1
        log.error("bug in %s (request %r): %s: %s at %s:%s (seen %d times; traceback logged the first time)",
                  rpc, request_id, type(error).__name__, error, site[1], site[2], count)
    else:
        log.error("bug in %s (request %r): %s: %s at %s:%s (traceback in the journal only: over %d distinct "
                  "bugs this run)", rpc, request_id, type(error).__name__, error, site[1], site[2], BUG_SITES_MAX)
    if metrics is not None:
        metrics.internal_error(rpc)
    if journal is not None:
        text = "".join(traceback.format_exception(error))
        journal.append(
            trio.current_time(),
            RUN_STREAM,
            KIND_INTERNAL_ERROR,
            {
                "rpc": rpc,
                "type": type(error).__name__,
                "message": str(error)[:TRACEBACK_CHARS_MAX],
                "traceback": text[-TRACEBACK_CHARS_MAX:],
                "request_id": request_id,
            },
        )


def grpc_errors(handler):
    """Wrap a grpclib handler so every failure leaves through ``to_grpc_error``.

    Without it grpclib reports unexpected exceptions as UNKNOWN; ours say
    whose fault they are. An INTERNAL is our bug: ``report_bug`` logs,
    journals and counts it, through the service's ``journal`` and
    ``metrics`` attributes where it has them. Cancellation (BaseException)
    passes through.
    """

    @functools.wraps(handler)
    async def wrapper(self, stream):
        try:
            return await handler(self, stream)
        except GRPCError:
            raise
        except Exception as error:
            status = to_grpc_error(error)
            metadata = getattr(error, "trailing_metadata", None)
            if metadata and isinstance(error, ServicerError):
                # grpclib's GRPCError carries no trailing metadata: send the trailers here.
                await stream.send_trailing_metadata(status=status.status, status_message=status.message,
                                                    metadata=list(metadata))
                return None
            if status.status is Status.INTERNAL and not isinstance(error, EngineRequestFailed):
                try:
                    report_bug(handler.__name__, error, journal=getattr(self, "journal", None),
                               metrics=getattr(self, "metrics", None))
                except Exception:  # the report must not replace the answer
                    log.exception("could not report a bug in %s", handler.__name__)
            try:
                raise status from error
            finally:
                # The raised error's traceback holds this frame: the local naming it would close a
                # cycle (error -> traceback -> frame -> error) that keeps the whole call alive, its
                # request (up to 64 MiB, decoded several times that) among it, until the collector's
                # next full pass: with the servicer's young threshold (gc_policy.py) a quiet servicer
                # kept ~250 MB per refused 64 MiB request (issue 38). Reference counting frees it now.
                del status

    return wrapper
