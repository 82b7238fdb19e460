"""The request hub: the executor of the request core's actions.

The decisions of a request — admission, fan-out, stop strings, ending,
retiring engine ids, what a writer takes — are the sans-io request core's
(``machines/request_core.py``, one table per call in ``machines/request.py``).
This module does what they ask, and nothing else: it journals the records,
encodes and sends the engine frames through the link (``send_frames``, per
DP rank), sets the wake of each call with news, and writes a streaming call's
messages itself from the engine frame's fan-out when the core says its writer
is idle (the direct path, below). Contract-neutral: the messages are encoded
by the contract's edge it was built with (``runtime/requests/contract.py``; vLLM's is
``runtime/contracts/vllm/edge.py``); without an edge, ``take`` returns the core's
own ``Chunk`` / ``Complete`` (warm-up, Embed: they send nothing).

Theory of operation. A handler validates a call (through its edge) and
``admit``s it; the link's receive task (trio) decodes each engine frame once
and hands the batch to ``on_batch``. Each call the frame touched is written
at once where its writer is idle (``_write_now``) or woken: one write or
``set`` per call per frame, no hop between event loops per token, and a woken
writer coalesces what piled up into one message per choice.

The direct path (``fastpath.DirectSender``: ``send``, ``send_body``,
``end_ok``): a one-choice call's chunk goes as the edge's hand-encoded bytes
(``chunk_body``); anything else through ``encode``. What cannot go now (a
full flow-control window: a slow client) is the writer's backlog. A call
whose every complete went out gets its OK trailers from here too.

Rules: a frame the link cannot send never escapes as an exception
(``_send``); a call's failure becomes its error through ``errors.py`` (the
one status map).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import msgspec

from enginelink.journal.states import WriterState
from enginelink.machines.link import LinkMachine
from enginelink.machines.ranks import RankTable
from enginelink.machines.request_api import Actions, GenerateCall, Refusal
from enginelink.machines.request_call import Call, Choice  # noqa: F401 - the hub's calls, as callers see them
# The core's bounds, where the shell reads them (server.py, grpc_transport.py).
from enginelink.machines.request_core import IN_FLIGHT_MAX, RETIRED_ENGINE_IDS_MAX, RequestCore  # noqa: F401
from enginelink.runtime.errors import ConstraintFailed, from_failure, from_refusal
from enginelink.runtime.requests.logprob_bytes import SlicedResponse
from enginelink.runtime.requests.no_metrics import NoMetrics

from enginelink.wire.engine import EngineCodec, OutputBatch

log = logging.getLogger("enginelink.hub")


class Flag:
    """A wake for a call nobody waits on (a caller that polls ``call``): ``set`` and ``is_set`` only."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = False

    def set(self) -> None:
        self.value = True

    def is_set(self) -> bool:
        return self.value

    def clear(self) -> None:
        self.value = False


class RequestHub:
    def __init__(
        self,
        *,
        link: LinkMachine,
        codec: EngineCodec,
        send_frames: Callable[[list[bytes], int], None],
        journal,
        edge=None,
        ranks: RankTable | None = None,
        tokenizer=None,
        cached_tokens: Callable[[object], int | None] | None = None,
        in_flight_max: int = IN_FLIGHT_MAX,
        metrics=None,
        resume=None,
    ) -> None:
        self.link = link
        self.codec = codec
        self.send_frames = send_frames  # (frames, DP rank): the link sends to that rank's identity
        self.rank_in_request = bool(getattr(codec, "rank_in_request", False))
        self.journal = journal
        self.edge = edge  # the contract's (runtime/requests/contract.py); None: take returns the core's messages
        self.metrics = metrics if metrics is not None else NoMetrics()
        self.core = RequestCore(
            link=link, ranks=ranks, tokenizer=tokenizer, cached_tokens=cached_tokens, logprobs=codec.logprobs,
            in_flight_max=in_flight_max, metrics=self.metrics, resume=resume,
        )
        self.send_errors = 0  # frames the link could not hand to the engine
        # The direct write path (_write_now): chunks it wrote, and times it had to
        # hand the rest to the call's writer (a full flow-control window: a slow client).
        self.direct_writes = 0
        self.direct_handovers = 0
        # Called once at the end of every on_batch: the direct path's writes go
        # out there, one per connection (grpc_transport.FrameWrites.flush).
        self.end_of_batch: Callable[[], None] | None = None
        self.last_receive_wall = 0.0
        # Held writes (``hold_writes``): the calls this wake-up's frames touched so far, written
        # once by ``write_held``; None: every ``on_batch`` writes its own calls at once.
        self._held: list[Call] | None = None
        self._burst_frames = 0  # frames of the wake-up in progress
        # Engine frames whose writes were held behind a later frame of the same wake-up, and
        # wake-ups that held more than one frame: how much the burst write saved (/metrics).
        self.held_frames = 0
        self.held_bursts = 0
        # (time read, engine timestamp) of each frame since the last flush, for the output-delay
        # histogram (Metrics.frames_written); None when no metrics are kept: nothing is collected.
        self._marks: list[tuple[float, float]] | None = None if isinstance(self.metrics, NoMetrics) else []

    # -- the core's state, as the shell, metrics and tests read it ----------------------

    calls = property(lambda self: self.core.calls)
    writing = property(lambda self: self.core.writing)
    by_engine_id = property(lambda self: self.core.by_engine_id)
    retired = property(lambda self: self.core.retired)
    ranks = property(lambda self: self.core.ranks)
    tokenizer = property(lambda self: self.core.tokenizer)
    in_flight_max = property(lambda self: self.core.in_flight_max)
    renamed = property(lambda self: self.core.renamed)
    kv_releases = property(lambda self: self.core.kv_releases)
    late_outputs = property(lambda self: self.core.late_outputs)
    logprob_errors = property(lambda self: self.core.logprob_errors)
    stop_chars = property(lambda self: self.core.stop_chars)
    stop_steps = property(lambda self: self.core.stop_steps)

    @property
    def active_requests(self) -> int:
        return self.core.active_requests

    def oldest_admitted_at(self) -> float | None:
        return self.core.oldest_admitted_at()

    # -- events in --------------------------------------------------------------------

    def admit(self, spec: GenerateCall, now: float, *, wake=None) -> Call:
        """Admit a validated call and send its ADDs; raises the refusal (``errors.from_refusal``)."""
        actions = Actions()
        call = self.core.admit(spec, now, actions)
        if isinstance(call, Refusal):
            raise from_refusal(call)
        # The handler's event (grpclib's loop for gRPC handlers); trio code (warm-up, the simulation) passes a trio-side one.
        call.wake = wake if wake is not None else Flag()
        sent = 0  # ADDs handed to the link so far
        try:
            self._apply(actions, now)
            # A wire that reaches every DP rank through one address carries the rank in the request.
            rank_in_request = self.rank_in_request and self.core.ranks.size > 1
            for index, (choice, engine_spec) in enumerate(zip(call.choices, call.spec.specs, strict=True)):
                if rank_in_request and engine_spec.data_parallel_rank != choice.rank:
                    engine_spec = msgspec.structs.replace(engine_spec, data_parallel_rank=choice.rank)
                error = self._send(self.codec.encode_add(engine_spec), choice.rank)
                if error is not None:
                    actions = Actions()
                    self.core.unreachable(call, index, f"{type(error).__name__}: {error}", now, actions)
                    self._apply(actions, now)
                    return call
                sent += 1
            actions = Actions()
            self.core.added(call, now, actions)
            self._apply(actions, now)
        except Exception as error:
            # Our own failure after admission (a request the codec cannot encode, a journal
            # that cannot take a record): the caller never gets the call, so nothing would
            # release it; the core frees it now and the error goes on as our bug (INTERNAL).
            actions = Actions()
            self.core.abandon(call, sent, f"{type(error).__name__}: {error}", now, actions)
            self._apply_abandoned(actions, now)
            raise
        return call

    def on_batch(self, batch: OutputBatch, now: float) -> int:
        """Fan one decoded frame out to its calls; returns the tokens it carried.

        Holding writes (``hold_writes``), the calls it touched are written by
        ``write_held`` after the wake-up's last frame instead."""
        if self._marks is not None and batch.outputs:
            self._marks.append((now, batch.timestamp))
        held = self._held
        if held is not None:
            actions = Actions()
            self._burst_frames += 1
            generated = self.core.on_batch(batch, now, actions, same_burst=self._burst_frames > 1)
            if actions.touched:
                held += actions.touched
                actions.touched = []
            self._apply(actions, now)
            return generated
        try:
            actions = Actions()
            generated = self.core.on_batch(batch, now, actions)
            self._apply(actions, now)
            return generated
        finally:
            self._flush()

    def _flush(self) -> None:
        """The direct path's writes go out (``end_of_batch``); the frames they carried are timed."""
        if self.end_of_batch is not None:
            self.end_of_batch()
        marks = self._marks
        if marks:
            self._marks = []
            self.metrics.frames_written(marks)

    def hold_writes(self) -> None:
        """From now on the link ends each wake-up's frames with ``write_held``.

        Why: a servicer behind its engine finds many frames waiting at one
        wake-up (against a zero-cost engine, dozens of frames of a few outputs
        each). Written frame by frame, each call got one message and each
        connection one socket write per frame; held to the wake-up's end, a
        call gets one message with every token it got in the burst, and a
        connection one write: what a woken writer's coalescing does, without
        the wake. One frame per wake-up (a real engine's pace) writes as before.
        Nothing awaits between the frames of a wake-up, so no writer, abort or
        client runs while writes are held."""
        if self._held is None:
            self._held = []

    def write_held(self, now: float) -> None:
        """The wake-up's frames are done: write (or wake) each call they touched, once."""
        held = self._held
        if held is None:
            return
        if self._burst_frames > 1:
            self.held_bursts += 1
            self.held_frames += self._burst_frames - 1
        self._burst_frames = 0
        try:
            if held:
                self._held = []
                self._write_touched(held, now)
        finally:
            self._flush()

    def abort(self, request_ids: Sequence[str], reason: str, now: float) -> int:
        """Abort calls by id (unknown ids are a no-op); returns how many were open."""
        actions = Actions()
        aborted = self.core.abort(request_ids, reason, now, actions)
        self._apply(actions, now)
        return aborted

    def fail_all(self, message: str, now: float) -> int:
        """The engine is gone: every open call ends with UNAVAILABLE."""
        actions = Actions()
        failed = self.core.fail_all(message, now, actions)
        self._apply(actions, now)
        return failed

    # -- engine restarts (machines/request_resume.py, docs/resume.md) ---------------------

    held = property(lambda self: self.core.held)

    def hold_all(self, message: str, now: float) -> tuple[int, int]:
        """The engine died and will be started again: hold every open call, or fail it saying why not."""
        actions = Actions()
        counts = self.core.hold_all(message, now, actions)
        self._apply(actions, now)
        return counts

    def resume_held(self, now: float) -> int:
        """The engine is back: re-submit every held call's open choices; returns the calls resumed."""
        resumed = 0
        for call, sends in self.core.resume_held(now):
            actions = Actions()
            for sent, (choice, spec) in enumerate(sends):
                error = self._send(self.codec.encode_add(spec), choice.rank)
                if error is not None:
                    self.core.resume_unreachable(call, sent, sends, f"{type(error).__name__}: {error}", now, actions)
                    break
            else:
                self.core.resumed(call, sends, now, actions)
                resumed += 1
            self._apply(actions, now)
        return resumed

    def fail_held(self, message: str, now: float, *, waited_s: float | None = None) -> int:
        """Fail the held calls (those held ``waited_s`` or longer, when given) with ``message``."""
        actions = Actions()
        failed = self.core.fail_held(message, now, actions, waited_s=waited_s)
        self._apply(actions, now)
        return failed

    def release_kv(self, request_id: str, params: dict, now: float) -> bool:
        """Tell the engine about a decode-side PD request the servicer refused (``RequestCore.release_kv``);
        True when the ADD went out."""
        release = self.core.release_kv(request_id, params, now)
        if release is None:
            return False
        error = self._send(self.codec.encode_add(release.spec), release.rank)
        actions = Actions()
        self.core.kv_released(release, error is None, now, actions)
        self._apply(actions, now)
        return error is None

    # -- the writer -------------------------------------------------------------------

    def take(self, call: Call, now: float) -> list:
        """The messages a call's writer should send now, its backlog first; journals completed choices.
        The writer reports ``written`` once it sent them."""
        messages = self._take(call, now, writer=True)
        if call.backlog:
            messages = call.backlog + messages
            call.backlog = []
        return messages

    def written(self, call: Call) -> None:
        self.core.written(call)

    def release(self, call: Call) -> None:
        """The call's writer is gone (done, failed or cancelled): its id is free again."""
        self.core.release(call)

    # -- actions out ------------------------------------------------------------------

    def _apply(self, actions: Actions, now: float) -> None:
        if actions.records:
            append = self.journal.append
            for record in actions.records:
                append(*record)
        for rank, engine_ids in actions.aborts:
            self._send_aborts(engine_ids, rank)
        for call in actions.wake:
            self._wake(call)
        if actions.touched:
            self._write_touched(actions.touched, now)

    def _send_aborts(self, engine_ids: list[str], rank: int) -> None:
        if len(engine_ids) > 1 and hasattr(self.codec, "encode_aborts"):
            for frames in self.codec.encode_aborts(engine_ids):  # SGLang: one AbortReq per request
                self._send(frames, rank)
        else:
            self._send(self.codec.encode_abort(engine_ids), rank)

    def _apply_abandoned(self, actions: Actions, now: float) -> None:
        """An abandoned call's actions (``admit``), each on its own: the ABORTs first (the engine
        must stop working on what it got), then the records, where the failure may lie."""
        for rank, engine_ids in actions.aborts:
            self._send_aborts(engine_ids, rank)
        for record in actions.records:
            try:
                self.journal.append(*record)
            except Exception as error:
                log.warning("could not journal an abandoned call's record: %s: %s", type(error).__name__, error)

    def _write_touched(self, calls: list[Call], now: float) -> None:
        """Each call an engine frame touched: written from here (``_write_now``) or its writer woken.

        The common call (one choice, no logprobs, streaming, its writer idle)
        takes the loop below and nothing else: its chunk encoded straight to
        bytes by the edge and framed by ``send_body``. This is the servicer's
        innermost loop at one token per message (once per call per engine
        frame), so what it reads is read once per frame, not per call
        (docs/benchmarks-history.md, stop 15).

        Every other call (n > 1, logprobs, a backlog) and the end of one that
        ends goes after the common chunks are on the wire (``_write_rest``): its
        ``take``, protobuf encoding, journal records and trailers cost ten plain
        chunks, and written in frame order each one held every later call's
        token and, in the connection's one write, every earlier one's too. At
        c = 32 on a 20 ms engine a fifth of the frames carried a call's end and
        went out 0.35 ms later than the others; that jitter was the inter-token
        p99 (docs/benchmarks-history.md, "A call's end no longer holds the
        frame"). A plain call that ends sends its last tokens with the others'
        (its last gap is a token's gap too) and its complete and trailers after.
        A call's own messages stay in order: its first pass's before its second's.
        """
        edge = self.edge
        chunk_body = None if edge is None else edge.chunk_body
        take_direct = self.core.take_direct
        idle = WriterState.IDLE
        written = 0
        rest: list[Call] = []
        for call in calls:
            direct = call.direct
            if direct is None:
                self._wake(call)
                continue
            if chunk_body is not None and call.plain_one and call.machine.writer is idle and call.failure is None:
                choice = call.choices[0]
                tokens = choice.pending
                going_on = call.open_choices == 1
                # One that ended in this frame sends its last tokens here too; its complete (which
                # repeats them) and trailers go after (``_write_rest``).
                if tokens and (going_on or choice.finished):
                    body = chunk_body(call, choice, tokens)
                    if body is not None and direct.send_body(body):
                        take_direct(call)
                        written += 1
                        if going_on:
                            continue
                elif going_on:
                    continue  # nothing new for it
            rest.append(call)
        self.direct_writes += written
        if rest:
            self._write_rest(rest, written, now)

    def _write_rest(self, calls: list[Call], plain_written: int, now: float) -> None:
        """The calls ``_write_touched`` left: the plain chunks go out first (one socket write per
        connection), then each of these is written (``_write_now``) or its writer woken."""
        if plain_written and self.end_of_batch is not None:
            self.end_of_batch()
        for call in calls:
            if not self._write_now(call, now):
                self._wake(call)

    def _wake(self, call: Call) -> None:
        if call.failure is not None and call.error is None:
            call.error = from_failure(call.failure)
            if isinstance(call.error, ConstraintFailed):
                log.info("request %r: %s", call.spec.request_id, call.error)
        self.core.woken(call)
        call.wake.set()

    def _take(self, call: Call, now: float, *, writer: bool) -> list:
        actions = Actions()
        messages = self.core.take(call, now, actions, writer=writer)
        self._apply(actions, now)
        return messages if self.edge is None else self.edge.encode(messages)

    def _write_now(self, call: Call, now: float) -> bool:
        """Write a streaming call's new messages from here, without waking its writer.

        Only where the core says the writer is idle with nothing queued, so
        the order on the wire is the order taken (``take``, which journals
        completes); what cannot go now becomes the writer's backlog. True when
        nothing is left for the writer; a call that is done always wakes its
        writer, which returns.
        """
        direct = call.direct
        if direct is None or not call.writable:
            return False
        # (The common one-choice chunk was tried by ``_write_touched``; it could not go
        # now, or the call is not that one: everything goes through ``take`` and ``send``.)
        messages = self._take(call, now, writer=False)
        # Logprobs over one step's budget are the writer's to serialize, in slices (logprob_bytes.py):
        # what comes from the first of them on is its backlog.
        sendable = len(messages)
        for position, message in enumerate(messages):
            if type(message) is SlicedResponse:
                sendable = position
                break
        if sendable == len(messages):
            written = direct.send(messages)
        else:
            written = direct.send(messages[:sendable]) if sendable else 0
        self.direct_writes += written
        if written < len(messages):
            self.direct_handovers += 1
            call.backlog = messages[written:]
            self.core.left_behind(call)
            return False
        if not call.done:
            return True
        direct.end_ok()  # if it could not, the writer's return sends them (grpclib)
        return False

    def _send(self, frames: list[bytes], rank: int) -> Exception | None:
        """Hand frames to the link; the error if it could not (the engine is gone or going).

        The link's supervision fails the link when the engine is gone, so a
        lost ABORT needs nothing more; a lost ADD fails its call (``RequestCore.unreachable``).
        """
        try:
            self.send_frames(frames, rank)
        except Exception as error:  # LinkFailed, zmq errors: whatever the transport says
            self.send_errors += 1
            log.warning("could not send a frame to the engine: %s: %s", type(error).__name__, error)
            return error
        return None
