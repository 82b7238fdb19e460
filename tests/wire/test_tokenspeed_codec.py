"""The TokenSpeed codec against the real tokenspeed 0.1.1 package, and on its own.

Real-package half (needs ``tools/setup-tokenspeed``; required under
``ENGINELINK_REQUIRE_TOKENSPEED=1``): our ADD, ABORT and INIT frames decode
with TokenSpeed's own decoders (``zmq_wire``; the whole receive path too, which
normalises and would mark an invalid request) into structs equal to the real
ones, and the real engine's outputs, HELLO/READY and ready response (its own
``MsgpackEncoder`` / ``zmq_wire.encode``) decode with ours into equal values;
the venv's layouts equal the committed file. Pure half: the vLLM-shared
parts, pre-abort refusals, the release check, property round trips.
"""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from enginelink.runtime.contracts.shared import engine_compat
from enginelink.runtime.contracts.vllm.compat import Incompatible
from enginelink.wire import struct_layout, vllm
from enginelink.wire import tokenspeed as t
from enginelink.wire.engine import EngineDead, FinishReason, GenerateSpec, SamplingSpec, WireError
from tests.wire.engine_venvs import LAYOUTS, canon, fields_of, installed_layout, run_peer, side_python_or_skip

LAYOUT_FILE = LAYOUTS / "tokenspeed-0.1.1.json"


def spec(rid: str = "r1", ids=(1, 2, 3), **sampling) -> GenerateSpec:
    dp = sampling.pop("data_parallel_rank", None)
    sampling.setdefault("max_tokens", 8)
    return GenerateSpec(request_id=rid, prompt_token_ids=list(ids), sampling=SamplingSpec(**sampling),
                        data_parallel_rank=dp, arrival_time=1795942765.5)


SPECS = {
    "greedy": spec(temperature=0.0, stop_token_ids=(2, 9)),
    "sampled": spec(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=7, repetition_penalty=1.1,
                    frequency_penalty=0.5, presence_penalty=-0.5, min_tokens=2),
    "bias": spec(logit_bias={5: -2.0}, ignore_eos=True, no_stop_trim=True, skip_special_tokens=False),
    "json_schema": spec(structured_outputs={"json": {"type": "object"}}),
    "regex": spec(structured_outputs={"regex": "[ab]+"}),
    "ebnf": spec(structured_outputs={"grammar": 'root ::= "yes"'}),
    "logprobs": spec(logprobs=0),
    "dp": spec(data_parallel_rank=1, top_k=0),
}

SLIM = t.BatchTokenIDOutSlim(
    rids=["a", "b", "c", "d"], output_ids=[[5, 6], [7], [], [8]], finished_reasons=["", "stop", "length", "abort"],
    prompt_tokens=[3, 4, 5, 6], completion_tokens=[2, 1, 8, 1], cached_tokens=[0, 2, 0, 0],
    output_token_logprobs_val=[[-0.5, -1.0], [], [], []], output_token_logprobs_idx=[[5, 6], [], [], []],
    engine_index=1, num_running=3, num_waiting=2, kv_active_pages=10, kv_total_pages=40,
)
READY = t.WireEngineCoreReadyResponse(max_model_len=4096, num_gpu_blocks=100, prefix_granularity=16,
                                      vllm_version="tokenspeed-0.1.1", data_parallel_size=2, max_num_seqs=64,
                                      instance_id="m", kv_cache_size_tokens=1600)


def _to_engine() -> dict[str, tuple[str, msgspec.Struct, list[bytes]]]:
    """(real struct name, our struct, our frames) of everything enginelink sends."""
    out = {f"add/{k}": ("TokenizedGenerateReqInput", t.request_for(v), t.TokenSpeedCodec().encode_add(v))
           for k, v in SPECS.items()}
    init = t.HandshakeInit(addresses=t.HandshakeAddresses(inputs=["ipc:///tmp/in"], outputs=["ipc:///tmp/out"]))
    out["init"] = ("WireHandshakeInitMessage", init, [t.encode_handshake_init(init)])
    return out


def _from_engine() -> dict[str, tuple[str, msgspec.Struct]]:
    return {
        "outputs": ("BatchTokenIDOutSlim", SLIM),
        "hello": ("WireReadyMessage", t.WireReadyMessage(status="HELLO", local=True, headless=True)),
        "ready": ("WireReadyMessage", t.WireReadyMessage(status="READY", local=True, headless=True)),
        "ready_response": ("WireEngineCoreReadyResponse", READY),
    }


@pytest.fixture(scope="module")
def peer_results(tmp_path_factory):
    python = side_python_or_skip("tokenspeed")
    cases = [{"id": f"decode:{k}", "op": "decode", "name": name, "fields": fields_of(ours), "frames": frames}
             for k, (name, ours, frames) in _to_engine().items()]
    cases.append({"id": "decode:abort", "op": "decode", "name": "AbortList", "fields": {"rids": ["a", "b"]},
                  "frames": t.TokenSpeedCodec().encode_abort(["a", "b"])})
    cases += [{"id": f"encode:{k}", "op": "encode", "name": name, "fields": fields_of(ours)}
              for k, (name, ours) in _from_engine().items()]
    return run_peer("tokenspeed", python, cases, tmp_path_factory.mktemp("tokenspeed-peer"))


@pytest.mark.process
@pytest.mark.parametrize("key", [*_to_engine(), "abort"])
def test_tokenspeed_decodes_our_frames_into_equal_structs(peer_results, key):
    result = peer_results[f"decode:{key}"]
    assert "error" not in result, result
    assert result["equal"], result["diff"]


@pytest.mark.process
@pytest.mark.parametrize("key", list(_from_engine()))
def test_we_decode_tokenspeeds_frames_into_equal_values(peer_results, key):
    result = peer_results[f"encode:{key}"]
    assert "error" not in result, result
    name, ours = _from_engine()[key]
    frames = result["frames"]
    decoded = {"BatchTokenIDOutSlim": lambda: t.decode_batch(frames),
               "WireReadyMessage": lambda: t.decode_handshake_status(frames[0]),
               "WireEngineCoreReadyResponse": lambda: t.decode_ready_response(frames[0])}[name]()
    assert canon(decoded) == canon(ours)
    assert frames[0] == msgspec.msgpack.encode(ours)  # byte for byte


@pytest.mark.process
def test_the_installed_layout_is_the_committed_one_and_matches_the_codec():
    python = side_python_or_skip("tokenspeed")
    theirs = installed_layout("tokenspeed", python)
    assert theirs == json.loads(LAYOUT_FILE.read_text())
    assert engine_compat.check("tokenspeed", theirs, python) is None


# --------------------------------------------------------------------------
# Pure: no TokenSpeed needed
# --------------------------------------------------------------------------


def test_the_codec_matches_the_committed_release_layout():
    assert struct_layout.compare(t.LAYOUT, json.loads(LAYOUT_FILE.read_text()), "TokenSpeed") == []


def test_a_doctored_layout_is_refused_naming_the_release_and_the_field(tmp_path, monkeypatch):
    doctored = json.loads(LAYOUT_FILE.read_text())
    doctored["version"] = "0.1.2"
    slim = doctored["structs"]["BatchTokenIDOutSlim"]
    slim["fields"][9]["name"] = "num_waiting"
    slim["fields"][10]["name"] = "num_running"
    slim["tag_field"] = "type"
    doctored["structs"]["WireEngineCoreReadyResponse"]["fields"].append({"name": "block_size", "required": False,
                                                                         "default": 16})
    path = tmp_path / "tokenspeed-0.1.2.json"
    path.write_text(json.dumps(doctored))
    monkeypatch.setenv("ENGINELINK_TOKENSPEED_LAYOUT_FILE", str(path))
    with pytest.raises(Incompatible) as refused:
        engine_compat.check_installed("tokenspeed", "/opt/ts/bin/python")
    message = str(refused.value)
    assert "the TokenSpeed at /opt/ts/bin/python is TokenSpeed 0.1.2" in message
    assert "BatchTokenIDOutSlim has tag_field 'type' in TokenSpeed 0.1.2, '_tag' in enginelink's codec" in message
    assert ("BatchTokenIDOutSlim field 9 is 'num_waiting' in TokenSpeed 0.1.2, 'num_running' in enginelink's codec"
            in message)
    assert ("WireEngineCoreReadyResponse has key 'block_size' in TokenSpeed 0.1.2; enginelink's codec does not "
            "know it") in message
    assert "Supported TokenSpeed releases: 0.1.1." in message


def test_the_registry_knows_the_tokenspeed_codec():
    from enginelink.wire import codecs

    assert isinstance(codecs.get("tokenspeed"), t.TokenSpeedCodec)


def test_shared_with_vllm_byte_for_byte():
    codec = t.TokenSpeedCodec()
    assert codec.encode_abort(["a", "b"]) == vllm.VllmCodec().encode_abort(["a", "b"])
    assert t.encode_dead() == vllm.encode_dead()
    assert codec.decode_output(t.encode_dead()) == EngineDead()
    frames = codec.encode_add(SPECS["greedy"])
    assert frames[0] == vllm.REQ_ADD
    body = msgspec.msgpack.decode(frames[1])
    assert body[0] == "TokenizedGenerateReqInput" and body[1:5] == ["r1", None, None, [1, 2, 3]]


def test_tokenspeed_hello_is_not_vllms():
    # TokenSpeed sends every key, None included: vLLM's decoder refuses that; ours takes it.
    hello = msgspec.msgpack.encode(t.WireReadyMessage(status="HELLO", local=True, headless=True))
    with pytest.raises(WireError):
        vllm.decode_handshake_status(hello)
    assert t.decode_handshake_status(hello).status == "HELLO"
    with pytest.raises(WireError, match="neither HELLO nor READY"):
        t.decode_handshake_status(msgspec.msgpack.encode({"status": "HI"}))


def test_outputs_decode_with_load_tail_and_logprobs():
    batch = t.TokenSpeedCodec().decode_output(t.encode_outputs(SLIM))
    assert batch.engine_index == 1
    assert (batch.stats.num_running_reqs, batch.stats.num_waiting_reqs, batch.stats.kv_cache_usage) == (3, 2, 0.25)
    assert [o.finish_reason for o in batch.outputs] == [None, FinishReason.STOP, FinishReason.LENGTH,
                                                        FinishReason.ABORT]
    # "b" stopped: its last token (7) is the matched stop, named and trimmed (no_stop_trim unset).
    assert [o.new_token_ids for o in batch.outputs] == [[5, 6], [], [], [8]]
    assert [o.stop_reason for o in batch.outputs] == [None, 7, None, None]
    sample, prompt = t.TokenSpeedCodec.logprobs(batch.outputs[0], ())
    assert (sample.rows, sample.cols, list(sample.token_ids), list(sample.logprobs), prompt) == \
        (2, 1, [5, 6], [-0.5, -1.0], None)
    # An older 9-element prefix (before the load tail) still decodes, load zero.
    short = msgspec.msgpack.encode(["BatchTokenIDOutSlim", ["a"], [[1]], ["stop"], [1], [1], [0], [[]], [[]]])
    assert t.TokenSpeedCodec().decode_output([short]).stats.kv_cache_usage == 0.0


def test_the_matched_stop_token_and_its_logprob_are_trimmed_unless_the_add_kept_it():
    def stopped(rid: str) -> t.BatchTokenIDOutSlim:
        return t.BatchTokenIDOutSlim(
            rids=[rid], output_ids=[[4, 9]], finished_reasons=["stop"], prompt_tokens=[3], completion_tokens=[5],
            cached_tokens=[0], output_token_logprobs_val=[[-0.1, -0.2]], output_token_logprobs_idx=[[4, 9]])

    codec = t.TokenSpeedCodec()
    codec.encode_add(msgspec.structs.replace(SPECS["bias"], request_id="keep"))  # no_stop_trim=True
    codec.encode_add(msgspec.structs.replace(SPECS["greedy"], request_id="trim"))
    (kept,) = codec.decode_output(t.encode_outputs(stopped("keep"))).outputs
    (trimmed,) = codec.decode_output(t.encode_outputs(stopped("trim"))).outputs
    assert (kept.new_token_ids, kept.stop_reason) == ([4, 9], 9)
    assert (trimmed.new_token_ids, trimmed.stop_reason) == ([4], 9)
    assert list(codec.logprobs(kept, ())[0].logprobs) == [-0.1, -0.2]
    assert list(codec.logprobs(trimmed, ())[0].token_ids) == [4]
    # Remembered only until the finish (or an ABORT): a later "keep" is trimmed; the set stays bounded.
    (again,) = codec.decode_output(t.encode_outputs(stopped("keep"))).outputs
    assert again.new_token_ids == [4]
    codec.encode_add(msgspec.structs.replace(SPECS["bias"], request_id="gone"))
    codec.encode_abort(["gone"])
    assert codec._keep_stop == set()
    # A length or abort finish keeps its tokens: nothing matched.
    length = t.BatchTokenIDOutSlim(rids=["x"], output_ids=[[4, 9]], finished_reasons=["length"], prompt_tokens=[3],
                                   completion_tokens=[2], cached_tokens=[0], output_token_logprobs_val=[[]],
                                   output_token_logprobs_idx=[[]])
    (out,) = codec.decode_output(t.encode_outputs(length)).outputs
    assert (out.new_token_ids, out.stop_reason) == ([4, 9], None)


@pytest.mark.parametrize("frame", [b"\x93", msgspec.msgpack.encode(["BatchTokenIDOutSlim", ["a", "b"], [[1]], ["stop"],
                                                                    [1], [1], [0], [[]], [[]]]),
                                   msgspec.msgpack.encode(["BatchTokenIDOutSlim", ["a"], [[1]], ["done"], [1], [1],
                                                           [0], [[]], [[]]])])
def test_garbage_from_the_engine_is_a_wire_error(frame):
    with pytest.raises(WireError):
        t.TokenSpeedCodec().decode_output([frame])


@pytest.mark.parametrize(("kwargs", "n", "field", "words"), [
    ({}, 2, "sampling_params.n", "n=2 is not supported on the msgpack wire"),
    ({"logprobs": 2}, 1, "top_logprobs_num", "top_logprobs_num > 0 (output top-k logprobs) is not supported yet"),
    ({"prompt_logprobs": 0}, 1, "logprob_start_len", "prompt logprobs"),
    ({"top_k": 128}, 1, "sampling_params.top_k", "top_k must be < 128 (fused kernel limit)"),
    ({"repetition_penalty": 2.5}, 1, "sampling_params.repetition_penalty", "repetition_penalty must be in (0, 2]"),
    ({"frequency_penalty": -3.0}, 1, "sampling_params.frequency_penalty", "frequency_penalty must be in [-2, 2]"),
    ({"min_tokens": 9}, 1, "sampling_params.min_new_tokens", "min_new_tokens must be in (0, max_new_tokens(8)]"),
])
def test_what_tokenspeed_would_preabort_is_named(kwargs, n, field, words):
    got = t.preabort_reason(spec(**kwargs), n=n)
    assert got is not None and got[0] == field and words in got[1]


def test_valid_requests_are_not_preaborted():
    for s in SPECS.values():
        assert t.preabort_reason(s) is None
    assert t.preabort_reason(SPECS["logprobs"], output_logprobs_enabled=False)[0] == "return_logprob"


def test_no_control_calls_on_this_wire():
    with pytest.raises(ValueError, match="no control calls"):
        t.TokenSpeedCodec().encode_utility(1, "flush_cache", [])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rid=st.text(min_size=1, max_size=40), ids=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=64),
       temperature=st.floats(0, 2), top_k=st.integers(-1, 127), seed=st.none() | st.integers(0, 2**32),
       stops=st.lists(st.integers(0, 1000), max_size=4), dp=st.none() | st.integers(0, 7))
def test_property_requests_round_trip(rid, ids, temperature, top_k, seed, stops, dp):
    sent = GenerateSpec(request_id=rid, prompt_token_ids=ids, data_parallel_rank=dp,
                        sampling=SamplingSpec(max_tokens=16, temperature=temperature, top_k=top_k, seed=seed,
                                              stop_token_ids=tuple(stops)))
    got = t.decode_input(t.TokenSpeedCodec().encode_add(sent))
    assert isinstance(got, t.AddRequest) and got.aux == ()
    req = got.request
    assert (req.rid, req.input_ids, req.data_parallel_rank) == (rid, ids, dp)
    sp = req.sampling_params
    assert (sp.temperature, sp.seed, sp.n) == (temperature, seed, 1)
    assert sp.top_k == (-1 if top_k in (0, -1) else top_k) and not sp.is_normalized
    assert sp.stop_token_ids == (sorted(set(stops)) or None)
    assert canon(req) == canon(t.request_for(sent))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.text(max_size=8), st.lists(st.integers(0, 2**31 - 1), max_size=6),
                          st.sampled_from(["", "stop", "length", "abort"])), max_size=6),
       st.integers(0, 50), st.integers(0, 50))
def test_property_outputs_round_trip(rows, active, total):
    batch = t.BatchTokenIDOutSlim(
        rids=[r[0] for r in rows], output_ids=[r[1] for r in rows], finished_reasons=[r[2] for r in rows],
        prompt_tokens=[1] * len(rows), completion_tokens=[len(r[1]) for r in rows], cached_tokens=[0] * len(rows),
        output_token_logprobs_val=[[]] * len(rows), output_token_logprobs_idx=[[]] * len(rows),
        kv_active_pages=active, kv_total_pages=total)
    out = t.TokenSpeedCodec().decode_output(t.encode_outputs(batch))
    # A stop finish's last token is the matched stop, trimmed (no request here kept it).
    assert [(o.request_id, o.new_token_ids) for o in out.outputs] == \
        [(r[0], r[1][:-1] if r[2] == "stop" else r[1]) for r in rows]
    assert [o.stop_reason for o in out.outputs] == [r[1][-1] if r[2] == "stop" and r[1] else None for r in rows]
    assert 0.0 <= out.stats.kv_cache_usage <= 1.0
    assert canon(t.decode_batch(t.encode_outputs(batch))) == canon(batch)
