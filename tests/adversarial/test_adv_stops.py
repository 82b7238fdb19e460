"""Stop strings cannot stall the servicer (issue 21, item 1).

Attacked three ways: the matcher's work per piece of text, counted in
automaton steps, does not grow with the stop set, however adversarial
(prefix-sharing, overlapping, the old worst case); stop sets beyond the
limits are refused with INVALID_ARGUMENT before anything is built (the
2 MB / 200,000-string set of the report among them); and through a real
servicer, a legal stop set of the maximum size on a long n = 4 generation
leaves a concurrent call and health answering while the servicer's own
counters show at most two steps per character matched. The matcher's
semantics are checked against the former window scan on random inputs.
"""

from __future__ import annotations

import random
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.runtime.errors import ClientError
from enginelink.machines.stops import StopAutomaton, StopMatcher
from enginelink.runtime.requests.inputs import InputLimits
from enginelink.runtime.contracts.vllm.edge import validate_generate
from enginelink.runtime.requests.validate import EngineLimits
from tests.harness import VLLM_SERVICE, Servicer, free_port, generate_request, scrape, wait_until

LIMITS = InputLimits()
ENGINE = EngineLimits(max_model_len=2048, vocab_size=4096, eos_token_ids=(2,))


def _max_stop_set(alphabet: str, seed: int) -> tuple[str, ...]:
    """The largest legal set: ``stop_strings`` strings filling ``stop_bytes_total`` (ASCII)."""
    each = LIMITS.stop_bytes_total // LIMITS.stop_strings
    rng = random.Random(seed)
    return tuple("".join(rng.choice(alphabet) for _ in range(each - 1)) + "!" for _ in range(LIMITS.stop_strings))


def _steps_for(stops: tuple[str, ...], pieces: list[str]) -> tuple[int, int, str | None]:
    matcher = StopMatcher(stops, tokenizer=None, skip_special_tokens=True)
    matched = None
    for piece in pieces:
        before = matcher.steps
        matched = matcher.feed_text(piece)
        # Per piece: a step per character, a failure link per character it went
        # deeper, and the depth it started at (bounded by the longest stop).
        assert matcher.steps - before <= 2 * len(piece) + max(map(len, stops))
        if matched:
            break
    return matcher.steps, matcher.chars, matched


@pytest.mark.parametrize("alphabet", ["a", "ab", "abcdefgh"])
def test_matching_work_per_character_does_not_grow_with_the_stop_set(alphabet):
    """The text that made the old matcher scan every stop string per token costs ≤ 2 steps per character."""
    rng = random.Random(7)
    pieces = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(5000)]
    one = _steps_for(("zz!",), pieces)
    full = _steps_for(_max_stop_set(alphabet, seed=3), pieces)
    assert one[2] is None and full[2] is None  # no "!" in the text: nothing matches, every piece is fed
    assert one[1] == full[1] == sum(map(len, pieces))
    assert full[0] <= 2 * full[1], f"{full[0]} steps for {full[1]} characters"
    assert one[0] <= 2 * one[1]


def test_a_stop_set_sharing_long_prefixes_is_still_linear():
    """Failure links cannot be chained into more than one step per character on average."""
    each = LIMITS.stop_bytes_total // LIMITS.stop_strings
    stops = tuple("a" * (each - 1 - i % 8) + "b" * (1 + i % 8) for i in range(LIMITS.stop_strings))
    text = ("a" * (each - 2) + "c") * 200  # deep into the trie, then all the way back, over and over
    steps, chars, matched = _steps_for(stops, [text[i:i + 3] for i in range(0, len(text), 3)])
    assert matched is None and chars == len(text)
    assert steps <= 2 * chars


def _old_scan(stops: tuple[str, ...], pieces: list[str]) -> tuple[int, str] | None:
    """The former matcher: after each piece, the first listed stop found in the window it could complete."""
    text, longest = "", max(map(len, stops))
    for position, piece in enumerate(pieces):
        start = max(0, len(text) - longest + 1)
        text += piece
        for stop in stops:
            if stop in text[start:]:
                return position, stop
    return None


def test_matches_are_those_of_the_former_window_scan():
    """Same piece, same stop string (first listed among those completing in it), over many random cases."""
    rng = random.Random(11)
    for _ in range(3000):
        stops = tuple("".join(rng.choice("abcé") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 6)))
        pieces = ["".join(rng.choice("abcé") for _ in range(rng.randint(1, 4))) for _ in range(10)]
        matcher = StopMatcher(StopAutomaton(stops), tokenizer=None, skip_special_tokens=True)
        got = None
        for position, piece in enumerate(pieces):
            matched = matcher.feed_text(piece)
            if matched is not None:
                got = (position, matched)
                break
        assert got == _old_scan(stops, pieces), (stops, pieces)


# -- the limits --------------------------------------------------------------------------


def _refused(**sampling) -> ClientError:
    with pytest.raises(ClientError) as error:
        validate_generate(generate_request("r", [5, 6, 7], max_tokens=4, **sampling), ENGINE, 0.0)
    return error.value


def test_the_reported_stop_set_is_refused_naming_the_field():
    """~200,000 stop strings, 2 MB: the report's request."""
    error = _refused(stop=[f"s{i:08d}" for i in range(200_000)])
    assert error.field == "sampling_params.stop"
    assert "at most 64" in str(error) and "ENGINELINK_MAX_STOP_STRINGS" in str(error)


@pytest.mark.parametrize(
    "stop, words",
    [
        (["x"] * (LIMITS.stop_strings + 1), "ENGINELINK_MAX_STOP_STRINGS"),
        (["y" * (LIMITS.stop_string_bytes + 1)], "ENGINELINK_MAX_STOP_STRING_BYTES"),
        # Bytes, not characters: 513 two-byte characters are 1026 bytes.
        (["é" * (LIMITS.stop_string_bytes // 2 + 1)], "ENGINELINK_MAX_STOP_STRING_BYTES"),
        (["z" * LIMITS.stop_string_bytes] * (LIMITS.stop_bytes_total // LIMITS.stop_string_bytes) + ["q"],
         "ENGINELINK_MAX_STOP_BYTES_TOTAL"),
        (["ok", ""], "must not be empty"),
    ],
)
def test_stop_sets_over_a_limit_are_refused(stop, words):
    error = _refused(stop=stop)
    assert error.field == "sampling_params.stop"
    assert words in str(error)


def test_the_largest_legal_stop_sets_are_taken():
    for stop in (list(_max_stop_set("ab", 1)),
                 ["é" * (LIMITS.stop_string_bytes // 2)] * (LIMITS.stop_bytes_total // LIMITS.stop_string_bytes)):
        call = validate_generate(generate_request("r", [5, 6, 7], max_tokens=4, stop=stop), ENGINE, 0.0)
        assert call.stop_strings == tuple(stop)


# -- through a servicer ------------------------------------------------------------------


@pytest.mark.process
@pytest.mark.slow
def test_a_maximal_stop_set_does_not_stall_other_calls_or_health(tmp_path, test_model_dir):
    """n = 4 × 600 tokens against 64 never-matching stop strings of 64 bytes, while
    another call streams and health is probed; then the servicer's own counters."""
    metrics_port = free_port()
    stops = list(_max_stop_set("0123456789", seed=5))  # ends in "!": never in this model's output
    with Servicer(tmp_path, model_dir=test_model_dir, extra=["--metrics-port", str(metrics_port)],
                  engine_args=["--step-us", "2000"]) as servicer:
        stub = servicer.stub
        health = health_pb2_grpc.HealthStub(servicer.channel)
        heavy = stub.Generate(generate_request("heavy", [5, 6, 7, 8], stream=True, n=4, temperature=1.0, seed=1,
                                               max_tokens=600, ignore_eos=True, stop=stops), timeout=60)
        first = next(heavy)
        assert first.WhichOneof("response") == "chunk"
        done = threading.Event()
        heavy_messages = [first]

        def drain() -> None:
            heavy_messages.extend(heavy)
            done.set()

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        # While the heavy call runs: health answers and another call completes.
        probes = 0
        while not done.is_set() and probes < 20:
            reply = health.Check(health_pb2.HealthCheckRequest(service=VLLM_SERVICE), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            light = list(stub.Generate(generate_request(f"light-{probes}", [9, 10, 11], max_tokens=8,
                                                        ignore_eos=True), timeout=10))
            assert light[-1].complete.finish_reason == "length"
            probes += 1
        assert probes > 0, "the heavy call ended before any probe: nothing was measured"
        reader.join(60)
        completes = [m.complete for m in heavy_messages if m.WhichOneof("response") == "complete"]
        assert sorted(c.index for c in completes) == [0, 1, 2, 3]
        assert all(c.finish_reason == "length" for c in completes)
        samples = wait_until(lambda: (s := scrape(metrics_port)) and s_value(s, "link_stop_chars") > 0 and s,
                             5, "stop counters")
        chars, steps = s_value(samples, "link_stop_chars"), s_value(samples, "link_stop_steps")
        assert chars > 4 * 600 * 0.5, f"only {chars} characters were matched"  # the model's tokens decode to text
        assert steps <= 2 * chars, f"{steps} automaton steps for {chars} characters"


def s_value(samples: dict[str, float], name: str) -> float:
    return next(value for key, value in samples.items() if key.startswith(f"smg_servicer_{name}{{"))


@pytest.mark.slow
def test_over_limit_stop_sets_are_refused_over_grpc(servicer):
    for rid, stop in [("count", ["a"] * 65), ("long", ["b" * 1025]), ("total", ["c" * 1000] * 5)]:
        with pytest.raises(grpc.RpcError) as error:
            list(servicer.stub.Generate(generate_request(rid, [5, 6], max_tokens=2, stop=stop), timeout=10))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling_params.stop" in error.value.details()
    # ... and the servicer serves on.
    out = list(servicer.stub.Generate(pb.GenerateRequest(
        request_id="after", tokenized=pb.TokenizedInput(input_ids=[5, 6]),
        sampling_params=pb.SamplingParams(max_tokens=2, ignore_eos=True)), timeout=10))
    assert out[-1].complete.finish_reason == "length"
