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
non-streaming one holds every position until its complete, compactly
(``array`` of the wire's own 4-byte values, not Python floats): tokens x
(k + 1) x 8 bytes, bounded by the context and the engine's ``--max-logprobs``
(docs/limits.md, "Logprobs"). Sans-io, no contract types.
"""

from __future__ import annotations

import array
from typing import NamedTuple, Sequence

from enginelink.wire.engine import LogprobRows, WireError

# One position: (its token's logprob, its token id, top values, top ids); the tops are None when k = 0.
Position = tuple[float, int, "array.array | None", "array.array | None"]


class PromptLogprobs(NamedTuple):
    """The prompt's logprobs: ``ids`` are the prompt's first ``len(positions) + 1`` tokens, and
    ``positions[i]`` is the logprob of ``ids[i + 1]`` (position 0 has none)."""

    top: int
    ids: list[int]
    positions: list[Position]


def _slice(view, start: int, stop: int) -> array.array:
    out = array.array(view.format)
    out.frombytes(view[start:stop].cast("B"))
    return out


def _positions(rows: LogprobRows, first: int, count: int, top: int, expected: Sequence[int] | None) -> list[Position]:
    """Rows ``first..first+count`` as positions with ``top`` top entries (-1: all of them)."""
    cols = rows.cols
    k = cols - 1 if top == -1 else min(top, cols - 1)
    ids, values = rows.token_ids, rows.logprobs
    positions = []
    for row in range(first, first + count):
        base = row * cols
        token = ids[base]
        if expected is not None and token != expected[row - first]:
            raise WireError(f"logprobs row {row} is for token {token}, but the token there is {expected[row - first]}")
        if k:
            positions.append((values[base], token, _slice(values, base + 1, base + 1 + k),
                              _slice(ids, base + 1, base + 1 + k)))
        else:
            positions.append((values[base], token, None, None))
    return positions


class ChoiceLogprobs:
    """The logprobs of one choice: fed per engine output, taken per message."""

    __slots__ = ("top", "prompt_top", "pending", "last_delta", "all", "prompt", "prompt_sent")

    def __init__(self, top: int | None, prompt_top: int | None, keep_all: bool) -> None:
        self.top = top  # output logprobs: k (-1: all); None: not asked
        self.prompt_top = prompt_top  # prompt logprobs likewise
        self.pending: list[Position] = []
        self.last_delta: list[Position] = []
        self.all: list[Position] | None = [] if keep_all else None
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
            positions = _positions(sample, 0, len(kept), self.top, kept)
            self.pending += positions
            if self.all is not None:
                self.all += positions
        if self.prompt_top is not None and prompt is not None and self.prompt is None:
            # Row r is the logprob of prompt token r + 1; position 0 has none.
            count = min(prompt.rows, len(prompt_ids) - 1)
            positions = _positions(prompt, 0, count, self.prompt_top, prompt_ids[1:1 + count])
            self.prompt = PromptLogprobs(self.prompt_top, list(prompt_ids[:count + 1]), positions)

    # -- to the client ---------------------------------------------------------------

    def take_chunk(self) -> tuple[list[Position], PromptLogprobs | None]:
        """A streaming chunk's logprobs: everything pending, and the prompt's on the first."""
        positions = self.pending
        self.pending = []
        self.last_delta = positions
        return positions, self._prompt_once()

    def take_complete(self, stream: bool) -> tuple[list[Position], PromptLogprobs | None]:
        if stream:
            return self.last_delta, self._prompt_once()
        self.pending = []
        return self.all or [], self.prompt

    def _prompt_once(self) -> PromptLogprobs | None:
        if self.prompt is not None and not self.prompt_sent:
            self.prompt_sent = True
            return self.prompt
        return None
