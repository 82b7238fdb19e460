"""Logprobs into a contract's responses, never more than one slice of work per step (issue 38).

A message with logprobs costs a protobuf entry per position and per top
entry. A non-streaming choice of a long prompt and answer with top-20
logprobs is tens of thousands of entries (~10 ms on a slow core); with
``--max-logprobs -1`` each position carries the whole vocabulary, and one
message is seconds of work. Built at once on the event loop, that work
stalled every other client (issue 38: four legal n = 64 calls, 7.5-7.9 s).

So an edge's ``encode`` fills logprobs at once only up to a budget of
``SLICE_ENTRIES`` entries per call of ``encode`` (``LogprobBudget``); a
response beyond it becomes a ``SlicedResponse``, which its writer
(``runtime/requests/generate.py``) serializes one slice at a time, yielding
to the event loop between slices, and sends as bytes (the gRPC codec takes
bytes as they are: ``runtime/rpc/codec.py``). The hub's fan-out never
writes a ``SlicedResponse`` itself: it is left for the call's writer.

The bytes. Protobuf's wire format lets a message be serialized in pieces:
serializations concatenate into their merge, and a repeated field, packed
or not, appends in order across the pieces. Each slice fills a fresh
``OutputLogProbs`` / ``InputLogProbs`` with its positions and serializes it
(upb, in C); the response's other fields are serialized once; the pieces
are joined under their fields' tags, whose numbers come from the messages'
descriptors (every contract's proto names the fields ``output_logprobs`` and
``input_logprobs``). ``tests/test_logprob_bytes.py`` parses the bytes and
compares them with the message filled at once, for each contract.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from enginelink.machines.logprobs import SLICE_ENTRIES, LogprobRun, PromptLogprobs, count_entries, slices
from enginelink.runtime.requests.chunk_bytes import varint

__all__ = [
    "SLICE_ENTRIES", "LogprobBudget", "SlicedResponse", "fill_output_logprobs", "fill_prompt_logprobs",
    "with_logprobs",
]


# -- filling a message in place ------------------------------------------------------------


def _tops(add, run: LogprobRun, first: int, last: int) -> None:
    """One ``TopLogProbs`` per row ``first..last`` (``add``: the repeated field's). The innermost loop of
    logprobs: array slices (C copies) rather than views, and nothing looked up per row."""
    values, ids, cols, k = run.values, run.token_ids, run.cols, run.top
    for base in range(first * cols + 1, last * cols + 1, cols):
        entry = add()
        entry.values.extend(values[base:base + k])
        entry.token_ids.extend(ids[base:base + k])


def _own(run: LogprobRun, first: int, last: int) -> tuple:
    """Column 0's values and ids of rows ``first..last`` (strided array slices: C copies)."""
    cols = run.cols
    return run.values[first * cols:last * cols:cols], run.token_ids[first * cols:last * cols:cols]


def _output_rows(message, run: LogprobRun, first: int, last: int, top: int) -> None:
    values, ids = _own(run, first, last)
    message.token_logprobs.extend(values)
    message.token_ids.extend(ids)
    if top:
        _tops(message.top_logprobs.add, run, first, last)


def _prompt_head(message, prompt: PromptLogprobs) -> None:
    """Position 0: no logprob (an unset value), and an empty top list."""
    message.token_logprobs.add()
    message.token_ids.append(prompt.ids[0])
    if prompt.top:
        message.top_logprobs.add()


def _prompt_rows(message, prompt: PromptLogprobs, position: int, run: LogprobRun, first: int, last: int,
                 entry_type) -> None:
    """Rows ``first..last`` of ``run``, the prompt's positions ``position + 1..`` (``ids`` has position 0)."""
    values, _ = _own(run, first, last)
    message.token_logprobs.extend([entry_type(value=value) for value in values])
    message.token_ids.extend(prompt.ids[position + 1:position + 1 + last - first])
    if prompt.top:
        _tops(message.top_logprobs.add, run, first, last)


def fill_output_logprobs(message, runs: Sequence[LogprobRun], top: int) -> None:
    """``OutputLogProbs`` in place: each position's logprob and id, and its top-k when ``top`` != 0."""
    for run in runs:
        _output_rows(message, run, 0, run.rows, top)


def fill_prompt_logprobs(message, prompt: PromptLogprobs, entry_type) -> None:
    """``InputLogProbs`` in place; position 0 has no logprob. ``entry_type``: the contract's ``InputTokenLogProb``."""
    _prompt_head(message, prompt)
    position = 0
    for run in prompt.runs:
        _prompt_rows(message, prompt, position, run, 0, run.rows, entry_type)
        position += run.rows


# -- the pieces of a sliced message ----------------------------------------------------------


def _output_pieces(message_type, runs: Sequence[LogprobRun], top: int) -> Iterator[bytes]:
    for piece_rows in slices(runs if top else [r._replace(top=0) for r in runs]):
        piece = message_type()
        for _, run, first, last in piece_rows:
            _output_rows(piece, run, first, last, top)
        yield piece.SerializeToString()


def _prompt_pieces(message_type, prompt: PromptLogprobs, entry_type) -> Iterator[bytes]:
    piece = message_type()
    _prompt_head(piece, prompt)
    yield piece.SerializeToString()
    for piece_rows in slices(prompt.runs):
        piece = message_type()
        for position, run, first, last in piece_rows:
            _prompt_rows(piece, prompt, position, run, first, last, entry_type)
        yield piece.SerializeToString()


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return b"".join((varint(number << 3 | 2), varint(len(payload)), payload))


def _number(message, name: str) -> int:
    return message.DESCRIPTOR.fields_by_name[name].number


class SlicedResponse:
    """A response whose logprobs are serialized by its writer, one slice per step.

    ``steps()`` yields after each slice and leaves the serialized response in
    ``body``; the writer sends ``body`` (bytes: the gRPC codec passes them as
    they are). ``response`` holds everything but the logprobs; ``field`` names
    its sub-message (``chunk`` / ``complete``) that the logprobs go in.
    """

    __slots__ = ("response", "field", "output", "prompt", "entry_type", "body")

    def __init__(self, response, field: str, output: tuple[Sequence[LogprobRun], int] | None,
                 prompt: PromptLogprobs | None, entry_type) -> None:
        self.response = response
        self.field = field
        self.output = output
        self.prompt = prompt
        self.entry_type = entry_type
        self.body: bytes | None = None

    def steps(self) -> Iterator[None]:
        response, field = self.response, self.field
        inner = getattr(response, field)
        parts = [inner.SerializeToString()]
        if self.output is not None:
            target = inner.output_logprobs
            pieces = []
            for piece in _output_pieces(type(target), *self.output):
                pieces.append(piece)
                yield
            parts.append(_field(_number(inner, "output_logprobs"), b"".join(pieces)))
        if self.prompt is not None:
            target = inner.input_logprobs
            pieces = []
            for piece in _prompt_pieces(type(target), self.prompt, self.entry_type):
                pieces.append(piece)
                yield
            parts.append(_field(_number(inner, "input_logprobs"), b"".join(pieces)))
        number = _number(response, field)
        response.ClearField(field)
        self.body = response.SerializeToString() + _field(number, b"".join(parts))
        # What it was made of goes now: a caller's frames may sit in a reference cycle (trio-asyncio's
        # bridge makes some) that the collector breaks only much later (gc_policy.py), and a vocabulary-
        # wide choice's logprobs are megabytes.
        self.response = self.output = self.prompt = None

    def finish(self) -> bytes:
        """All steps at once (a caller that does not write: tests, a discarded take)."""
        for _ in self.steps():
            pass
        return self.body


class LogprobBudget:
    """The logprob entries one ``encode`` may still fill at once (``SLICE_ENTRIES``)."""

    __slots__ = ("left",)

    def __init__(self, entries: int = SLICE_ENTRIES) -> None:
        self.left = entries

    def take(self, entries: int) -> bool:
        if entries > self.left:
            return False
        self.left -= entries
        return True


def with_logprobs(response, field: str, m, entry_type, budget: LogprobBudget | None, *, top: int | None = None):
    """``response`` (its ``field`` sub-message filled but for logprobs) with ``m``'s logprobs:
    filled now when they fit ``budget`` (None: always), else a ``SlicedResponse`` for the writer.

    ``m``: the core's ``Chunk`` / ``Complete``; ``top``: the top-k to fill (default ``m.logprobs_top``;
    TokenSpeed's 0). ``entry_type``: the contract's ``InputTokenLogProb`` (None: no prompt logprobs).
    """
    runs = m.logprobs or None
    prompt = m.prompt_logprobs if entry_type is not None else None
    if runs is None and prompt is None:
        return response
    top = m.logprobs_top if top is None else top
    work = (count_entries(runs) if top else sum(run.rows for run in runs)) if runs else 0
    work += prompt.entries if prompt is not None else 0
    if budget is None or budget.take(work):
        inner = getattr(response, field)
        if runs:
            fill_output_logprobs(inner.output_logprobs, runs, top)
        if prompt is not None:
            fill_prompt_logprobs(inner.input_logprobs, prompt, entry_type)
        return response
    return SlicedResponse(response, field, (runs, top) if runs else None, prompt, entry_type)
