"""One Generate call from request to its end: the loop the gRPC handler and the simulation both run.

validate → admit → (wait → take → send)* until every choice's ``complete``
went out, the engine failed the call, or the caller went away; a call the
caller leaves while it is still open (cancellation, a send that raised) is
aborted as ``client_gone``, so the engine stops working on it.

Parametrised by the two things that differ between callers:
- ``wake``: what the hub sets when the call has something new; an
  ``asyncio.Event`` for grpclib handlers (asyncio under trio-asyncio), a
  ``context.submit.TrioWake`` for trio code (the simulation's clients);
- ``send``: an async callable taking one response message of the edge's contract, or its
  bytes (a response whose logprobs the writer serialized in slices: ``serialize_in_slices``).

Errors: a refusal (validation, admission) is journaled through
``app.refused`` and raised as the ``ServicerError`` it is; a call the engine
failed raises its ``EngineFailure``; the caller maps them to a status (the
gRPC handler with ``errors.grpc_errors``). Time only from ``trio.current_time()``.
"""

from __future__ import annotations

import trio

from enginelink.runtime.requests.embed import check_generation
from enginelink.runtime.errors import ClientError, ServicerError
from enginelink.runtime.requests.inputs import check_request_id, input_limits
from enginelink.runtime.requests.logprob_bytes import SlicedResponse
from enginelink.runtime.requests.bridge import in_trio
from enginelink.runtime.requests.writers import counted


@counted  # a drain's flush waits for it (runtime/requests/writers.py)
async def generate(app, request, *, wake, send, edge, direct=None, send_headers=None) -> None:
    """Serve one Generate request of ``edge``'s contract through ``app.hub``; returns when it ended OK.

    ``edge`` (``runtime/requests/contract.py``): the contract's validator (its request
    → the neutral call); the hub was built with the same edge, which encodes
    what ``send`` gets. Always the caller's: this loop knows no contract.

    ``direct`` (gRPC only): the stream's ``fastpath.DirectSender``.
    Once a streaming call is admitted its headers go out and its synchronous
    ``send`` is handed to the hub, which from then on writes chunks itself
    while this loop is idle; this loop wakes for the completes and anything
    the hub could not write. (Headers right after admission rather than with the first chunk:
    the first chunk then needs no wake-up of this task either. A refusal is
    still a trailers-only response.) ``send_headers`` (gRPC, fast path off):
    how those headers go out when there is no ``direct``.
    """
    hub = app.hub
    now = trio.current_time()
    try:
        # The id first, whatever the link's state: a reserved or oversized id is the
        # client's error even while the engine starts (app.limits answers UNAVAILABLE then).
        check_request_id(edge.id_field, edge.raw_request_id(request), input_limits())
        limits = app.limits
        check_generation(app.ready)  # a pooling engine generates nothing: UNIMPLEMENTED, before validation
        spec = edge.validate(request, limits, app.wall_time(now))
        prepare_media = getattr(edge, "prepare_media", None)
        if prepare_media is not None:
            # Media refs are fetched after the request is known good and before admission, in this
            # call's task (bounded by the media knobs, runtime/contracts/shared/media.py), never on the engine's path.
            spec = await prepare_media(app, request, spec)
            now = trio.current_time()
        call = hub.admit(spec, now, wake=wake)
    except ServicerError as error:
        app.refused(edge.raw_request_id(request), error, now)
        release_refused_kv(app, request, error, now, edge)
        raise
    try:
        if direct is not None and spec.stream:
            await direct.send_headers()
            call.direct = direct
        elif send_headers is not None and spec.stream:
            await send_headers()
        while True:
            await wake.wait()
            wake.clear()
            if call.error is not None:
                raise call.error
            messages = hub.take(call, trio.current_time())
            try:
                for message in messages:
                    if type(message) is SlicedResponse:
                        message = await serialize_in_slices(message)
                    await send(message)
            finally:
                hub.written(call)  # the writer is idle again (or leaving): the fan-out may write
            if call.error is not None:
                # The engine failed the call while we were sending: the caller
                # must see the failure, not a stream that ends OK without completes.
                raise call.error
            if call.done:
                return
    finally:
        if call.machine.open:
            # The client went away (or the router cancelled a non-streaming call):
            # that is an abort, and the engine must stop working on it.
            hub.abort([call.spec.request_id], "client_gone", trio.current_time())
        hub.release(call)


def release_refused_kv(app, request, error: ServicerError, now: float, edge) -> None:
    """A refused decode-side PD request: the engine frees the prefill side's KV now (``RequestHub.release_kv``).

    Only for a refusal that is final, the client's fault (INVALID_ARGUMENT,
    ALREADY_EXISTS): the router does not send that request again. A refusal
    that says "retry on another worker" (UNAVAILABLE: capacity, starting,
    draining) keeps the prefill side's KV for the retry, which needs it; the
    reference releases on any failure, and would free KV its retry then
    cannot pull. A call the hub admitted needs nothing of this: its ADD
    reached the engine, and the engine's abort (client gone, Abort) runs the
    connector's same hook. A request refused for its id is not released:
    the id is not one the servicer takes.
    """
    if error.whose != "client" or (isinstance(error, ClientError) and error.field == edge.id_field):
        return
    params = edge.release_params(request, input_limits())
    if params is not None:
        app.hub.release_kv(edge.raw_request_id(request), params, now)


async def serialize_in_slices(message: SlicedResponse) -> bytes:
    """A response's logprobs serialized a slice at a time (``logprob_bytes.py``), the servicer's other
    work running between slices: however many logprobs one call asked for, it holds the event loop for
    one slice at a time (issue 38). Its bytes, for ``send`` (the gRPC codec passes bytes on).

    The slices run in trio (``in_trio``), each followed by a trio checkpoint: an asyncio one would not
    do, since the gRPC side runs up to 64 ready asyncio callbacks per trio round
    (``fastpath.READY_CALLBACKS_MAX``), and a writer that yields with ``asyncio.sleep(0)`` is ready again
    at once: 64 slices would pass before trio polled a socket.
    """
    await in_trio(_slices, message)
    # Taken from the message, not returned through ``in_trio``: trio-asyncio's bridge keeps what it
    # returns in a future inside a reference cycle, which the collector frees only much later
    # (gc_policy.py): a vocabulary-wide response's megabytes, per response.
    body, message.body = message.body, None
    return body


async def _slices(message: SlicedResponse) -> None:
    for _ in message.steps():
        await trio.sleep(0)
