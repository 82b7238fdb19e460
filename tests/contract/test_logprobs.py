"""Logprobs over the sim engine: what a client gets, streamed and whole, and what is refused.

The sim engine writes logprobs exactly as vLLM 0.32 does (inline arrays and
extra frames; ``machines/sim_logprobs.py``) from a deterministic distribution,
so the same greedy request gives the same numbers streamed and not, and a
row's own token sits at its rank in the top-k. The real engine's numbers
are compared with vLLM offline in ``tests/vllm/test_vllm_logprobs.py``.
"""

from __future__ import annotations

import math
import re

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from tokenizers import Tokenizer

from tests.contract.helpers import Outcome, generate, journal_rows, new_id, prompt, refusal, wait_journal
from tests.harness import Servicer, generate_request, shared

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

VOCAB = 4096
PROMPT = prompt(7, 10)


@pytest.fixture(scope="module")
def servicer(tmp_path_factory, test_model_dir):
    """A sim engine whose ``--max-logprobs`` is -1: the whole vocabulary may be asked for."""
    with shared(Servicer(tmp_path_factory.mktemp("logprobs"), model_dir=test_model_dir,
                         engine_args=["--max-logprobs", "-1"])) as running:
        yield running


def _positions(logprobs: pb.OutputLogProbs) -> list[tuple[int, float, list[int], list[float]]]:
    tops = list(logprobs.top_logprobs) or [None] * len(logprobs.token_ids)
    return [(t, v, list(top.token_ids) if top else [], list(top.values) if top else [])
            for t, v, top in zip(logprobs.token_ids, logprobs.token_logprobs, tops, strict=True)]


def _check_rows(positions, k: int) -> None:
    """Each position: its top-k is descending, and the token's value is its rank's (or below the top-k)."""
    for token, value, top_ids, top_values in positions:
        assert len(top_ids) == len(top_values) == k
        assert top_values == sorted(top_values, reverse=True)
        assert value <= 0
        if token in top_ids:
            assert value == top_values[top_ids.index(token)]
        elif k:
            assert value <= top_values[-1]


def _streamed(outcome: Outcome, index: int = 0) -> list:
    return [p for chunk in outcome.chunks.get(index, []) for p in _positions(chunk.output_logprobs)]


def test_streaming_chunks_carry_their_own_tokens_logprobs(servicer):
    outcome = generate(servicer.stub, new_id("lp-stream"), PROMPT, stream=True, temperature=0.0, max_tokens=12,
                       ignore_eos=True, logprobs=3, prompt_logprobs=2)
    chunks = outcome.chunks[0]
    for chunk in chunks:
        # A chunk's logprobs are its own tokens', position by position: deltas.
        assert list(chunk.output_logprobs.token_ids) == list(chunk.token_ids)
    positions = _streamed(outcome)
    assert len(positions) == 12
    _check_rows(positions, 3)
    # Greedy: every token is the top-1, with the top-1's value.
    assert all(top_ids[0] == token and top_values[0] == value for token, value, top_ids, top_values in positions)
    # The prompt's logprobs come once, on the first chunk.
    assert chunks[0].HasField("input_logprobs")
    assert not any(chunk.HasField("input_logprobs") for chunk in chunks[1:])
    prompt_lp = chunks[0].input_logprobs
    assert list(prompt_lp.token_ids) == PROMPT
    assert not prompt_lp.token_logprobs[0].HasField("value")  # position 0 has none
    assert all(entry.HasField("value") for entry in prompt_lp.token_logprobs[1:])
    assert len(prompt_lp.top_logprobs) == len(PROMPT) and not prompt_lp.top_logprobs[0].token_ids
    assert all(len(top.token_ids) == 2 for top in prompt_lp.top_logprobs[1:])
    # The complete repeats the last chunk, logprobs too (as the reference servicer does).
    complete = outcome.complete(0)
    assert list(complete.output_ids) == list(chunks[-1].token_ids)
    assert _positions(complete.output_logprobs) == _positions(chunks[-1].output_logprobs)
    assert not complete.HasField("input_logprobs")


def test_non_streaming_complete_carries_all_and_equals_the_stream(servicer):
    sampling = dict(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    whole = generate(servicer.stub, new_id("lp-whole"), PROMPT, **sampling)
    streamed = generate(servicer.stub, new_id("lp-again"), PROMPT, stream=True, **sampling)
    complete = whole.complete(0)
    assert list(complete.output_logprobs.token_ids) == list(complete.output_ids)
    assert _positions(complete.output_logprobs) == _streamed(streamed)
    assert complete.input_logprobs == streamed.chunks[0][0].input_logprobs


def test_logprobs_zero_gives_the_tokens_logprob_and_no_top_list(servicer):
    complete = generate(servicer.stub, new_id("lp-0"), PROMPT, temperature=0.0, max_tokens=5, ignore_eos=True,
                        logprobs=0, prompt_logprobs=0).complete(0)
    assert len(complete.output_logprobs.token_logprobs) == 5 and not complete.output_logprobs.top_logprobs
    assert len(complete.input_logprobs.token_logprobs) == len(PROMPT) and not complete.input_logprobs.top_logprobs


def test_unasked_logprobs_are_absent(servicer):
    for stream in (False, True):
        outcome = generate(servicer.stub, new_id("lp-none"), PROMPT, stream=stream, max_tokens=5)
        for message in outcome.messages:
            body = getattr(message, message.WhichOneof("response"))
            assert not body.HasField("output_logprobs") and not body.HasField("input_logprobs")


def test_n_2_each_choice_has_its_own_logprobs(servicer):
    for stream in (False, True):
        outcome = generate(servicer.stub, new_id("lp-n2"), PROMPT, stream=stream, n=2, temperature=1.0, seed=11,
                           max_tokens=10, ignore_eos=True, logprobs=2, prompt_logprobs=1)
        per_choice = []
        for index in (0, 1):
            if stream:
                positions = _streamed(outcome, index)
                tokens = outcome.streamed(index)
                first = outcome.chunks[index][0]
            else:
                first = outcome.complete(index)
                positions = _positions(first.output_logprobs)
                tokens = list(first.output_ids)
            assert [p[0] for p in positions] == tokens
            _check_rows(positions, 2)
            assert list(first.input_logprobs.token_ids) == PROMPT
            per_choice.append(positions)
        assert per_choice[0] != per_choice[1]
        # Sampled (not greedy): some tokens are not the top-1, and then the top-2 does not list them first.
        assert any(top_ids[0] != token for token, _, top_ids, _ in per_choice[0] + per_choice[1])


def test_the_whole_vocabulary_when_the_engine_allows_it(servicer):
    complete = generate(servicer.stub, new_id("lp-all"), PROMPT, temperature=0.0, max_tokens=3, ignore_eos=True,
                        logprobs=-1).complete(0)
    positions = _positions(complete.output_logprobs)
    assert len(positions) == 3
    for token, value, top_ids, top_values in positions:
        assert sorted(top_ids) == list(range(VOCAB))
        assert math.fsum(math.exp(v) for v in top_values) == pytest.approx(1.0, abs=1e-3)
    _check_rows(positions, VOCAB)


def test_a_stop_string_cuts_the_logprobs_with_the_tokens(servicer, test_model_dir):
    first = generate(servicer.stub, new_id("lp-free"), PROMPT, temperature=0.0, max_tokens=12, ignore_eos=True)
    tokenizer = Tokenizer.from_file(str(test_model_dir / "tokenizer.json"))
    ids = list(first.complete(0).output_ids)
    text = tokenizer.decode(ids[:5])
    stop = text[-2:] if text[-2:].strip() else text[-1:]
    complete = generate(servicer.stub, new_id("lp-stop"), PROMPT, temperature=0.0, max_tokens=12, ignore_eos=True,
                        stop=[stop], logprobs=1).complete(0)
    assert complete.matched_stop_str == stop and len(complete.output_ids) <= 5
    assert list(complete.output_logprobs.token_ids) == list(complete.output_ids)


def test_the_journal_keeps_frames_not_logprob_arrays(servicer):
    rid = new_id("lp-journal")
    generate(servicer.stub, rid, PROMPT, stream=True, temperature=0.0, max_tokens=8, ignore_eos=True,
             logprobs=-1, prompt_logprobs=-1)
    wait_journal(servicer.journal, lambda rows: any(r.stream == f"req/{rid}" and r.kind == "client.sent"
                                                    for r in rows), "the call's end in the journal")
    frames = [r for r in journal_rows(servicer.journal, ("engine.frame",)) if rid.encode() in r.payload]
    # Each token carried 2 x 4097 x 4 bytes of logprobs (the prompt 9 times that), as extra
    # frames the journal does not keep: the call's engine frames stay small.
    assert len(frames) == 8 and max(len(r.payload) for r in frames) < 1024


# -- refused, as vLLM's front end refuses them ---------------------------------------------


@pytest.mark.parametrize("sampling, problem", [
    ({"logprobs": -2}, r"sampling_params\.logprobs: must be non-negative or -1, got -2"),
    ({"prompt_logprobs": -7}, r"sampling_params\.prompt_logprobs: must be non-negative or -1, got -7"),
    ({"logprobs": 21}, r"Requested sample logprobs of 21, which is greater than max allowed: 20"),
    ({"logprobs": 2**31 - 1}, r"Requested sample logprobs of 2147483647, which is greater than max allowed: 20"),
    ({"prompt_logprobs": -1}, r"Requested prompt logprobs of 4096, which is greater than max allowed: 20"),
])
def test_counts_the_engine_does_not_allow_are_refused(slow_servicer, sampling, problem):
    """The default engine (``--max-logprobs 20``, vLLM's default)."""
    rid = new_id("lp-bad")
    error = refusal(slow_servicer.stub, generate_request(rid, [5, 6, 7], max_tokens=4, **sampling))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(problem, error.details()), error.details()


def test_more_than_the_vocabulary_is_refused_even_when_uncapped(servicer):
    error = refusal(servicer.stub, generate_request(new_id("lp-vocab"), [5, 6, 7], max_tokens=4, logprobs=VOCAB + 1))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Requested sample logprobs of 4097, which is greater than max allowed: 4096" in error.details()


def test_twenty_is_served_by_the_default_engine(slow_servicer):
    complete = generate(slow_servicer.stub, new_id("lp-20"), [5, 6, 7], max_tokens=2, ignore_eos=True,
                        logprobs=20, prompt_logprobs=20).complete(0)
    assert [len(top.token_ids) for top in complete.output_logprobs.top_logprobs] == [20, 20]
    assert [len(top.token_ids) for top in complete.input_logprobs.top_logprobs] == [0, 20, 20]
