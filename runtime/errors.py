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
- ``ResourceExhausted``: the caller went past a per-client bound (a message
  larger than the receive limit) → RESOURCE_EXHAUSTED.
- anything else is our bug → INTERNAL.
"""

from __future__ import annotations

import functools

from grpclib.const import Status
from grpclib.exceptions import GRPCError


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

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
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


class ResourceExhausted(ServicerError):
    """The caller asked for more than a per-client bound allows (a message too large) → RESOURCE_EXHAUSTED."""

    status = Status.RESOURCE_EXHAUSTED
    whose = "client"


class Unimplemented(ServicerError):
    status = Status.UNIMPLEMENTED
    whose = "client"


def to_grpc_error(error: BaseException) -> GRPCError:
    """Map any exception to the status the caller sees (the only such map)."""
    if isinstance(error, GRPCError):
        return error
    if isinstance(error, ServicerError):
        return GRPCError(error.status, str(error))
    return GRPCError(Status.INTERNAL, f"internal error in enginelink: {type(error).__name__}: {error}")


def grpc_errors(handler):
    """Wrap a grpclib handler so every failure leaves through ``to_grpc_error``.

    Without it grpclib reports unexpected exceptions as UNKNOWN; ours say
    whose fault they are. Cancellation (BaseException) passes through.
    """

    @functools.wraps(handler)
    async def wrapper(self, stream):
        try:
            return await handler(self, stream)
        except GRPCError:
            raise
        except Exception as error:
            raise to_grpc_error(error) from error

    return wrapper
