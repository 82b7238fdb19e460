"""The request hub: every Generate in flight, and the engine's outputs fanned out to them.

Theory of operation. A gRPC handler (asyncio, under trio-asyncio) validates
a call and ``admit``s it: the hub creates its request machine, journals it and
sends one ADD frame per choice through the link. The link's receive task
(trio) decodes each engine frame once and hands the batch to ``on_batch``,
which appends each choice's new tokens to that choice's pending list and sets
the call's ``wake`` event; the handler wakes, takes everything pending as one
message per choice (several tokens per chunk when it fell behind) and writes.
So there is no trio↔asyncio hop per token: one ``Event.set`` per call per
frame, and the writer coalesces.

Rules:
- the hub owns the tables; one call's bad luck (stop string, abort, a
  client gone) never touches another call;
- a call ends in exactly one terminal state, and every choice of a call that
  ends OK gets exactly one ``complete``;
- every state change is a journal record, written by the hub itself;
- a request id is taken from admission until its writer is done with it
  (``writing``), and an engine id the engine may still answer for is never
  given to another call (``retired``), so no record or output of one call is
  taken for another's;
- a frame the link cannot send never escapes as an exception (``_send``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import OrderedDict
from typing import Callable, Sequence

import msgspec

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.journal.records import (
    KIND_CLIENT_ABORT,
    KIND_CLIENT_GENERATE,
    KIND_CLIENT_SENT,
    KIND_ENGINE_KV_RELEASE,
    KIND_ENGINE_REQUEST,
    KIND_TRANSITION,
    Transition,
    request_stream,
)
from enginelink.journal.states import LinkState
from enginelink.machines.link import KV_RELEASE_REQUEST_PREFIX, WARMUP_REQUEST_PREFIX, LinkMachine
from enginelink.machines.ranks import RankTable
from enginelink.machines.request import RequestEvent, RequestMachine, RequestState
from enginelink.runtime import kv_transfer
from enginelink.runtime.errors import ConstraintFailed, DuplicateRequest, EngineFailure, ServicerError, Unavailable
from enginelink.runtime.logprobs import ChoiceLogprobs
from enginelink.runtime.metrics import NoMetrics
from enginelink.runtime.stops import StopAutomaton, StopMatcher
from enginelink.runtime.validate import GenerateCall
from enginelink.wire.engine import EngineCodec, FinishReason, GenerateSpec, OutputBatch, SamplingSpec, WireError

# Calls in flight at once; beyond it admission answers UNAVAILABLE (retryable).
IN_FLIGHT_MAX = 4096
# Engine ids the hub stopped listening to before the engine finished them (an
# abort, a stop string): the engine may still send outputs for them, so a new
# call with the same request id gets fresh engine ids (``<engine id>~<n>``)
# instead of taking those outputs for its own. Stale outputs arrive within a
# few engine steps, long before this many more calls were cut short.
RETIRED_ENGINE_IDS_MAX = 65_536

log = logging.getLogger("enginelink.hub")


class Choice:
    """One of a call's n samples: one engine request."""

    __slots__ = (
        "index", "engine_id", "pending", "last_delta", "output", "tokens_engine", "tokens_sent",
        "finish_reason", "matched_token", "matched_str", "complete_sent", "stops", "cached_tokens",
        "first_token_at", "last_token_at", "logprobs", "pooled", "kv_transfer_params", "rank",
    )

    def __init__(self, index: int, engine_id: str, keep_output: bool, stops: StopMatcher | None,
                 logprobs: ChoiceLogprobs | None = None) -> None:
        self.index = index
        self.engine_id = engine_id
        self.pending: list[int] = []
        self.last_delta: list[int] = []
        self.output: list[int] | None = [] if keep_output else None
        self.tokens_engine = 0
        self.tokens_sent = 0
        self.finish_reason: str | None = None
        self.matched_token: int | None = None
        self.matched_str: str | None = None
        self.complete_sent = False
        self.stops = stops
        self.cached_tokens = 0
        self.first_token_at = 0.0
        self.last_token_at = 0.0
        # None unless the call asked for logprobs (runtime/logprobs.py): the
        # calls that did not pay nothing per token for them.
        self.logprobs = logprobs
        self.pooled = None  # a pooling request's result (Embed; runtime/embed.py): a wire.vllm_arrays.Tensor
        self.kv_transfer_params: dict | None = None  # PD: the engine's, for the other leg (kv_transfer.py)
        self.rank: int | None = None  # the DP rank holding it, while the engine may (machines/ranks.py)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def take_pending(self) -> list[int]:
        """The tokens not yet taken, now counted as sent (the next complete repeats them)."""
        tokens = self.pending
        self.pending = []
        self.last_delta = tokens
        self.tokens_sent += len(tokens)
        return tokens


class Call:
    """One Generate in flight, as its handler sees it."""

    __slots__ = (
        "spec", "machine", "choices", "open_choices", "wake", "error", "admitted_at", "prompt_tokens", "metrics",
        "direct", "writer_busy", "backlog", "plain_one",
    )

    def __init__(self, spec: GenerateCall, now: float, tokenizer, wake, metrics) -> None:
        self.spec = spec
        self.machine = RequestMachine(spec.request_id, now)
        # One automaton per call, built once; each choice keeps only its place in it.
        automaton = StopAutomaton(spec.stop_strings) if spec.stop_strings else None
        sampling = spec.specs[0].sampling if spec.specs else None
        top, prompt_top = (None, None) if sampling is None else (sampling.logprobs, sampling.prompt_logprobs)
        with_logprobs = top is not None or prompt_top is not None
        self.choices = [
            Choice(
                index,
                engine_id,
                keep_output=not spec.stream,
                stops=StopMatcher(automaton, tokenizer, spec.skip_special_tokens) if automaton else None,
                logprobs=ChoiceLogprobs(top, prompt_top, keep_all=not spec.stream) if with_logprobs else None,
            )
            for index, engine_id in enumerate(spec.engine_ids)
        ]
        # One choice and no logprobs: its chunks can be hand-encoded (stream_chunk_body).
        self.plain_one = len(self.choices) == 1 and not with_logprobs
        self.open_choices = len(self.choices)
        # asyncio.Event for gRPC handlers; trio code (warm-up) passes a trio-side one.
        self.wake = wake if wake is not None else asyncio.Event()
        self.metrics = metrics
        self.error: ServicerError | None = None
        self.admitted_at = now
        self.prompt_tokens = len(spec.prompt_token_ids)
        # The writer's synchronous path (a grpc_transport.DirectSender: send, send_bodies,
        # end_ok), set by the writer once its headers are out; None until then and off gRPC.
        self.direct = None
        self.writer_busy = False  # the writer holds messages it has not written yet
        self.backlog: list[pb.GenerateResponse] = []  # taken, not written: the writer's first

    @property
    def done(self) -> bool:
        """Nothing more will be written: failed, or every choice's complete taken."""
        return self.error is not None or all(c.complete_sent for c in self.choices)

    def take_messages(self) -> list[pb.GenerateResponse]:
        """Everything the client should get now, in order. Called by the writer."""
        messages = []
        stream = self.spec.stream
        for choice in self.choices:
            if stream and choice.pending:
                tokens = choice.take_pending()
                # Filled in place: building the chunk apart and passing it to
                # the response's constructor copies it (~2x the cost, upb).
                message = pb.GenerateResponse()
                chunk = message.chunk
                chunk.token_ids.extend(tokens)
                chunk.prompt_tokens = self.prompt_tokens
                chunk.completion_tokens = len(tokens)
                chunk.cached_tokens = choice.cached_tokens
                chunk.index = choice.index
                if choice.logprobs is not None:
                    choice.logprobs.fill_chunk(chunk)
                messages.append(message)
            if choice.finished and not choice.complete_sent:
                messages.append(self._complete(choice))
        return messages

    def _complete(self, choice: Choice) -> pb.GenerateResponse:
        choice.complete_sent = True
        if self.spec.stream:
            # As the reference servicer: the complete repeats the last delta.
            output = choice.last_delta
        else:
            output = choice.output or []
            choice.pending = []
            choice.tokens_sent = len(output)
        complete = pb.GenerateComplete(
            output_ids=output,
            finish_reason=choice.finish_reason,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=len(output),
            cached_tokens=choice.cached_tokens,
            index=choice.index,
        )
        if choice.logprobs is not None:
            choice.logprobs.fill_complete(complete, self.spec.stream)
        if choice.matched_str is not None:
            complete.matched_stop_str = choice.matched_str
        elif choice.matched_token is not None:
            complete.matched_token_id = choice.matched_token
        if choice.kv_transfer_params is not None:
            kv_transfer.fill_complete(complete, choice.kv_transfer_params)
        return pb.GenerateResponse(complete=complete)


# -- a stream chunk's bytes ----------------------------------------------------------


_VARINTS = [bytes((value,)) for value in range(0x80)]


def _varint(value: int) -> bytes:
    """A protobuf varint (non-negative values: every field here is uint32)."""
    if value < 0x80:
        return _VARINTS[value]
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def stream_chunk_body(tokens: list[int], prompt_tokens: int, cached_tokens: int, index: int) -> bytes:
    """``GenerateResponse(chunk=GenerateStreamChunk(...))`` serialized, without protobuf objects.

    Why: the direct path writes one chunk per call per engine frame, and
    building it as upb messages (two messages, their arena, five field sets,
    then ``SerializeToString``) was the largest single cost of a streamed
    token between engine steps, where everything runs cold: 10% of the
    servicer's samples at concurrency 32. This writes the same bytes (fields
    in number order, zeros left out, token ids packed, as upb does;
    ``tests/test_hub_direct.py`` compares them with upb's). Sim engine, 32,
    7 ms steps, six alternating pairs: 41.4 -> 37.8 servicer µs per token on
    average, lower in five; no change at 128 with 16 ms steps, where a
    frame's 128 chunks run warmer (docs/benchmarks.md). Layout: vllm_engine.proto,
    ``GenerateResponse.chunk`` = 1; ``GenerateStreamChunk``: token_ids = 1,
    prompt_tokens = 2, completion_tokens = 3, cached_tokens = 4, index = 7
    (logprobs, 5 and 6, are not written here: a call that asked for them
    takes the protobuf path, ``Call.plain_one``).
    """
    packed = _varint(tokens[0]) if len(tokens) == 1 else b"".join(map(_varint, tokens))
    chunk = b"\x0a" + _varint(len(packed)) + packed  # field 1, length-delimited
    if prompt_tokens:
        chunk += b"\x10" + _varint(prompt_tokens)  # field 2, varint
    chunk += b"\x18" + _varint(len(tokens))  # field 3: completion_tokens, never 0 here
    if cached_tokens:
        chunk += b"\x20" + _varint(cached_tokens)  # field 4
    if index:
        chunk += b"\x38" + _varint(index)  # field 7
    return b"\x0a" + _varint(len(chunk)) + chunk  # GenerateResponse field 1: chunk


class RequestHub:
    def __init__(
        self,
        *,
        link: LinkMachine,
        codec: EngineCodec,
        send_frames: Callable[[list[bytes], int], None],
        journal,
        ranks: RankTable | None = None,
        tokenizer=None,
        cached_tokens: Callable[[object], int | None] | None = None,
        in_flight_max: int = IN_FLIGHT_MAX,
        metrics=None,
    ) -> None:
        self.link = link
        self.codec = codec
        self.send_frames = send_frames  # (frames, DP rank): the link sends to that rank's identity
        self.journal = journal
        # The engine's DP ranks (the link fills them at its handshake); one rank 0 when none given.
        self.ranks = ranks if ranks is not None else RankTable((0,))
        self.tokenizer = tokenizer
        self.cached_tokens = cached_tokens
        self.in_flight_max = in_flight_max
        self._no_metrics = NoMetrics()
        self.metrics = metrics if metrics is not None else self._no_metrics
        self.calls: dict[str, Call] = {}
        # Calls that ended while their writer still has completes to take: the
        # id stays taken until the writer is done with it (``take``/``release``),
        # so a new call with the same id cannot interleave its records with them.
        self.writing: dict[str, Call] = {}
        self.by_engine_id: dict[str, tuple[Call, Choice]] = {}
        self.retired: OrderedDict[str, None] = OrderedDict()
        self.renamed = 0  # calls that got fresh engine ids (see RETIRED_ENGINE_IDS_MAX)
        self.kv_releases = 0  # refused PD decode requests the engine was told about (release_kv)
        self.send_errors = 0  # frames the link could not hand to the engine
        self.late_outputs = 0
        self.logprob_errors = 0  # calls failed for logprobs the engine sent unreadable
        # The direct write path (_write_now): chunks it wrote, and times it had to
        # hand the rest to the call's writer (a full flow-control window: a slow client).
        self.direct_writes = 0
        self.direct_handovers = 0
        # Stop-string matching of the calls that ended: text fed and automaton steps
        # taken (runtime/stops.py; steps <= 2 x characters, whatever the stop sets).
        self.stop_chars = 0
        self.stop_steps = 0
        # Called once at the end of every on_batch: the direct path's writes go
        # out there, one per connection (grpc_transport.FrameWrites.flush).
        self.end_of_batch: Callable[[], None] | None = None
        self.last_receive_wall = 0.0

    # -- admission -------------------------------------------------------------------

    def admit(self, spec: GenerateCall, now: float, *, wake=None) -> Call:
        refusal = self.link.admission_refusal(spec.request_id)
        if refusal is not None:
            raise Unavailable(refusal, reason=self.link.state.value)
        if (
            spec.request_id in self.calls
            or spec.request_id in self.writing
            or any(e in self.by_engine_id for e in spec.engine_ids)
        ):
            raise DuplicateRequest(f"request_id {spec.request_id!r} is already in flight")
        if len(self.calls) >= self.in_flight_max:
            raise Unavailable(
                f"{len(self.calls)} requests in flight (the limit); retry on another worker", reason="capacity"
            )
        if spec.stop_strings and self.tokenizer is None:
            raise Unavailable(
                "stop strings need the model's tokenizer, which this worker could not load", reason="no_tokenizer"
            )
        if any(e in self.retired for e in spec.engine_ids):
            spec = self._fresh_engine_ids(spec)
        # The servicer's own warm-up calls stay out of the client-facing metrics.
        metrics = self._no_metrics if spec.request_id.startswith(WARMUP_REQUEST_PREFIX) else self.metrics
        call = Call(spec, now, self.tokenizer, wake, metrics)
        stream = request_stream(spec.request_id)
        self.journal.append(
            now,
            stream,
            KIND_CLIENT_GENERATE,
            {
                "request_id": spec.request_id,
                "n": spec.n,
                "prompt_tokens": call.prompt_tokens,
                "stream": spec.stream,
                "max_tokens": spec.max_tokens,
                # An Embed call (runtime/embed.py) goes through the same machine; the journal says which.
                **({"task": spec.task} if getattr(spec, "task", None) else {}),
            },
        )
        self.calls[spec.request_id] = call
        for choice in call.choices:
            self.by_engine_id[choice.engine_id] = (call, choice)
        call.metrics.admitted(call.prompt_tokens, spec.n)
        for choice, engine_spec in zip(call.choices, spec.specs, strict=True):
            # Each engine request picks its rank, as vLLM's DP front end does for n > 1's children.
            choice.rank = self.ranks.pick(engine_spec.data_parallel_rank)
            error = self._send(self.codec.encode_add(engine_spec), choice.rank)
            if error is not None:
                self._unreachable(call, error, now)
                return call
        self.journal.append(
            now,
            stream,
            KIND_ENGINE_REQUEST,
            {"link": self.link.name, "request_ids": spec.engine_ids, "prompt_tokens": call.prompt_tokens,
             "ranks": [choice.rank for choice in call.choices]},
        )
        return call

    def _fresh_engine_ids(self, spec: GenerateCall) -> GenerateCall:
        """The call with engine ids no earlier call of this run was cut short under."""
        self.renamed += 1
        suffix = f"~{self.renamed}"
        engine_ids = [engine_id + suffix for engine_id in spec.engine_ids]
        specs = [msgspec.structs.replace(s, request_id=e) for s, e in zip(spec.specs, engine_ids, strict=True)]
        spec = dataclasses.replace(spec, specs=specs, engine_ids=engine_ids)
        if any(e in self.by_engine_id for e in engine_ids):
            raise DuplicateRequest(f"request_id {spec.request_id!r} is already in flight")
        return spec

    def _unreachable(self, call: Call, error: Exception, now: float) -> None:
        """An ADD could not be handed to the engine (it is going away): the call fails now."""
        sent = [choice for choice in call.choices if choice.rank is not None]
        self._abort_choices(sent[:-1])  # the last one picked is the ADD that failed
        for choice in sent[-1:]:
            self._release_rank(choice)
        call.error = EngineFailure(f"engine is not reachable ({type(error).__name__}: {error}); retry on another worker")
        for choice in call.choices:
            self.by_engine_id.pop(choice.engine_id, None)
        call.open_choices = 0
        self._end(call, RequestEvent.FAIL, now)
        call.wake.set()

    def _send(self, frames: list[bytes], rank: int) -> Exception | None:
        """Hand frames to the link; the error if it could not (the engine is gone or going).

        The link's supervision fails the link when the engine is gone, so a
        lost ABORT needs nothing more; a lost ADD fails its call (``_unreachable``).
        """
        try:
            self.send_frames(frames, rank)
        except Exception as error:  # LinkFailed, zmq errors: whatever the transport says
            self.send_errors += 1
            log.warning("could not send a frame to the engine: %s: %s", type(error).__name__, error)
            return error
        return None

    def _abort_choices(self, choices: Sequence[Choice]) -> None:
        """ABORT the engine requests of these choices, one frame per rank holding some; retire them."""
        by_rank: dict[int, list[str]] = {}
        for choice in choices:
            if choice.rank is not None:
                by_rank.setdefault(choice.rank, []).append(choice.engine_id)
                self._release_rank(choice)
        for rank, engine_ids in by_rank.items():
            self._send(self.codec.encode_abort(engine_ids), rank)
            self._retire(engine_ids)

    def _release_rank(self, choice: Choice) -> None:
        """The engine request of this choice is over for us: its rank's in-flight count drops once."""
        if choice.rank is not None:
            self.ranks.ended(choice.rank)
            choice.rank = None

    def _retire(self, engine_ids: Sequence[str]) -> None:
        retired = self.retired
        for engine_id in engine_ids:
            retired[engine_id] = None
            retired.move_to_end(engine_id)
        while len(retired) > RETIRED_ENGINE_IDS_MAX:
            retired.popitem(last=False)

    def release_kv(self, request_id: str, params: dict, now: float) -> bool:
        """Tell the engine about a decode-side PD request the servicer refused.

        The prefill side holds the request's KV until the decode side pulls it
        or the connector's lease runs out (NIXL: 30 s). vLLM frees it at once
        when the decode engine sees the request added and aborted in one go
        (``abort_immediately``, what ``AsyncLLM.notify_kv_transfer_request_rejected``
        sends): its connector's ``request_finished`` hook tells the prefill
        side. The engine runs nothing for it and answers nothing. The engine id
        takes a reserved prefix, so it never names a client's call. True when
        the ADD went out; nothing is sent while the engine is not up.
        """
        if self.link.state not in (LinkState.SERVING, LinkState.WARMING_UP, LinkState.DRAINING):
            return False
        self.kv_releases += 1
        engine_id = f"{KV_RELEASE_REQUEST_PREFIX}{self.kv_releases}-{request_id}"
        spec = GenerateSpec(
            request_id=engine_id,
            prompt_token_ids=[0],
            sampling=SamplingSpec(max_tokens=1),
            arrival_time=now,
            kv_transfer_params=params,
            abort_immediately=True,
        )
        # Added and aborted at once, it is never in flight: not counted on a rank. The first
        # rank's connector takes it (with several DP ranks any rank's connector frees the
        # prefill side; the refused call was never given a rank).
        first_rank = self.ranks.ranks[0] if self.ranks.ranks else 0
        error = self._send(self.codec.encode_add(spec), first_rank)
        self.journal.append(
            now,
            request_stream(request_id),
            KIND_ENGINE_KV_RELEASE,
            {"link": self.link.name, "request_id": request_id, "engine_id": engine_id, "sent": error is None},
        )
        return error is None

    # -- engine outputs ---------------------------------------------------------------

    def on_batch(self, batch: OutputBatch, now: float) -> int:
        """Fan one decoded frame out to its calls; returns the tokens it carried."""
        try:
            return self._fan_out(batch, now)
        finally:
            if self.end_of_batch is not None:
                self.end_of_batch()

    def _fan_out(self, batch: OutputBatch, now: float) -> int:
        by_engine_id = self.by_engine_id
        cached_tokens = self.cached_tokens
        generated = 0
        for out in batch.outputs:
            entry = by_engine_id.get(out.request_id)
            if entry is None:
                # Outputs for a request we already ended (abort, stop string) are expected.
                self.late_outputs += 1
                continue
            call, choice = entry
            if call.machine.state is RequestState.ADMITTED:
                self._step(call, RequestEvent.FIRST_OUTPUT, now)
                call.metrics.first_output(now - call.admitted_at)
            if choice.tokens_engine == 0:
                choice.first_token_at = now
                if cached_tokens is not None:
                    choice.cached_tokens = cached_tokens(out) or 0
            tokens = out.new_token_ids
            if tokens:
                choice.last_token_at = now
                generated += len(tokens)
                choice.tokens_engine += len(tokens)
                if choice.stops is not None:
                    tokens, matched = choice.stops.feed(tokens)
                    if matched is not None:
                        choice.matched_str = matched
                        choice.finish_reason = "stop"
                        # The engine does not do stop strings: stop it ourselves.
                        self._abort_choices([choice])
                choice.pending += tokens
                if choice.output is not None:
                    choice.output += tokens
            if out.kv_transfer_params is not None:
                choice.kv_transfer_params = out.kv_transfer_params
            if choice.logprobs is not None and not self._logprobs(call, choice, out, batch.frames, tokens, now):
                continue
            if out.finish_reason is not None and choice.finish_reason is None:
                # A pooling request's result comes with its finish (vLLM: one output, no tokens).
                choice.pooled = getattr(out, "pooling_output", None)
                reason = FinishReason(out.finish_reason)
                if reason is FinishReason.ERROR and call.spec.constraint is not None:
                    self._constraint_failed(call, choice, now)
                    continue
                if reason is FinishReason.ABORT:
                    # Our own aborts are never heard of again (their ids are retired): the engine gave
                    # this request up by itself, which vLLM does when it is stopping (a shutdown in
                    # abort mode; vLLM's DP launcher stops every rank so when one rank dies). The
                    # engine's failure, as for a dead engine: UNAVAILABLE, retryable.
                    self._release_rank(choice)  # over on the engine: not aborted again
                    self._fail_call(call, "the engine aborted the request itself (it is stopping); "
                                    "retry on another worker", now)
                    continue
                choice.finish_reason = reason.contract_name
                if reason is FinishReason.STOP and isinstance(out.stop_reason, int):
                    choice.matched_token = out.stop_reason
                elif reason is FinishReason.STOP and isinstance(out.stop_reason, str):
                    choice.matched_str = out.stop_reason
            if choice.finish_reason is not None:
                self._release_rank(choice)
                del by_engine_id[choice.engine_id]
                call.open_choices -= 1
                if call.open_choices == 0:
                    self._end(call, RequestEvent.FINISH, now)
            if not self._write_now(call, now):
                call.wake.set()
        return generated

    def _write_now(self, call: Call, now: float) -> bool:
        """Write a streaming call's new messages from here, without waking its writer.

        Only for a call whose writer is idle with nothing queued, so the order
        on the wire is the order taken (``take``, which journals completes).
        What cannot go now becomes the writer's backlog. A call whose every
        complete went out gets its OK trailers here too: the client starts its
        next call when they arrive, and from here they leave with this engine
        frame's writes instead of after the writer's wake-up
        (docs/benchmarks.md). True when nothing is left for the writer; a call
        that is done always wakes its writer, which returns.
        """
        direct = call.direct
        if (direct is None or call.writer_busy or call.backlog or call.error is not None
                or call.wake.is_set()):
            return False
        if call.open_choices == 1 and call.plain_one:
            # The common call (one choice, streaming): its chunk encoded straight to bytes.
            choice = call.choices[0]
            tokens = choice.pending
            if not tokens:
                return True
            if direct.send_bodies((stream_chunk_body(tokens, call.prompt_tokens, choice.cached_tokens, choice.index),)):
                choice.take_pending()
                self.direct_writes += 1
                return True
        messages = self.take(call, now)
        written = direct.send(messages)
        self.direct_writes += written
        if written < len(messages):
            self.direct_handovers += 1
            call.backlog = messages[written:]
            return False
        if not call.done:
            return True
        direct.end_ok()  # if it could not, the writer's return sends them (grpclib)
        return False

    def _logprobs(self, call: Call, choice: Choice, out, frames, kept: list[int], now: float) -> bool:
        """Feed one output's logprobs to the choice; False if they failed the call (unreadable)."""
        try:
            sample, prompt = self.codec.logprobs(out, frames)
            choice.logprobs.feed(sample, prompt, len(out.new_token_ids), kept, call.spec.prompt_token_ids)
        except WireError as error:
            self.logprob_errors += 1
            log.warning("request %s: unreadable logprobs from the engine: %s", call.spec.request_id, error)
            self._fail_call(call, f"engine sent logprobs enginelink cannot read ({error}); retry", now)
            return False
        return True

    def _fail_call(self, call: Call, message: str, now: float) -> None:
        """One call fails on the engine's account (the rest of the batch goes on): its open engine requests are aborted."""
        self._abort_choices([c for c in call.choices if not c.finished])
        self._end_failed(call, message, now)

    def _end_failed(self, call: Call, message: str, now: float) -> None:
        """End an open call with UNAVAILABLE (the engine's fault): its ids leave the routing table."""
        call.error = EngineFailure(message)
        for choice in call.choices:
            self._release_rank(choice)
            self.by_engine_id.pop(choice.engine_id, None)
        call.open_choices = 0
        self._end(call, RequestEvent.FAIL, now)
        call.wake.set()

    # -- ending calls -----------------------------------------------------------------

    def abort(self, request_ids: Sequence[str], reason: str, now: float) -> int:
        """Abort calls by id (unknown ids are a no-op); returns how many were open."""
        aborted = 0
        for request_id in request_ids:
            call = self.calls.get(request_id)
            if call is None or not call.machine.open:
                continue
            aborted += 1
            self.journal.append(
                now, request_stream(request_id), KIND_CLIENT_ABORT, {"request_ids": [request_id], "reason": reason}
            )
            # vLLM sends nothing back for a client abort: we end the choices ourselves,
            # each ABORT to the rank that holds the request.
            self._abort_choices([c for c in call.choices if not c.finished])
            for choice in call.choices:
                if not choice.finished:
                    choice.finish_reason = "abort"
                    self.by_engine_id.pop(choice.engine_id, None)
            call.open_choices = 0
            self._end(call, RequestEvent.ABORT, now)
            call.wake.set()
        return aborted

    def _constraint_failed(self, call: Call, failed: Choice, now: float) -> None:
        """The engine ended a choice of a constrained call with an error: the call fails, naming the constraint.

        vLLM's wire says only ERROR. On a constrained request that is its
        grammar backend refusing the constraint (it did not compile) or a token
        (docs/structured-outputs.md); an "error" complete with OK status would
        look like an empty answer to the client. The other choices stop: the
        same constraint holds for them.
        """
        self._release_rank(failed)  # the engine finished this one itself
        self.by_engine_id.pop(failed.engine_id, None)
        others = [c for c in call.choices if c is not failed and c.engine_id in self.by_engine_id]
        for choice in others:
            del self.by_engine_id[choice.engine_id]
        self._abort_choices(others)
        call.error = ConstraintFailed(
            call.spec.constraint,
            f"the engine ended the request with an error under its {call.spec.grammar_backend} grammar backend "
            "(a constraint it cannot compile, or a token it rejected; the engine's log has the cause)",
        )
        log.info("request %r: %s", call.spec.request_id, call.error)
        call.open_choices = 0
        self._end(call, RequestEvent.FAIL, now)
        call.wake.set()

    def fail_all(self, message: str, now: float) -> int:
        """The engine is gone: every open call ends with UNAVAILABLE."""
        failed = 0
        for call in list(self.calls.values()):
            if not call.machine.open:
                continue
            failed += 1
            self._end_failed(call, message, now)
        return failed

    def take(self, call: Call, now: float) -> list[pb.GenerateResponse]:
        """The messages a call's writer should send now; journals completed choices."""
        unsent = [c for c in call.choices if not c.complete_sent]
        messages = call.take_messages()
        if call.backlog:
            messages = call.backlog + messages
            call.backlog = []
        for choice in unsent:
            if choice.complete_sent:
                self._journal_sent(call, choice, now)
        if call.done:
            self.release(call)
        return messages

    def release(self, call: Call) -> None:
        """The call's writer is gone (done, failed or cancelled): its id is free again."""
        if self.writing.get(call.spec.request_id) is call:
            del self.writing[call.spec.request_id]

    def _journal_sent(self, call: Call, choice: Choice, now: float) -> None:
        gaps = choice.tokens_engine - 1
        mean_gap = (choice.last_token_at - choice.first_token_at) / gaps if gaps > 0 else None
        call.metrics.choice_done(choice.finish_reason, choice.tokens_sent, choice.cached_tokens, mean_gap)
        self.journal.append(
            now,
            request_stream(call.spec.request_id),
            KIND_CLIENT_SENT,
            {
                "request_id": call.spec.request_id,
                "index": choice.index,
                "tokens_sent": choice.tokens_sent,
                "tokens_engine": choice.tokens_engine,
                "finish_reason": choice.finish_reason,
            },
        )

    def _end(self, call: Call, event: RequestEvent, now: float) -> None:
        if call.machine.state is RequestState.ADMITTED and event is RequestEvent.FINISH:
            self._step(call, RequestEvent.FIRST_OUTPUT, now)
        self._step(call, event, now)
        self.calls.pop(call.spec.request_id, None)
        for choice in call.choices:
            if choice.stops is not None:
                self.stop_chars += choice.stops.chars
                self.stop_steps += choice.stops.steps
        if not call.done:
            self.writing[call.spec.request_id] = call
        call.metrics.call_ended(now - call.admitted_at, call.error.status.name if call.error else None)

    def _step(self, call: Call, event: RequestEvent, now: float) -> None:
        transition: Transition = call.machine.handle(event, now)
        self.journal.append(now, request_stream(call.spec.request_id), KIND_TRANSITION, transition.payload())

    @property
    def active_requests(self) -> int:
        return len(self.calls)

    def oldest_admitted_at(self) -> float | None:
        """When the oldest call still in flight was admitted; None when none is.

        ``calls`` keeps admission order (a dict), so the oldest is its first entry.
        """
        for call in self.calls.values():
            return call.admitted_at
        return None
