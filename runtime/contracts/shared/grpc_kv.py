"""The KV cache RPCs: ``SubscribeKvEvents`` (the relay's streams) and ``FlushCache``.

``subscribe_kv_events`` is the handler body (asyncio, under trio-asyncio):
KV events off → UNIMPLEMENTED with the reference's message (the router then
stops asking this worker); a cursor the relay refuses → its status
(OUT_OF_RANGE) before any message; otherwise, until the stream ends: clear
the wake event, pull what the machine allows (history, snapshot chunks,
live batches, each with its rank's load record), send it, end with the
machine's status (DATA_LOSS, UNAVAILABLE) when it says so, send the
``load_only`` records that are due, and wait for the next wake (the relay
shell sets it from trio code: a plain call on this same thread). The wait is
cleared before each pull, so a wake that comes while messages are being
written is never lost. Sending awaits HTTP/2 flow control: a slow client
holds only its own handler, the relay's window is its buffer. A send held
longer than ``send_stall_s`` (``ENGINELINK_KV_SEND_STALL_SECS``), or one the
relay ends meanwhile (the window rolled past the subscriber, or a new
subscriber took the slot of this one, which was not taking its events:
``machines/kv_admission.py``), ends the stream with DATA_LOSS, so a
subscriber that stops reading frees its slot. Each send is reported to the
relay (``sending`` / ``sent``): that is how it knows who reads.

``flush_cache`` follows smg contract §10 with ``reset_prefix_cache(False,
False)``: ``timeout_s`` 0 is one attempt (answer within ``FLUSH_CALL_CAP_S``),
a positive one retries every ``FLUSH_RETRY_S`` until the engine accepts or
the deadline passes (DEADLINE_EXCEEDED). Trio code, called through
``trio_as_aio`` once per call.
"""

from __future__ import annotations

import asyncio
import math
from typing import Final

import trio
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from smg_grpc_proto.generated import common_pb2 as pb

from enginelink.machines.kv_relay import Refused
from enginelink.runtime.contracts.shared.kv_messages import batch_message
from enginelink.runtime.peers import peer_key
from enginelink.runtime.rpc.fastpath import send_window

KV_OFF_MESSAGE: Final = (
    "KV cache events not enabled. Start vLLM with --kv-events-config "
    "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\"}'"
)
# The SGLang and TokenSpeed references' words: each names its engine's own config dialect.
KV_OFF_MESSAGE_SGLANG: Final = "KV cache events not enabled. Start SGLang with --kv-events-config '{\"publisher\": \"zmq\"}'"
KV_OFF_MESSAGE_TOKENSPEED: Final = (
    "KV cache events not enabled. Start TokenSpeed with --kv-events-config "
    "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\"}'"
)
FLUSH_CALL_CAP_S: Final = 30.0
FLUSH_RETRY_S: Final = 0.1
# A gRPC message's prefix on the wire: its compressed flag and its length.
GRPC_PREFIX_BYTES: Final = 5
FLUSH_OK: Final = "Local KV prefix cache flushed successfully"
FLUSH_REFUSED: Final = "KV prefix cache reset refused; requests may be in flight"
FLUSH_TIMED_OUT: Final = "Flush cache timed out; the engine may still complete an issued reset"
FLUSH_BAD_TIMEOUT: Final = "timeout_s must be finite and non-negative"


async def subscribe_kv_events(shell, stream, off_message: str = KV_OFF_MESSAGE) -> None:
    request = await stream.recv_message()
    if shell is None:
        raise GRPCError(Status.UNIMPLEMENTED, off_message)
    wake = asyncio.Event()
    opened = shell.open_stream(request.start_sequence_number, request.load_records_before_first_batch, wake,
                               peer_key(stream.peer.addr()))  # fmt: skip
    if isinstance(opened, Refused):
        raise GRPCError(Status[opened.status], opened.message)

    async def send(message) -> None:
        # Whether it takes what it is sent decides who gives way (machines/kv_admission.py): a message the
        # client's window has no room for waits on the client; one that fits waits only on this servicer.
        window = send_window(stream)
        shell.sending(opened, window_shut=window is not None and window < message.ByteSize() + GRPC_PREFIX_BYTES)
        if not await _send_bounded(stream, message, opened.ended, shell.send_stall_s):
            end = shell.pull(opened).end if opened.ended.is_set() else shell.stalled(opened).end
            raise GRPCError(Status[end.status], end.message)
        shell.sent(opened)

    try:
        while True:
            wake.clear()
            pull = shell.pull(opened)
            for batch in pull.batches:
                await send(batch_message(*shell.message(opened, batch)))
            if pull.end is not None:
                raise GRPCError(Status[pull.end.status], pull.end.message)
            if pull.batches:
                continue  # there may be more than one pull's worth
            for beat in shell.heartbeats(opened):
                await send(batch_message(*beat))
            if not wake.is_set():
                await wake.wait()
    finally:
        shell.close_stream(opened)


async def _send_bounded(stream, message, ended: asyncio.Event, stall_s: float) -> bool:
    """Send one message; False when the relay ended the stream or flow control held it ``stall_s``.

    A subscriber that stops reading stops sending WINDOW_UPDATEs, and grpclib's
    send waits for one forever: its slot (``subscribers_max``) was never freed.
    The message cut short then ends a stream that ends with DATA_LOSS anyway.
    """
    sending = asyncio.ensure_future(stream.send_message(message))
    stop = asyncio.ensure_future(ended.wait())
    # Either may end with an error nobody awaits (the call cancelled mid-wait; a send cancelled here
    # that fails instead, h2's StreamClosedError): unretrieved, trio-asyncio would raise it out of
    # the loop and end the whole servicer. The callbacks take every outcome.
    sending.add_done_callback(retrieve_outcome)
    stop.add_done_callback(retrieve_outcome)
    try:
        done, _ = await asyncio.wait((sending, stop), timeout=stall_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not sending.done():
            sending.cancel()
    if sending in done:
        sending.result()  # its error, if any, is the call's
        return True
    return False


def retrieve_outcome(task: asyncio.Future) -> None:
    """Mark a task's outcome seen (``add_done_callback``): what it raised is the awaiting call's, if any."""
    if not task.cancelled():
        task.exception()


class FlushError(Exception):
    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


async def flush_cache(link, timeout_s: float) -> pb.FlushCacheResponse:
    """Reset the engine's prefix cache (trio). Raises FlushError with the status to answer."""
    if not math.isfinite(timeout_s) or timeout_s < 0:
        raise FlushError(Status.INVALID_ARGUMENT, FLUSH_BAD_TIMEOUT)
    from enginelink.runtime.engine.engine_link import LinkFailed

    if not link.machine.live or not link.ready:
        raise FlushError(Status.UNAVAILABLE, "engine is not up; retry later")
    deadline = trio.current_time() + (timeout_s if timeout_s > 0 else FLUSH_CALL_CAP_S)
    while True:
        left = deadline - trio.current_time()
        if left <= 0:
            raise FlushError(Status.DEADLINE_EXCEEDED, FLUSH_TIMED_OUT)
        try:
            accepted = await link.utility("reset_prefix_cache", [False, False], min(left, FLUSH_CALL_CAP_S))
        except LinkFailed as error:
            if not link.machine.live or "not connected" in str(error):
                raise FlushError(Status.UNAVAILABLE, f"engine is not up: {error}") from None
            if "did not answer" in str(error):
                raise FlushError(Status.DEADLINE_EXCEEDED, FLUSH_TIMED_OUT) from None
            raise FlushError(Status.INTERNAL, f"FlushCache failed: {error}") from None
        if accepted:
            return pb.FlushCacheResponse(success=True, message=FLUSH_OK)
        if timeout_s == 0:
            return pb.FlushCacheResponse(success=False, message=FLUSH_REFUSED)
        await trio.sleep(min(FLUSH_RETRY_S, max(0.0, deadline - trio.current_time())))
