"""The request core: every Generate in flight, and what each engine frame, abort or writer means for it.

Sans-io, h11-style (as ``kv_relay.py``): the shell (``runtime/requests/hub.py``) hands
it events — a call admitted, its ADDs sent or not, an engine output batch, an
abort, the engine gone, a writer taking or leaving, a PD release — and gets
back ``Actions`` (journal records, ABORT frames per DP rank, calls to write
or wake) or the messages a writer should send, contract-neutral
(``request_api.Chunk`` / ``Complete``; each contract's edge encodes them).
No I/O, no clock (``now`` is an argument), no protobuf, no event loop.

Theory of operation. Admission creates the call's ``RequestMachine`` (one
table: its life and its writer, ``request.py``) and one ``Choice`` per
engine request. ``on_batch`` appends each output's new tokens to its
choice's pending list (stop strings cut them, ``stops.py``; logprobs are
kept, ``logprobs.py``), ends choices, and lists each call it touched once
(``Actions.touched``): one write or wake per call per engine frame, and the
writer coalesces what piled up. ``take`` turns what is pending into messages.

Rules:
- one call's bad luck (stop string, abort, a client gone, unreadable
  logprobs, a refused constraint) never touches another call;
- a call ends in exactly one terminal life state, and every choice of a call
  that ends OK gets exactly one complete;
- every life transition is a journal record (``Actions.records``);
- a request id is taken from admission until its writer is done with it
  (``writing``), and an engine id the engine may still answer for is never
  given to another call (``retired``), so no record or output of one call
  is taken for another's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import Callable, Sequence

import msgspec

from enginelink.journal.records import (
    KIND_CLIENT_ABORT,
    KIND_CLIENT_GENERATE,
    KIND_CLIENT_SENT,
    KIND_ENGINE_KV_RELEASE,
    KIND_ENGINE_REQUEST,
    KIND_TRANSITION,
    request_stream,
)
from enginelink.machines import request_resume
from enginelink.journal.states import LinkState, RequestState, WriterState
from enginelink.machines.link import KV_RELEASE_REQUEST_PREFIX, WARMUP_REQUEST_PREFIX, LinkMachine
from enginelink.machines.ranks import RankTable
from enginelink.machines.request import RequestEvent, WriterEvent
from enginelink.machines.request_api import Actions, Failure, GenerateCall, Message, Refusal
from enginelink.machines.request_call import NO_METRICS, Call, Choice
from enginelink.wire.engine import FinishReason, GenerateSpec, OutputBatch, SamplingSpec, WireError

# Calls in flight at once; beyond it admission answers UNAVAILABLE (retryable).
IN_FLIGHT_MAX = 4096
# Engine ids the core stopped listening to before the engine finished them (an
# abort, a stop string): the engine may still send outputs for them, so a new
# call with the same request id gets fresh engine ids (``<engine id>~<n>``)
# instead of taking those outputs for its own. Stale outputs arrive within a
# few engine steps, long before this many more calls were cut short.
RETIRED_ENGINE_IDS_MAX = 65_536

log = logging.getLogger("enginelink.hub")


class KvRelease(msgspec.Struct, frozen=True):
    """A refused PD decode request to tell the engine about (``RequestCore.release_kv``)."""

    request_id: str
    engine_id: str
    spec: GenerateSpec
    rank: int


class RequestCore:
    def __init__(
        self,
        *,
        link: LinkMachine,
        ranks: RankTable | None = None,
        tokenizer=None,
        cached_tokens: Callable[[object], int | None] | None = None,
        logprobs: Callable | None = None,
        in_flight_max: int = IN_FLIGHT_MAX,
        metrics=None,
        resume=None,
    ) -> None:
        self.link = link
        # Engine restarts (machines/resume.py ResumePolicy): None or off, an engine death fails every call.
        self.resume = resume if resume is not None and resume.enabled else None
        self.held: dict[str, Call] = {}  # calls held while the engine restarts, in hold order
        self.resumed_requests = 0  # calls re-submitted to a restarted engine
        self.resume_failures = 0  # calls the engine's death failed although restarts are on (each says why)
        self.reprefilled_tokens = 0  # generated tokens re-sent as prompt to a restarted engine
        # The engine's DP ranks (the link fills them at its handshake); one rank 0 when none given.
        self.ranks = ranks if ranks is not None else RankTable((0,))
        self.tokenizer = tokenizer
        self.cached_tokens = cached_tokens  # the codec's: prefix-cache hits an output reports
        self.decode_logprobs = logprobs  # the codec's: (output, frames) -> (sample rows, prompt rows)
        self.in_flight_max = in_flight_max
        self.metrics = metrics if metrics is not None else NO_METRICS
        self.calls: dict[str, Call] = {}
        # Calls that ended while their writer still has completes to take: the
        # id stays taken until the writer is done with it (``take``/``release``),
        # so a new call with the same id cannot interleave its records with them.
        self.writing: dict[str, Call] = {}
        self.by_engine_id: dict[str, tuple[Call, Choice]] = {}
        self.retired: OrderedDict[str, None] = OrderedDict()
        self.renamed = 0  # calls that got fresh engine ids (see RETIRED_ENGINE_IDS_MAX)
        self.kv_releases = 0  # refused PD decode requests the engine was told about (release_kv)
        self.late_outputs = 0
        self.logprob_errors = 0  # calls failed for logprobs the engine sent unreadable
        # Stop-string matching of the calls that ended: text fed and automaton steps
        # taken (stops.py; steps <= 2 x characters, whatever the stop sets).
        self.stop_chars = 0
        self.stop_steps = 0
        self._batches = 0

    # -- admission -------------------------------------------------------------------

    def admit(self, spec: GenerateCall, now: float, actions: Actions) -> Call | Refusal:
        """A validated call: its machine, its records, its choices' ranks; the shell then sends
        ``call.spec.specs`` in order, each to its choice's rank, and reports ``added`` or ``unreachable``."""
        refusal = self.link.admission_refusal(spec.request_id)
        if refusal is not None:
            return Refusal("unavailable", refusal, self.link.state.value)
        if (
            spec.request_id in self.calls
            or spec.request_id in self.writing
            or any(e in self.by_engine_id for e in spec.engine_ids)
        ):
            return Refusal("duplicate", f"request_id {spec.request_id!r} is already in flight")
        if len(self.calls) >= self.in_flight_max:
            return Refusal("unavailable", f"{len(self.calls)} requests in flight (the limit); retry on another worker",
                           "capacity")
        if spec.stop_strings and self.tokenizer is None:
            return Refusal("unavailable", "stop strings need the model's tokenizer, which this worker could not load",
                           "no_tokenizer")
        if any(e in self.retired for e in spec.engine_ids):
            spec = self._fresh_engine_ids(spec)
            if any(e in self.by_engine_id for e in spec.engine_ids):
                return Refusal("duplicate", f"request_id {spec.request_id!r} is already in flight")
        # The servicer's own warm-up calls stay out of the client-facing metrics.
        metrics = NO_METRICS if spec.request_id.startswith(WARMUP_REQUEST_PREFIX) else self.metrics
        call = Call(spec, now, self.tokenizer, metrics, keep_output=self.resume is not None)
        record = (now, request_stream(spec.request_id), KIND_CLIENT_GENERATE, {
            "request_id": spec.request_id,
            "n": spec.n,
            "prompt_tokens": call.prompt_tokens,
            "stream": spec.stream,
            "max_tokens": spec.max_tokens,
            # An Embed call (runtime/requests/embed.py) goes through the same machine; the journal says which.
            **({"task": spec.task} if getattr(spec, "task", None) else {}),
            # The constraint's field and the backend it was sent for, when the call carries one.
            **({"constraint": spec.constraint, "grammar_backend": spec.grammar_backend}
               if getattr(spec, "constraint", None) else {}),
        })  # fmt: skip
        # Registration is all or nothing: a failure part-way (a rank table or a metric that
        # raises) must not leave the id, an engine id or a rank slot taken by a call nobody holds.
        self.calls[spec.request_id] = call
        try:
            for choice in call.choices:
                self.by_engine_id[choice.engine_id] = (call, choice)
            for choice, engine_spec in zip(call.choices, spec.specs, strict=True):
                # Each engine request picks its rank, as vLLM's DP front end does for n > 1's children.
                choice.rank = self.ranks.pick(engine_spec.data_parallel_rank)
            call.metrics.admitted(call.prompt_tokens, spec.n)
        except Exception:
            self._unregister(call)
            raise
        actions.records.append(record)
        return call

    def _unregister(self, call: Call) -> None:
        """Undo ``admit``'s registration of a call that never became one: its id, engine ids, rank slots."""
        for choice in call.choices:
            self._release_rank(choice)
            if self.by_engine_id.get(choice.engine_id, (None,))[0] is call:
                del self.by_engine_id[choice.engine_id]
        if self.calls.get(call.spec.request_id) is call:
            del self.calls[call.spec.request_id]

    def added(self, call: Call, now: float, actions: Actions) -> None:
        """Every ADD of the call reached the link."""
        actions.records.append((now, request_stream(call.spec.request_id), KIND_ENGINE_REQUEST, {
            "link": self.link.name, "request_ids": call.spec.engine_ids, "prompt_tokens": call.prompt_tokens,
            "ranks": [choice.rank for choice in call.choices]}))  # fmt: skip

    def unreachable(self, call: Call, failed_index: int, error: str, now: float, actions: Actions) -> None:
        """The ADD of choice ``failed_index`` could not be handed to the engine (it is going away):
        the ones before it are aborted, the call fails now."""
        self._abort_choices(call.choices[:failed_index], actions)
        for choice in call.choices[failed_index:]:
            self._release_rank(choice)
        call.failure = Failure("engine", f"engine is not reachable ({error}); retry on another worker")
        for choice in call.choices:
            self.by_engine_id.pop(choice.engine_id, None)
        call.open_choices = 0
        self._end(call, RequestEvent.FAIL, now, actions)
        actions.wake.append(call)

    def abandon(self, call: Call, sent: int, error: str, now: float, actions: Actions) -> None:
        """The servicer itself failed between admission and the engine, ``sent`` of the call's ADDs
        handed over (a request it could not encode for the engine's wire, a record it could not keep):
        its own fault, so the call fails INTERNAL. The ADDs that went out are aborted; the call's id,
        engine ids and rank slots are free at once, since no writer ever got the call to free them.

        Whatever step failed, nothing of the call survives: this is what keeps one bad request
        from holding a slot until the servicer refuses everyone (``IN_FLIGHT_MAX``).
        """
        if call.machine.open:
            self._abort_choices(call.choices[:sent], actions)
            for choice in call.choices:
                self._release_rank(choice)
                self.by_engine_id.pop(choice.engine_id, None)
            call.failure = Failure("status", f"the servicer failed before the engine got the request ({error})",
                                   code="INTERNAL")
            call.open_choices = 0
            self._end(call, RequestEvent.FAIL, now, actions)
        self.calls.pop(call.spec.request_id, None)
        self.release(call)

    def _fresh_engine_ids(self, spec: GenerateCall) -> GenerateCall:
        """The call with engine ids no earlier call of this run was cut short under."""
        self.renamed += 1
        suffix = f"~{self.renamed}"
        engine_ids = [engine_id + suffix for engine_id in spec.engine_ids]
        specs = [msgspec.structs.replace(s, request_id=e) for s, e in zip(spec.specs, engine_ids, strict=True)]
        return dataclasses.replace(spec, specs=specs, engine_ids=engine_ids)

    def _abort_choices(self, choices: Sequence[Choice], actions: Actions) -> None:
        """ABORT the engine requests of these choices, one frame per rank holding some; retire them."""
        by_rank: dict[int, list[str]] = {}
        for choice in choices:
            if choice.rank is not None:
                by_rank.setdefault(choice.rank, []).append(choice.engine_id)
                self._release_rank(choice)
        for rank, engine_ids in by_rank.items():
            actions.aborts.append((rank, engine_ids))
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

    # -- PD early release ---------------------------------------------------------------

    def release_kv(self, request_id: str, params: dict, now: float) -> KvRelease | None:
        """A decode-side PD request the servicer refused, to send to the engine added-and-aborted.

        The prefill side holds the request's KV until the decode side pulls it
        or the connector's lease runs out (NIXL: 30 s). vLLM frees it at once
        when the decode engine sees the request added and aborted in one go
        (``abort_immediately``, what ``AsyncLLM.notify_kv_transfer_request_rejected``
        sends): its connector's ``request_finished`` hook tells the prefill
        side. The engine runs nothing for it and answers nothing. The engine id
        takes a reserved prefix, so it never names a client's call. None while
        the engine is not up: nothing to send.
        """
        if self.link.state not in (LinkState.SERVING, LinkState.WARMING_UP, LinkState.DRAINING):
            return None
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
        return KvRelease(request_id, engine_id, spec, self.ranks.ranks[0] if self.ranks.ranks else 0)

    def kv_released(self, release: KvRelease, sent: bool, now: float, actions: Actions) -> None:
        actions.records.append((now, request_stream(release.request_id), KIND_ENGINE_KV_RELEASE, {
            "link": self.link.name, "request_id": release.request_id, "engine_id": release.engine_id,
            "sent": sent}))  # fmt: skip

    # -- engine outputs ---------------------------------------------------------------

    def on_batch(self, batch: OutputBatch, now: float, actions: Actions, *, same_burst: bool = False) -> int:
        """Fan one decoded frame out to its calls; returns the tokens it carried.

        ``same_burst``: this frame came in the same wake-up as the previous one,
        and the shell writes the calls both touched once, after the last
        (``RequestHub.hold_writes``): a call the burst already listed in an
        earlier ``touched`` is not listed again, its tokens pile up in its choice."""
        if not same_burst:
            self._batches += 1
        mark = self._batches
        touched = actions.touched
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
            if call.touched_at != mark:
                call.touched_at = mark
                touched.append(call)
            if call.machine.state is RequestState.ADMITTED:
                self._step(call, RequestEvent.FIRST_OUTPUT, now, actions)
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
                        choice.reasoning_tokens = getattr(out, "reasoning_tokens", 0)
                        # The engine does not do stop strings: stop it ourselves.
                        self._abort_choices([choice], actions)
                choice.pending += tokens
                if choice.output is not None:
                    choice.output += tokens
            if out.kv_transfer_params is not None:
                choice.kv_transfer_params = out.kv_transfer_params
            if choice.logprobs is not None and not self._logprobs(call, choice, out, batch.frames, tokens, now,
                                                                  actions):
                continue
            if out.finish_reason is not None and choice.finish_reason is None:
                # A pooling request's result comes with its finish (vLLM: one output, no tokens).
                choice.pooled = getattr(out, "pooling_output", None)
                # Read once, at the end: SGLang's count is a running total (vLLM's outputs have none).
                choice.reasoning_tokens = getattr(out, "reasoning_tokens", 0)
                reason = FinishReason(out.finish_reason)
                # A constraint failure only on the engine's own attribution (its wire names the cause: SGLang's
                # grammar-attributed abort), never inferred from the call carrying a constraint: vLLM's ERROR
                # says nothing of the cause (a failed KV load, an encoder-cache miss end so too), so a
                # constrained call's ERROR ends like any other's, as the reference's servicers answer it.
                outcome = getattr(out, "engine_outcome", None)  # a wire that says why it aborted (SGLang)
                if reason is FinishReason.ABORT and outcome is not None and outcome.code is not None:
                    self._release_rank(choice)  # over on the engine: not aborted again
                    if outcome.trailer is not None:  # a grammar the engine refused or could not follow
                        failure = Failure("constraint", outcome.message, call.spec.constraint or "sampling_params")
                    else:
                        failure = Failure("status", outcome.message, code=outcome.code)
                    self._fail_call(call, outcome.message, now, actions, failure)
                    continue
                if reason is FinishReason.ABORT:
                    # Our own aborts are never heard of again (their ids are retired): the engine gave
                    # this request up by itself, which vLLM does when it is stopping (a shutdown in
                    # abort mode; vLLM's DP launcher stops every rank so when one rank dies). The
                    # engine's failure, as for a dead engine: UNAVAILABLE, retryable.
                    self._release_rank(choice)  # over on the engine: not aborted again
                    self._fail_call(call, "the engine aborted the request itself (it is stopping); "
                                    "retry on another worker", now, actions)
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
                    self._end(call, RequestEvent.FINISH, now, actions)
        return generated

    def _logprobs(self, call: Call, choice: Choice, out, frames, kept: list[int], now: float,
                  actions: Actions) -> bool:
        """Feed one output's logprobs to the choice; False if they failed the call (unreadable)."""
        try:
            sample, prompt = self.decode_logprobs(out, frames)
            choice.logprobs.feed(sample, prompt, len(out.new_token_ids), kept, call.spec.prompt_token_ids)
        except WireError as error:
            self.logprob_errors += 1
            log.warning("request %s: unreadable logprobs from the engine: %s", call.spec.request_id, error)
            self._fail_call(call, f"engine sent logprobs enginelink cannot read ({error}); retry", now, actions)
            return False
        return True

    def _fail_call(self, call: Call, message: str, now: float, actions: Actions,
                   failure: Failure | None = None) -> None:
        """One call fails on the engine's account (the rest of the batch goes on): its open engine requests are aborted."""
        self._abort_choices([c for c in call.choices if not c.finished], actions)
        self._end_failed(call, message, now, actions, failure)

    def _end_failed(self, call: Call, message: str, now: float, actions: Actions,
                    failure: Failure | None = None) -> None:
        """End an open call with UNAVAILABLE (the engine's fault), or ``failure``: its ids leave the routing table."""
        call.failure = failure or Failure("engine", message)
        for choice in call.choices:
            self._release_rank(choice)
            self.by_engine_id.pop(choice.engine_id, None)
        call.open_choices = 0
        self._end(call, RequestEvent.FAIL, now, actions)
        actions.wake.append(call)

    # -- ending calls -----------------------------------------------------------------

    def abort(self, request_ids: Sequence[str], reason: str, now: float, actions: Actions) -> int:
        """Abort calls by id (unknown or ended ids are a no-op); returns how many were open."""
        aborted = 0
        for request_id in request_ids:
            call = self.calls.get(request_id)
            if call is None or not call.machine.open:
                continue
            aborted += 1
            actions.records.append((now, request_stream(request_id), KIND_CLIENT_ABORT,
                                    {"request_ids": [request_id], "reason": reason}))
            # vLLM sends nothing back for a client abort: we end the choices ourselves,
            # each ABORT to the rank that holds the request.
            self._abort_choices([c for c in call.choices if not c.finished], actions)
            for choice in call.choices:
                if not choice.finished:
                    choice.finish_reason = "abort"
                    self.by_engine_id.pop(choice.engine_id, None)
            call.open_choices = 0
            self._end(call, RequestEvent.ABORT, now, actions)
            actions.wake.append(call)
        return aborted

    def fail_all(self, message: str, now: float, actions: Actions) -> int:
        """The engine is gone: every open call ends with UNAVAILABLE."""
        failed = 0
        for call in list(self.calls.values()):
            if not call.machine.open:
                continue
            failed += 1
            self._end_failed(call, message, now, actions)
        return failed

    # -- engine restarts (machines/request_resume.py) -------------------------------------

    hold_all = request_resume.hold_all
    resume_held = request_resume.resume_held
    resumed = request_resume.resumed
    resume_unreachable = request_resume.resume_unreachable
    fail_held = request_resume.fail_held

    def _end(self, call: Call, event: RequestEvent, now: float, actions: Actions) -> None:
        if call.machine.state is RequestState.ADMITTED and event is RequestEvent.FINISH:
            self._step(call, RequestEvent.FIRST_OUTPUT, now, actions)
        self._step(call, event, now, actions)
        self.calls.pop(call.spec.request_id, None)
        if call.held_at is not None:
            call.held_at = None
            self.held.pop(call.spec.request_id, None)
        for choice in call.choices:
            if choice.stops is not None:
                self.stop_chars += choice.stops.chars
                self.stop_steps += choice.stops.steps
        if not call.done:
            self.writing[call.spec.request_id] = call
        call.metrics.call_ended(now - call.admitted_at, _status_name(call.failure))

    def _step(self, call: Call, event: RequestEvent, now: float, actions: Actions) -> None:
        transition = call.machine.handle(event, now)
        actions.records.append((now, request_stream(call.spec.request_id), KIND_TRANSITION, transition.payload()))

    # -- the writer -------------------------------------------------------------------

    def woken(self, call: Call) -> None:
        """The call's writer was woken (it has something to take, or must return)."""
        call.machine.writer_step(WriterEvent.WAKE)

    def left_behind(self, call: Call) -> None:
        """The fan-out wrote part of what it took: the rest waits for the writer."""
        call.machine.writer_step(WriterEvent.LEFT_BEHIND)

    def written(self, call: Call) -> None:
        """The writer wrote everything it took."""
        call.machine.writer_step(WriterEvent.WRITTEN)

    def take_direct(self, call: Call) -> list[int]:
        """The one choice's pending tokens, written by the fan-out as one chunk (``Call.plain_one``)."""
        return call.choices[0].take_pending()

    def take(self, call: Call, now: float, actions: Actions, *, writer: bool = True) -> list[Message]:
        """The messages to send now, in order; journals completed choices. ``writer``: the call's
        writer takes (False: the fan-out, writing for an idle writer)."""
        if writer:
            call.machine.writer_step(WriterEvent.TAKE)
        unsent = [c for c in call.choices if not c.complete_sent]
        messages = call.take_messages()
        for choice in unsent:
            if choice.complete_sent:
                self._journal_sent(call, choice, now, actions)
        if call.done and call.machine.writer is not WriterState.DONE:
            self.release(call)
        return messages

    def release(self, call: Call) -> None:
        """The call's writer is done with it (all taken, failed or gone): its id is free again."""
        if call.machine.writer is not WriterState.DONE:
            call.machine.writer_step(WriterEvent.ALL_TAKEN if call.done else WriterEvent.RELEASE)
        if self.writing.get(call.spec.request_id) is call:
            del self.writing[call.spec.request_id]

    def _journal_sent(self, call: Call, choice: Choice, now: float, actions: Actions) -> None:
        gaps = choice.tokens_engine - 1
        mean_gap = (choice.last_token_at - choice.first_token_at) / gaps if gaps > 0 else None
        call.metrics.choice_done(choice.finish_reason, choice.tokens_sent, choice.cached_tokens, mean_gap)
        actions.records.append((now, request_stream(call.spec.request_id), KIND_CLIENT_SENT, {
            "request_id": call.spec.request_id,
            "index": choice.index,
            "tokens_sent": choice.tokens_sent,
            "tokens_engine": choice.tokens_engine,
            "finish_reason": choice.finish_reason,
        }))  # fmt: skip

    # -- views ------------------------------------------------------------------------

    @property
    def active_requests(self) -> int:
        return len(self.calls)

    def oldest_admitted_at(self) -> float | None:
        """When the oldest call still in flight was admitted (``calls`` keeps admission order); None when none is."""
        for call in self.calls.values():
            return call.admitted_at
        return None


def _status_name(failure: Failure | None) -> str | None:
    """The status a failure ends with, for metrics (``runtime/errors.py`` maps the same way)."""
    if failure is None:
        return None
    if failure.kind == "status":
        return failure.code
    return "FAILED_PRECONDITION" if failure.kind == "constraint" else "UNAVAILABLE"
