"""One choice's logprobs, between the engine's rows and a contract's messages.

The engine (``wire/engine.py`` ``LogprobRows``) gives, per position, its own
token in column 0 and the top-k in columns 1..k, descending. This keeps a
choice's positions, contract-neutral: each contract's edge turns them into
its messages (vLLM's: ``runtime/contracts/vllm/edge.py``, ``OutputLogProbs`` /
``InputLogProbs``).

**The top-k decision.** The reference servicer's first releases listed "the
first k entries" of vLLM's per-position dict, which vLLM builds as
``{sampled, top1, top2, …}``: when the sampled token is outside the top-k
that list is the sampled token plus the top k-1, and the true k-th token is
missing. Later releases sort the dict and take k, which is the true top-k.
enginelink keeps the **true top-k, descending: columns 1..k** (for -1, every
column: the whole vocabulary). The sampled token's own logprob is always
kept, so nothing is lost. ``docs/architecture.md`` ("Logprobs") records it.

What a call's messages carry (as the reference servicer does):
- streaming: each chunk carries the logprobs of its own tokens (deltas);
  the prompt's go with the choice's first chunk only; the stream's
  complete repeats the last chunk's, as it repeats its tokens;
- non-streaming: the complete carries all of them and the prompt's;
- prompt position 0 has no logprob (``PromptLogprobs``: ``positions`` starts
  at position 1).

Memory: a streaming choice holds only what its writer has not taken yet; a
non-streaming one holds every position until its complete, compactly: the
engine's rows copied out of its frame as they came (``array``s of the
wire's own 4-byte values, not Python floats), tokens x (k + 1) x 8 bytes
(the engine's columns when it sent more than k + 1), bounded by the context
and the engine's ``--max-logprobs`` (docs/limits.md, "Logprobs").

Cost (issue 38): what the engine sends is kept as ``LogprobRun``s, one per
engine output, each made with a few C-level copies whatever its size, so an
engine frame carrying a long prompt's logprobs for many choices costs the
receive loop microseconds per choice, never per position. The per-position
work (a protobuf entry per position) is the writer's, which does it in
slices of at most ``SLICE_ENTRIES`` entries (``runtime/requests/logprob_bytes.py``).
Sans-io, no contract types.
"""

from __future__ import annotations

import array
from typing import Iterator, NamedTuple, Sequence

from enginelink.wire.engine import LogprobRows, WireError

# Logprob entries (a position's own value, plus one per top entry) one slice of a
# message's encoding may fill: ~1-2 ms of protobuf work on a slow core
# (docs/limits.md, "Logprobs"); the writer yields between slices.
SLICE_ENTRIES = 4096

# One position, as a contract fills it: (its token's logprob, its token id, top values, top ids);
# the tops are None when k = 0.
Position = tuple[float, int, "memoryview | None", "memoryview | None"]


class LogprobRun(NamedTuple):
    """Consecutive positions' logprobs, copied out of one engine output.

    ``rows`` rows of ``cols`` columns each, flat in row order: column 0 is the
    position's own token and logprob, columns 1..``top`` its top entries,
    descending (the engine may have sent more columns than ``top``; a run
    that carries no top entries keeps column 0 only).
    """

    rows: int
    cols: int
    top: int
    token_ids: array.array
    values: array.array

    @property
    def entries(self) -> int:
        """What a message carries of it: each position's own value and its top entries."""
        return self.rows * (self.top + 1)

    def own_values(self, first: int = 0, last: int | None = None) -> memoryview:
        """Column 0's logprobs, rows ``first..last`` (a strided view: no copy)."""
        cols = self.cols
        return memoryview(self.values)[first * cols:(self.rows if last is None else last) * cols:cols]

    def own_ids(self, first: int = 0, last: int | None = None) -> memoryview:
        cols = self.cols
        return memoryview(self.token_ids)[first * cols:(self.rows if last is None else last) * cols:cols]

    def top_of(self, row: int) -> tuple[memoryview, memoryview]:
        """Row ``row``'s top values and ids (views)."""
        base = row * self.cols + 1
        return memoryview(self.values)[base:base + self.top], memoryview(self.token_ids)[base:base + self.top]

    def positions(self) -> Iterator[Position]:
        """Each row as a ``Position`` (per-position Python objects: for small uses and tests)."""
        values, ids = self.own_values().tolist(), self.own_ids().tolist()
        for row in range(self.rows):
            if self.top:
                top_values, top_ids = self.top_of(row)
                yield values[row], ids[row], top_values, top_ids
            else:
                yield values[row], ids[row], None, None


def positions_of(runs: Sequence[LogprobRun]) -> list[Position]:
    """Every position of ``runs``, in order (``LogprobRun.positions``)."""
    return [position for run in runs for position in run.positions()]


def count_positions(runs: Sequence[LogprobRun]) -> int:
    return sum(run.rows for run in runs)


def count_entries(runs: Sequence[LogprobRun]) -> int:
    return sum(run.rows * (run.top + 1) for run in runs)


def slices(runs: Sequence[LogprobRun], entries: int = SLICE_ENTRIES) -> Iterator[list[tuple[int, LogprobRun, int, int]]]:
    """The runs cut into slices of at most ``entries`` entries (at least one row each): each slice a list
    of ``(position, run, first, last)``, rows ``first..last`` of ``run``, ``position`` the first row's place
    among all the runs' rows. Small runs (a decode step's one row each) share a slice."""
    piece: list[tuple[int, LogprobRun, int, int]] = []
    room = entries
    position = 0
    for run in runs:
        width = run.top + 1
        first = 0
        while first < run.rows:
            rows = min(run.rows - first, max(1, room // width))
            if piece and rows * width > room:
                yield piece
                piece, room = [], entries
                continue
            piece.append((position + first, run, first, first + rows))
            room -= rows * width
            first += rows
            if room <= 0:
                yield piece
                piece, room = [], entries
        position += run.rows
    if piece:
        yield piece


class PromptLogprobs(NamedTuple):
    """The prompt's logprobs from its position ``start`` (0 but for SGLang's ``logprob_start_len``): ``ids``
    are the prompt's tokens ``start .. start + positions``, and the runs' row i is the logprob of
    ``ids[i + 1]`` (``ids[0]`` has none: position 0 has no logprob, a later start begins the slice)."""

    top: int
    ids: list[int]
    runs: list[LogprobRun]

    @property
    def positions(self) -> list[Position]:
        return positions_of(self.runs)

    @property
    def entries(self) -> int:
        return count_entries(self.runs) + 1


def _view(seq: Sequence, typecode: str, stop: int) -> memoryview:
    """The wire's values as a typed view: vLLM's are views of the frame already; a wire that
    decodes them to lists (SGLang's, TokenSpeed's) gets its first ``stop`` copied once."""
    if isinstance(seq, (memoryview, array.array)):
        return memoryview(seq)
    return memoryview(array.array(typecode, seq[:stop]))


def _into(out: array.array | None, view: memoryview, stop: int, step: int) -> array.array:
    """``view[:stop:step]`` appended to ``out`` (a new array when None): one C copy for whole rows."""
    if out is None:
        out = array.array(view.format)
    if step == 1:
        out.frombytes(view[:stop].cast("B"))
    else:
        out.fromlist(view[:stop:step].tolist())
    return out


def _add_run(runs: list[LogprobRun], rows: LogprobRows, count: int, top: int,
             expected: Sequence[int] | None) -> None:
    """Rows ``0..count`` after ``runs``, with ``top`` top entries (-1: all of them); nothing when ``count`` is 0.

    A few C-level copies whatever ``count`` (issue 38): no Python object per position. Joined to the
    last run when its layout is the same: a non-streaming choice of a thousand decode steps keeps
    one run, its arrays grown in place (amortized), not a thousand.
    """
    if count <= 0:
        return
    cols = rows.cols
    k = cols - 1 if top == -1 else min(top, cols - 1)
    stop = count * cols
    ids, values = _view(rows.token_ids, "q", stop), _view(rows.logprobs, "d", stop)
    if expected is not None:
        own = ids[0:stop:cols].tolist()
        if own != list(expected):
            row = next(r for r, (a, b) in enumerate(zip(own, expected)) if a != b)
            raise WireError(f"logprobs row {row} is for token {own[row]}, but the token there is {expected[row]}")
    step, width = (cols, 1) if k == 0 and cols > 1 else (1, cols)  # top 0: column 0 only, the rest never sent
    last = runs[-1] if runs else None
    if (last is not None and last.cols == width and last.top == k and last.values.typecode == values.format
            and last.token_ids.typecode == ids.format):
        _into(last.token_ids, ids, stop, step)
        _into(last.values, values, stop, step)
        runs[-1] = LogprobRun(last.rows + count, width, k, last.token_ids, last.values)
    else:
        runs.append(LogprobRun(count, width, k, _into(None, ids, stop, step), _into(None, values, stop, step)))


class ChoiceLogprobs:
    """The logprobs of one choice: fed per engine output, taken per message."""

    __slots__ = ("top", "prompt_top", "prompt_start", "pending", "last_delta", "all", "prompt", "prompt_sent")

    def __init__(self, top: int | None, prompt_top: int | None, keep_all: bool, prompt_start: int = 0) -> None:
        self.top = top  # output logprobs: k (-1: all); None: not asked
        self.prompt_top = prompt_top  # prompt logprobs likewise
        self.prompt_start = prompt_start  # the prompt position they start from (its own has none)
        self.pending: list[LogprobRun] = []
        self.last_delta: list[LogprobRun] = []
        self.all: list[LogprobRun] | None = [] if keep_all else None
        self.prompt: PromptLogprobs | None = None
        self.prompt_sent = False

    # -- from the engine -------------------------------------------------------------

    def feed(self, sample: LogprobRows | None, prompt: LogprobRows | None, new_tokens: int,
             kept: Sequence[int], prompt_ids: Sequence[int]) -> None:
        """One engine output: ``new_tokens`` tokens, of which ``kept`` (a stop string may cut them) go on.

        Raises WireError when the rows do not match the tokens (an engine that
        breaks the layout must not give a client someone else's numbers).
        """
        if self.top is not None and new_tokens:
            if sample is None:
                raise WireError(f"the engine sent {new_tokens} tokens without the logprobs the request asked for")
            if sample.rows != new_tokens:
                raise WireError(f"the engine sent {sample.rows} logprob rows for {new_tokens} tokens")
            # A streaming choice's writer takes what is pending; a non-streaming one's complete takes all.
            _add_run(self.pending if self.all is None else self.all, sample, len(kept), self.top, kept)
        if self.prompt_top is not None and prompt is not None and self.prompt is None and not self.prompt_sent:
            # Row r is the logprob of prompt token start + r + 1; the start position has none.
            start = self.prompt_start
            count = min(prompt.rows, len(prompt_ids) - 1 - start)
            runs: list[LogprobRun] = []
            _add_run(runs, prompt, count, self.prompt_top, prompt_ids[start + 1:start + 1 + count])
            self.prompt = PromptLogprobs(self.prompt_top, list(prompt_ids[start:start + count + 1]), runs)

    # -- to the client ---------------------------------------------------------------

    def take_chunk(self) -> tuple[list[LogprobRun], PromptLogprobs | None]:
        """A streaming chunk's logprobs: everything pending, and the prompt's on the first."""
        positions = self.pending
        self.pending = []
        self.last_delta = positions
        return positions, self._prompt_once()

    def take_complete(self, stream: bool) -> tuple[list[LogprobRun], PromptLogprobs | None]:
        if stream:
            return self.last_delta, self._prompt_once()
        runs, prompt = self.all or [], self.prompt
        # Handed over, not kept: a call may outlive its completes in a reference cycle that the
        # collector breaks only much later (gc_policy.py), and these are megabytes for a long
        # vocabulary-wide choice.
        self.pending, self.all, self.prompt, self.prompt_sent = [], [], None, True
        return runs, prompt

    def _prompt_once(self) -> PromptLogprobs | None:
        prompt = self.prompt
        if prompt is not None and not self.prompt_sent:
            self.prompt_sent = True
            self.prompt = None  # handed over (``take_complete``)
            return prompt
        return None
