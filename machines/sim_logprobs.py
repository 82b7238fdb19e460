"""The sim engine's logprobs: deterministic, plausible, on vLLM's wire encoding.

Each position gets a distribution over the whole vocabulary: rank j has
probability (1 - q) q^(j-1) / (1 - q^V), a geometric law whose ratio q (0.3 to
0.9) comes from a hash of the request and the position, so the logprobs of
every rank are exact and the whole vocabulary sums to 1. The tokens by rank
are an affine permutation of the vocabulary, chosen so that the position's own
token sits at its rank: rank 1 under greedy sampling (the greedy token is the
top-1), rank 1 to 4 otherwise. So a row holds what vLLM's sampler gives:
column 0 the token itself, columns 1..k the top-k descending, and the rank.

The arrays are written as vLLM writes them (``wire/vllm_arrays.py``):
``LogprobsLists`` (numpy dtypes) for output tokens, ``LogprobsTensors``
(torch dtype names) for the prompt, inline under 256 bytes and as extra
frames of the message above, so the servicer's decoding of both is exercised
without a real engine. Pure: no clock, no randomness, no I/O.
"""

from __future__ import annotations

import hashlib
import math
from typing import Sequence

from enginelink.wire import vllm_arrays


def _hash(digest: bytes, tag: bytes, position: int) -> int:
    return int.from_bytes(hashlib.blake2b(digest + tag + position.to_bytes(4, "little"), digest_size=8).digest(),
                          "little")


def _row(token: int, vocab: int, k: int, h: int, greedy: bool) -> tuple[list[int], list[float], int]:
    """(ids, logprobs, rank) of one position: [token, top1..topk]."""
    k = vocab if k == -1 else min(k, vocab)
    q = 0.3 + 0.6 * (h % 1000) / 1000
    rank = 1 if greedy else 1 + (h >> 10) % min(4, vocab)
    log_norm = math.log1p(-q) - math.log1p(-(q ** vocab))
    log_q = math.log(q)
    step = ((h >> 20) % vocab) | 1
    while math.gcd(step, vocab) != 1:
        step += 2
    offset = (token - step * (rank - 1)) % vocab
    ids = [token] + [(step * j + offset) % vocab for j in range(k)]
    values = [log_norm + (rank - 1) * log_q] + [log_norm + j * log_q for j in range(k)]
    return ids, values, rank


def sample_logprobs(writer: vllm_arrays.ArrayWriter, digest: bytes, position: int, token: int, vocab: int, k: int,
                    greedy: bool) -> list:
    """``EngineCoreOutput.new_logprobs`` for one new token at output ``position``."""
    ids, values, rank = _row(token, vocab, k, _hash(digest, b"out", position), greedy)
    return vllm_arrays.logprobs_lists(writer, ids, values, [rank], len(ids))


def prompt_logprobs(writer: vllm_arrays.ArrayWriter, digest: bytes, prompt: Sequence[int], vocab: int,
                    k: int) -> list:
    """``EngineCoreOutput.new_prompt_logprobs_tensors``: rows for prompt positions 1.. (0 has none)."""
    all_ids: list[int] = []
    all_values: list[float] = []
    ranks = []
    cols = (vocab if k == -1 else min(k, vocab)) + 1
    for position in range(1, len(prompt)):
        ids, values, rank = _row(prompt[position], vocab, k, _hash(digest, b"prompt", position), greedy=False)
        all_ids += ids
        all_values += values
        ranks.append(rank)
    return vllm_arrays.logprobs_tensors(writer, all_ids, all_values, ranks, cols)
