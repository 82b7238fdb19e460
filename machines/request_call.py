"""One call in flight, as the request core keeps it: its choices, and the messages they make.

``Call`` holds a Generate's state beside its machine (``request.py``): one
``Choice`` per engine request (pending tokens, counts, finish, stop-string
matcher, logprobs, rank). ``take_messages`` turns what is pending into the
contract-neutral messages (``request_api.Chunk`` / ``Complete``): a writer
that fell behind gets several tokens per chunk. Sans-io, no contract types.
"""

from __future__ import annotations

from enginelink.journal.states import WriterState
from enginelink.machines.logprobs import ChoiceLogprobs
from enginelink.machines.request import RequestMachine
from enginelink.machines.request_api import Chunk, Complete, Failure, GenerateCall, Message
from enginelink.machines.stops import StopAutomaton, StopMatcher


class _NoMetrics:
    """Every observation free (warm-up calls, and a core built without metrics)."""

    def __getattr__(self, name: str):
        return _ignore


def _ignore(*args, **kwargs) -> None:
    return None


NO_METRICS = _NoMetrics()


class Choice:
    """One of a call's n samples: one engine request."""

    __slots__ = (
        "index", "engine_id", "pending", "last_delta", "output", "tokens_engine", "tokens_sent",
        "finish_reason", "matched_token", "matched_str", "complete_sent", "stops", "cached_tokens",
        "first_token_at", "last_token_at", "logprobs", "pooled", "kv_transfer_params", "rank", "reasoning_tokens",
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
        # None unless the call asked for logprobs: the calls that did not pay nothing per token for them.
        self.logprobs = logprobs
        self.pooled = None  # a pooling request's result (Embed): a wire.vllm_arrays.Tensor
        self.kv_transfer_params: dict | None = None  # PD: the engine's, for the other leg
        self.rank: int | None = None  # the DP rank holding it, while the engine may (ranks.py)
        # The engine's count of this choice's thinking tokens (SGLang's running total), read at its end.
        self.reasoning_tokens = 0

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
    """One Generate in flight. ``wake``, ``direct``, ``error`` and ``backlog`` are the shell's:
    the core never touches them beyond carrying them."""

    __slots__ = (
        "spec", "machine", "choices", "open_choices", "failure", "admitted_at", "prompt_tokens", "metrics",
        "plain_one", "touched_at", "wake", "direct", "error", "backlog", "resumes", "held_at",
    )

    def __init__(self, spec: GenerateCall, now: float, tokenizer, metrics, keep_output: bool = False) -> None:
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
                # A streaming call keeps its tokens only to be resumed from (engine restarts on).
                keep_output=not spec.stream or keep_output,
                stops=StopMatcher(automaton, tokenizer, spec.skip_special_tokens) if automaton else None,
                logprobs=ChoiceLogprobs(top, prompt_top, keep_all=not spec.stream,
                                        prompt_start=sampling.prompt_logprobs_start) if with_logprobs else None,
            )
            for index, engine_id in enumerate(spec.engine_ids)
        ]
        # One choice and no logprobs: a chunk is tokens and counts only (an edge may hand-encode it).
        self.plain_one = len(self.choices) == 1 and not with_logprobs
        self.open_choices = len(self.choices)
        self.failure: Failure | None = None
        self.metrics = metrics
        self.admitted_at = now
        self.prompt_tokens = len(spec.prompt_token_ids)
        self.touched_at = -1  # the batch that last listed it in Actions.touched
        self.wake = None
        self.direct = None
        self.error = None
        self.backlog: list = []
        self.resumes = 0  # times re-submitted to a restarted engine (machines/resume.py)
        self.held_at: float | None = None  # held since (the engine died; not yet re-submitted)

    @property
    def done(self) -> bool:
        """Nothing more will be taken: failed, or every choice's complete taken."""
        return self.failure is not None or all(c.complete_sent for c in self.choices)

    @property
    def writable(self) -> bool:
        """The fan-out may write this call's messages itself: its writer is idle with nothing queued."""
        return self.machine.writer is WriterState.IDLE and self.failure is None

    def take_messages(self) -> list[Message]:
        """Everything the client should get now, in order: new tokens per choice, then its complete once."""
        messages: list[Message] = []
        stream = self.spec.stream
        for choice in self.choices:
            if stream and choice.pending:
                tokens = choice.take_pending()
                lp = choice.logprobs
                if lp is None:
                    messages.append(Chunk(choice.index, tokens, self.prompt_tokens, choice.cached_tokens,
                                          completion_tokens=choice.tokens_sent))
                else:
                    positions, prompt = lp.take_chunk()
                    messages.append(Chunk(choice.index, tokens, self.prompt_tokens, choice.cached_tokens,
                                          positions if lp.top is not None else None, lp.top or 0, prompt,
                                          choice.tokens_sent))
            if choice.finished and not choice.complete_sent:
                messages.append(self._complete(choice))
        return messages

    def _complete(self, choice: Choice) -> Complete:
        choice.complete_sent = True
        if self.spec.stream:
            output = choice.last_delta  # as the reference servicer: the complete repeats the last delta
        else:
            output = choice.output or []
            choice.pending = []
            choice.tokens_sent = len(output)
        positions, prompt, top = None, None, 0
        if choice.logprobs is not None:
            positions, prompt = choice.logprobs.take_complete(self.spec.stream)
            top = choice.logprobs.top or 0
            if choice.logprobs.top is None:
                positions = None
        return Complete(
            choice.index, output, choice.finish_reason, self.prompt_tokens, choice.cached_tokens,
            matched_stop_str=choice.matched_str,
            matched_token_id=choice.matched_token if choice.matched_str is None else None,
            kv_transfer_params=choice.kv_transfer_params,
            logprobs=positions, logprobs_top=top, prompt_logprobs=prompt, stream=self.spec.stream,
            completion_tokens=choice.tokens_sent, reasoning_tokens=choice.reasoning_tokens,
            media_identity=self.spec.media_identity,
        )
