"""One choice's logprobs: the engine's rows in, the contract's messages out.

The engine (``wire/engine.py`` ``LogprobRows``) gives, per position, its own
token in column 0 and the top-k in columns 1..k, descending. The contract
(``vllm_engine.proto``) wants ``OutputLogProbs`` / ``InputLogProbs``: the
token's logprob and id per position, and, when k > 0, a ``TopLogProbs`` per
position.

**The top-k decision.** The reference servicer's first releases listed "the
first k entries" of vLLM's per-position dict, which vLLM builds as
``{sampled, top1, top2, …}``: when the sampled token is outside the top-k
that list is the sampled token plus the top k-1, and the true k-th token is
missing. Later releases sort the dict and take k, which is the true top-k.
enginelink sends the **true top-k, descending: columns 1..k** (for -1, every
column: the whole vocabulary). The sampled token's own logprob is always in
``token_logprobs``, so nothing is lost, and what a client gets as
``top_logprobs`` is what OpenAI's API promises (the k most likely tokens).
``docs/architecture.md`` ("Logprobs") records it.

Shape of what goes out (as the reference servicer does):
- streaming: each chunk carries the logprobs of its own tokens (deltas);
  the prompt's logprobs go with the choice's first chunk only; the stream's
  ``complete`` repeats the last chunk's logprobs, as it repeats its tokens;
- non-streaming: the ``complete`` carries all of them and the prompt's;
- prompt position 0 has no logprob: an unset ``InputTokenLogProb`` and,
  when k > 0, an empty ``TopLogProbs``;
- ``logprobs = 0``: the token's logprob, no ``top_logprobs``.

Memory: a streaming choice holds only what its writer has not sent yet; a
non-streaming one holds every position until its complete, compactly
(``array`` of the wire's own 4-byte values, not Python floats): tokens x
(k + 1) x 8 bytes, bounded by the context and the engine's ``--max-logprobs``
(docs/limits.md, "Logprobs").
"""

from __future__ import annotations

import array
from typing import Sequence

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.wire.engine import LogprobRows, WireError

# One position: (its token's logprob, its token id, top values, top ids); the tops are None when k = 0.
Position = tuple[float, int, "array.array | None", "array.array | None"]


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


def _fill(message, positions: list[Position], top: int) -> None:
    """``OutputLogProbs`` (in place) from positions."""
    message.token_logprobs.extend([p[0] for p in positions])
    message.token_ids.extend([p[1] for p in positions])
    if top:
        add = message.top_logprobs.add
        for _, _, values, ids in positions:
            entry = add()
            entry.values.extend(values)
            entry.token_ids.extend(ids)


class ChoiceLogprobs:
    """The logprobs of one choice, between the engine's outputs and the client's messages."""

    __slots__ = ("top", "prompt_top", "pending", "last_delta", "all", "prompt", "prompt_sent")

    def __init__(self, top: int | None, prompt_top: int | None, keep_all: bool) -> None:
        self.top = top  # output logprobs: k (-1: all); None: not asked
        self.prompt_top = prompt_top  # prompt logprobs likewise
        self.pending: list[Position] = []
        self.last_delta: list[Position] = []
        self.all: list[Position] | None = [] if keep_all else None
        self.prompt: pb.InputLogProbs | None = None
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
            self.prompt = self._prompt(prompt, prompt_ids)

    def _prompt(self, rows: LogprobRows, prompt_ids: Sequence[int]) -> pb.InputLogProbs:
        # Row r is the logprob of prompt token r + 1; position 0 has none.
        count = min(rows.rows, len(prompt_ids) - 1)
        positions = _positions(rows, 0, count, self.prompt_top, prompt_ids[1:1 + count])
        message = pb.InputLogProbs()
        message.token_logprobs.add()
        message.token_logprobs.extend([pb.InputTokenLogProb(value=p[0]) for p in positions])
        message.token_ids.extend(prompt_ids[:count + 1])
        if self.prompt_top:
            message.top_logprobs.add()
            for _, _, values, ids in positions:
                entry = message.top_logprobs.add()
                entry.values.extend(values)
                entry.token_ids.extend(ids)
        return message

    # -- to the client ---------------------------------------------------------------

    def fill_chunk(self, chunk: pb.GenerateStreamChunk) -> None:
        """A streaming chunk's logprobs: everything pending, and the prompt's on the first."""
        positions = self.pending
        self.pending = []
        self.last_delta = positions
        if positions:
            _fill(chunk.output_logprobs, positions, self.top)
        self._prompt_once(chunk)

    def fill_complete(self, complete: pb.GenerateComplete, stream: bool) -> None:
        if stream:
            positions = self.last_delta
            self._prompt_once(complete)
        else:
            positions = self.all or []
            self.pending = []
            if self.prompt is not None:
                complete.input_logprobs.CopyFrom(self.prompt)
        if positions:
            _fill(complete.output_logprobs, positions, self.top)

    def _prompt_once(self, message) -> None:
        if self.prompt is not None and not self.prompt_sent:
            message.input_logprobs.CopyFrom(self.prompt)
            self.prompt_sent = True
