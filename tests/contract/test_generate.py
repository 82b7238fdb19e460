"""Generate semantics (smg-contract §2–§3) as a client sees them, on the deterministic sim engine."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc
from tokenizers import Tokenizer

from tests.contract.helpers import CALL_TIMEOUT_S, Outcome, generate, greedy, new_id, prompt
from tests.harness import engine_pid, frozen, generate_request

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

EOS = 2
CONTEXT = 2048


def test_greedy_is_deterministic_and_depends_on_the_prompt(servicer):
    a1 = greedy(servicer.stub, prompt(1), 16)
    a2 = greedy(servicer.stub, prompt(1), 16)
    b = greedy(servicer.stub, prompt(2), 16)
    assert len(a1) == 16
    assert a1 == a2
    assert a1 != b
    assert all(0 <= t < 4096 for t in a1 + b)


def test_streaming_sends_deltas_then_one_complete(servicer, slow_servicer):
    """On a 20 ms-a-step engine, so tokens arrive over several chunks."""
    ids = prompt(3, 11)
    expected = greedy(servicer.stub, ids, 16)
    out = generate(slow_servicer.stub, new_id("stream"), ids, stream=True, temperature=0.0, max_tokens=16,
                   ignore_eos=True)
    kinds = [m.WhichOneof("response") for m in out.messages]
    assert kinds.count("chunk") > 1
    assert kinds[-1] == "complete" and kinds.count("complete") == 1
    assert kinds[-2] == "chunk", "the complete comes right after the last chunk"
    chunks = out.chunks[0]
    assert set(out.chunks) == {0}
    for chunk in chunks:
        assert chunk.token_ids, "a chunk without tokens"
        assert chunk.completion_tokens == len(chunk.token_ids), "completion_tokens is the delta's length"
        assert chunk.prompt_tokens == len(ids)
    assert out.streamed(0) == expected, "the chunks concatenated are the greedy output"
    complete = out.complete(0)
    assert complete.finish_reason == "length"
    assert complete.prompt_tokens == len(ids)
    assert list(complete.output_ids) == list(chunks[-1].token_ids), "a streaming complete repeats the last delta"


def test_a_client_that_reads_late_gets_every_token_in_order(servicer, slow_servicer):
    """The servicer writes each step's chunk at once until the client's
    flow-control window is full; the rest must queue, in order, not vanish.

    A 1 KiB stream window and no BDP probing (grpc C-core would widen it), a
    100-token stream at 20 ms a step (~30 bytes a message), and a client that
    reads nothing for the first 2.5 s: the window fills after ~30 chunks.
    """
    ids = prompt(5)
    expected = greedy(servicer.stub, ids, 100)
    options = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    with grpc.insecure_channel(f"127.0.0.1:{slow_servicer.port}", options=options) as channel:
        stub = pb_grpc.VllmEngineStub(channel)
        responses = stub.Generate(
            generate_request(new_id("late-reader"), ids, stream=True, temperature=0.0, max_tokens=100,
                             ignore_eos=True),
            timeout=CALL_TIMEOUT_S,
        )
        time.sleep(2.5)
        out = Outcome(list(responses))
    assert out.streamed(0) == expected
    assert len(out.chunks[0]) > 1
    assert [m.WhichOneof("response") for m in out.messages][-1] == "complete"
    assert out.complete(0).finish_reason == "length"


def test_a_streaming_call_gets_its_headers_before_the_engine_answers(servicer, slow_servicer):
    """Response headers go out once the call is admitted, not with the first token.

    The engine is stopped (SIGSTOP) while the call starts: the client must
    still see the call accepted (initial metadata), and once the engine runs
    again the stream is the same as ever.
    """
    ids = prompt(7)
    expected = greedy(servicer.stub, ids, 6)
    with frozen(engine_pid(slow_servicer.journal)):
        call = slow_servicer.stub.Generate(
            generate_request(new_id("early-headers"), ids, stream=True, temperature=0.0, max_tokens=6,
                             ignore_eos=True),
            timeout=CALL_TIMEOUT_S,
        )
        headers = threading.Thread(target=call.initial_metadata, daemon=True)
        headers.start()
        headers.join(5)
        assert not headers.is_alive(), "no response headers while the engine had not answered"
    out = Outcome(list(call))
    assert out.streamed(0) == expected
    assert out.complete(0).finish_reason == "length"


def test_non_streaming_sends_one_full_complete(servicer):
    ids = prompt(4)
    out = generate(servicer.stub, new_id("full"), ids, temperature=0.0, max_tokens=20, ignore_eos=True)
    assert [m.WhichOneof("response") for m in out.messages] == ["complete"]
    complete = out.complete(0)
    assert len(complete.output_ids) == 20
    assert complete.completion_tokens == 20
    assert complete.prompt_tokens == len(ids)
    assert complete.finish_reason == "length"
    assert complete.index == 0


@pytest.mark.parametrize("stream", [False, True])
def test_n2_gives_two_choices_that_differ_when_sampled(servicer, slow_servicer, stream):
    # Streaming on the slow engine, so the two choices' chunks interleave.
    stub = slow_servicer.stub if stream else servicer.stub
    out = generate(stub, new_id("n2"), prompt(5), stream=stream, n=2, temperature=1.0,
                   max_tokens=12, ignore_eos=True)
    assert sorted(out.completes) == [0, 1]
    texts = []
    for index in (0, 1):
        complete = out.complete(index)
        assert complete.finish_reason == "length"
        tokens = out.streamed(index) if stream else list(complete.output_ids)
        assert len(tokens) == 12
        texts.append(tokens)
        if stream:
            # Each choice's complete follows right after that choice's last chunk.
            position = out.messages.index(next(m for m in out.messages if m.HasField("complete")
                                               and m.complete.index == index))
            previous = out.messages[position - 1]
            assert previous.HasField("chunk") and previous.chunk.index == index
            later = out.messages[position + 1:]
            assert not any(m.HasField("chunk") and m.chunk.index == index for m in later), \
                "nothing for an index after its complete"
    assert texts[0] != texts[1], "unseeded samples of one call must differ"


def test_n2_with_a_seed_is_reproducible(servicer):
    def pair():
        out = generate(servicer.stub, new_id("seeded"), prompt(6), n=2, temperature=1.0, seed=1234,
                       max_tokens=10, ignore_eos=True)
        return [list(out.complete(i).output_ids) for i in (0, 1)]

    first, second = pair(), pair()
    assert first == second
    assert first[0] != first[1]
    other = generate(servicer.stub, new_id("seeded"), prompt(6), n=1, temperature=1.0, seed=99,
                     max_tokens=10, ignore_eos=True)
    assert list(other.complete(0).output_ids) not in first, "the seed matters"


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_max_tokens_is_honoured(servicer, max_tokens):
    out = generate(servicer.stub, new_id("max"), prompt(7), temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    complete = out.complete(0)
    assert len(complete.output_ids) == max_tokens
    assert complete.finish_reason == "length"


def _eos_prompt(stub, horizon: int = 48) -> tuple[list[int], list[int], int]:
    """A prompt whose greedy output (EOS ignored) has EOS at some position < horizon - 1."""
    for seed in range(100, 200):
        ids = prompt(seed)
        out = greedy(stub, ids, horizon)
        if EOS in out[: horizon - 1]:
            return ids, out, out.index(EOS)
    raise AssertionError("no prompt found whose greedy output contains EOS")


@pytest.fixture(scope="module")
def eos_case(servicer):
    return _eos_prompt(servicer.stub)


def test_eos_stops_the_output(servicer, eos_case):
    ids, ignored, position = eos_case
    out = generate(servicer.stub, new_id("eos"), ids, temperature=0.0, max_tokens=len(ignored))
    complete = out.complete(0)
    assert list(complete.output_ids) == ignored[: position + 1]
    assert complete.finish_reason == "stop"
    assert complete.WhichOneof("matched_stop") is None, "EOS is no matched stop (vLLM: stop_reason None)"


def test_ignore_eos_runs_to_max_tokens(servicer, eos_case):
    ids, ignored, position = eos_case
    out = generate(servicer.stub, new_id("noeos"), ids, temperature=0.0, max_tokens=len(ignored), ignore_eos=True)
    complete = out.complete(0)
    assert list(complete.output_ids) == ignored
    assert complete.output_ids[position] == EOS
    assert complete.finish_reason == "length"


def test_min_tokens_holds_back_eos(servicer, eos_case):
    ids, ignored, position = eos_case
    min_tokens = position + 3
    out = generate(servicer.stub, new_id("min"), ids, temperature=0.0, max_tokens=len(ignored), min_tokens=min_tokens)
    output = list(out.complete(0).output_ids)
    assert len(output) >= min_tokens
    assert EOS not in output[:min_tokens]
    assert output[:position] == ignored[:position]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_ids_end_at_the_first_occurrence(servicer, stream):
    ids = prompt(8)
    reference = greedy(servicer.stub, ids, 32)
    token = reference[10]
    first = reference.index(token)
    out = generate(servicer.stub, new_id("stopid"), ids, stream=stream, temperature=0.0, max_tokens=32,
                   ignore_eos=True, stop_token_ids=[token])
    complete = out.complete(0)
    output = out.streamed(0) if stream else list(complete.output_ids)
    assert output == reference[: first + 1]
    assert complete.finish_reason == "stop"
    assert complete.WhichOneof("matched_stop") == "matched_token_id"
    assert complete.matched_token_id == token


def _stop_string_case(stub, tokenizer: Tokenizer) -> tuple[list[int], list[int], str, int]:
    """(prompt, greedy output, a stop string spanning two tokens, index of the token completing it)."""
    for seed in range(200, 260):
        ids = prompt(seed)
        reference = greedy(stub, ids, 24, ignore_eos=False)
        pieces = [tokenizer.decode([t]) for t in reference]
        for k in range(3, len(reference) - 2):
            left, right = pieces[k], pieces[k + 1]
            if not (left.isascii() and right.isascii() and len(left.strip()) >= 2 and len(right.strip()) >= 2):
                continue
            stop = left.strip()[-2:] + right[:2]
            prefixes = [tokenizer.decode(reference[: j + 1]) for j in range(len(reference))]
            completing = next(j for j, text in enumerate(prefixes) if stop in text)
            if completing >= 2 and completing < len(reference) - 1:
                return ids, reference, stop, completing
    raise AssertionError("no greedy output with two neighbouring ASCII tokens found")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_at_the_completing_token(servicer, test_model_dir, stream):
    tokenizer = Tokenizer.from_file(str(test_model_dir / "tokenizer.json"))
    ids, reference, stop, completing = _stop_string_case(servicer.stub, tokenizer)
    out = generate(servicer.stub, new_id("stopstr"), ids, stream=stream, temperature=0.0, max_tokens=24,
                   stop=[stop], skip_special_tokens=True)
    complete = out.complete(0)
    output = out.streamed(0) if stream else list(complete.output_ids)
    assert output == reference[: completing + 1], f"stop {stop!r} completes at token {completing}"
    assert stop in tokenizer.decode(output)
    assert complete.finish_reason == "stop"
    assert complete.WhichOneof("matched_stop") == "matched_stop_str"
    assert complete.matched_stop_str == stop


def test_unset_max_tokens_runs_to_the_end_of_the_context(servicer):
    ids = prompt(9, CONTEXT - 8)
    out = generate(servicer.stub, new_id("ctx"), ids, temperature=0.0, ignore_eos=True)
    complete = out.complete(0)
    assert len(complete.output_ids) == 8
    assert complete.finish_reason == "length"
    assert complete.prompt_tokens == CONTEXT - 8


def test_largest_prompt_and_max_tokens_that_fit_are_accepted(servicer):
    out = generate(servicer.stub, new_id("fit"), prompt(10, CONTEXT - 8), temperature=0.0, max_tokens=8,
                   ignore_eos=True)
    assert len(out.complete(0).output_ids) == 8
    out = generate(servicer.stub, new_id("fit"), prompt(11, CONTEXT - 1), temperature=0.0, ignore_eos=True)
    assert len(out.complete(0).output_ids) == 1
    assert out.complete(0).finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_shared_prefix_reports_cached_tokens(servicer, stream):
    shared = prompt(500 + (1 if stream else 0), 64)
    first = generate(servicer.stub, new_id("cache"), shared + [11, 12, 13, 14, 15, 16], stream=stream,
                     temperature=0.0, max_tokens=4, ignore_eos=True)
    assert first.complete(0).cached_tokens == 0, "a new prefix has no cache hits"
    second = generate(servicer.stub, new_id("cache"), shared + [21, 22, 23, 24, 25, 26], stream=stream,
                      temperature=0.0, max_tokens=4, ignore_eos=True, n=2)
    for index in (0, 1):
        assert second.complete(index).cached_tokens == 64, f"choice {index}: four full 16-token blocks are shared"
        if stream:
            assert {c.cached_tokens for c in second.chunks[index]} == {64}
