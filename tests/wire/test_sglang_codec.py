"""The SGLang codec against the real sglang 0.5.23 package, and on its own.

Real-package half (needs ``tools/setup-sglang``; required under
``ENGINELINK_REQUIRE_SGLANG=1``): for every message kind, our encoder's bytes
decode with SGLang's own ``io_struct.msgpack_decode`` into a struct equal to
the real one built from the same arguments, and the real struct's bytes
(SGLang's own ``msgpack_encode``) decode with ours into equal values; the
venv's layouts equal the committed layout file. One subprocess answers every
case. Pure half: mappings, aborts, the release check, property round trips.
"""

from __future__ import annotations

import copy
import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from enginelink.runtime.contracts.shared import engine_compat
from enginelink.runtime.contracts.vllm.compat import Incompatible
from enginelink.wire import sglang as g
from enginelink.wire import sglang_structs as s
from enginelink.wire import struct_layout
from enginelink.wire.engine import FinishReason, GenerateSpec, PoolingSpec, SamplingSpec, WireError
from tests.wire.engine_venvs import LAYOUTS, canon, fields_of, installed_layout, run_peer, side_python_or_skip

LAYOUT_FILE = LAYOUTS / "sglang-0.5.23.json"


def spec(rid: str = "r1", ids=(1, 2, 3), **sampling) -> GenerateSpec:
    extra = {k: sampling.pop(k) for k in ("data_parallel_rank", "cache_salt", "kv_transfer_params", "pooling",
                                          "lora_id", "custom_logit_processor", "require_reasoning")
             if k in sampling}
    sampling.setdefault("max_tokens", 8)
    return GenerateSpec(request_id=rid, prompt_token_ids=list(ids), sampling=SamplingSpec(**sampling), **extra)


SPECS = {
    "greedy": spec(temperature=0.0, stop_token_ids=(2,)),
    "sampled": spec(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=7, repetition_penalty=1.1,
                    frequency_penalty=0.5, presence_penalty=-0.5, min_tokens=2),
    "bias_ignore_eos": spec(logit_bias={5: -2.0, 9: 1.5}, ignore_eos=True, skip_special_tokens=False,
                            no_stop_trim=True, stream_interval=4),
    "json_schema": spec(structured_outputs={"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}),
    "regex": spec(structured_outputs={"regex": "[ab]+"}),
    "ebnf": spec(structured_outputs={"grammar": 'root ::= "yes" | "no"'}),
    "structural_tag": spec(structured_outputs={"structural_tag": '{"type":"structural_tag"}'}),
    "json_object": spec(structured_outputs={"json_object": True}),
    "logprobs": spec(logprobs=3, prompt_logprobs=3),
    # Issue 33 item 7: prompt logprobs from a later position (SGLang's logprob_start_len).
    "prompt_logprobs_from_2": spec(ids=(1, 2, 3, 4, 5), logprobs=1, prompt_logprobs=1, prompt_logprobs_start=2),
    "dp_salt_pd": spec(data_parallel_rank=1, cache_salt="salt",
                       kv_transfer_params={"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 5}),
    "long_prompt": spec(ids=range(3000), max_tokens=1),
    # The router's request features (issue 33 item 7), in the scheduler's own fields.
    "lora_processor_reasoning": spec(lora_id="adapter-a", require_reasoning=True,
                                     custom_logit_processor='{"callable": "gASV"}'),
    "embed": spec(pooling=PoolingSpec()),
}


def _batch() -> s.BatchTokenIDOutput:
    return g.token_batch(
        ["a", "b", "c", "d", "e"], [[5, 6], [7], [], [8], [9, 10, 11]],
        [None, g.finish_stop(2), g.finish_length(8), g.finish_abort("too long", 400, "BadRequestError"),
         g.finish_stop("\n\n")],
        prompt_tokens=[3, 4, 5, 6, 7], completion_tokens=[2, 1, 8, 1, 3], cached_tokens=[0, 2, 0, 0, 1],
        output_token_logprobs_val=[[-0.5, -1.0], [-0.25], [], [-2.0], [-0.1, -0.2, -0.3]],
        output_token_logprobs_idx=[[5, 6], [7], [], [8], [9, 10, 11]],
        output_top_logprobs_val=[[[-0.5, -0.9], [-1.0, -1.1]], [[-0.25, -0.3]], [], [[-2.0, -2.1]],
                                 [[-0.1, -0.5], [-0.2, -0.6], [-0.3, -0.7]]],
        output_top_logprobs_idx=[[[5, 1], [6, 1]], [[7, 1]], [], [[8, 1]], [[9, 1], [10, 1], [11, 1]]],
        input_token_logprobs_val=[[None, -3.0, -4.0], [], [], [], []],
        input_token_logprobs_idx=[[1, 2, 3], [], [], [], []],
        spec_verify_ct=[0, 0, 0, 0, 2], spec_num_correct_drafts=[0, 0, 0, 0, 1], dp_ranks=[0, 0, 0, 0, 0],
        reasoning_tokens=[0, 1, 5, 0, 2],
        retraction_counts=[0, 0, 0, 0, 0],
    )


def messages() -> dict[str, msgspec.Struct]:
    """One of every message kind, both directions."""
    out: dict[str, msgspec.Struct] = {f"request/{k}": g.request_for(v) for k, v in SPECS.items()}
    out.update({
        "abort/front": s.AbortReq(rid="r1"),
        "abort/scheduler": s.AbortReq(rid="r2", finished_reason=g.finish_abort("queue full", 503, "ServiceUnavailable"),
                                      abort_message="queue full"),
        "flush": g.control_request(4, "flush_cache", [2.5]),
        "profile/start": g.control_request(5, "start_profile", [{"output_dir": "/tmp/p", "num_steps": 3,
                                                                 "activities": ["CPU"]}]),
        "profile/stop": g.control_request(6, "stop_profile", []),
        "flush/reply": s.FlushCacheReqOutput(http_worker_ipc="enginelink-control-4", success=True),
        "profile/reply": s.ProfileReqOutput(http_worker_ipc="enginelink-control-5", success=False, message="busy"),
        "health": s.HealthCheckOutput(http_worker_ipc="x"),
        "tokens": _batch(),
        "embeddings": s.BatchEmbeddingOutput(rids=["e1", "e2"], finished_reasons=[g.finish_stop(None)] * 2,
                                             embeddings=[[0.25, -0.5, 1.0], [0.0, 0.125, -1.5]], prompt_tokens=[3, 4],
                                             cached_tokens=[0, 1], placeholder_tokens_idx=None,
                                             placeholder_tokens_val=None),
    })
    return out


@pytest.fixture(scope="module")
def peer_results(tmp_path_factory):
    python = side_python_or_skip("sglang")
    cases = []
    for key, message in messages().items():
        name = s.STRUCTS_BY_TYPE[type(message)]
        fields = fields_of(message)
        cases.append({"id": f"decode:{key}", "op": "decode", "name": name, "fields": fields,
                      "frames": [s.ENCODER.encode(message)]})
        cases.append({"id": f"encode:{key}", "op": "encode", "name": name, "fields": fields})
    return run_peer("sglang", python, cases, tmp_path_factory.mktemp("sglang-peer"))


@pytest.mark.process
@pytest.mark.parametrize("key", list(messages()))
def test_sglang_decodes_our_bytes_into_equal_structs(peer_results, key):
    result = peer_results[f"decode:{key}"]
    assert "error" not in result, result
    assert result["type"] == s.STRUCTS_BY_TYPE[type(messages()[key])]
    assert result["equal"], result["diff"]


@pytest.mark.process
@pytest.mark.parametrize("key", list(messages()))
def test_we_decode_sglangs_bytes_into_equal_values(peer_results, key):
    result = peer_results[f"encode:{key}"]
    assert "error" not in result, result
    ours = messages()[key]
    decoded = (g.decode_input if isinstance(ours, s.ToScheduler.__args__) else g.decode_message)(result["frames"])
    assert canon(decoded) == canon(ours)
    # And byte for byte: SGLang's encoder writes what ours writes.
    assert result["frames"] == [s.ENCODER.encode(ours)]


@pytest.mark.process
def test_the_installed_layout_is_the_committed_one_and_matches_the_codec():
    python = side_python_or_skip("sglang")
    theirs = installed_layout("sglang", python)
    assert theirs == json.loads(LAYOUT_FILE.read_text())
    assert engine_compat.check("sglang", theirs, python) is None


# --------------------------------------------------------------------------
# Pure: no SGLang needed
# --------------------------------------------------------------------------


def test_the_codec_matches_the_committed_release_layout():
    assert struct_layout.compare(g.LAYOUT, json.loads(LAYOUT_FILE.read_text()), "SGLang") == []


def test_a_doctored_layout_is_refused_naming_the_release_and_the_field(tmp_path, monkeypatch):
    doctored = json.loads(LAYOUT_FILE.read_text())
    doctored["version"] = "0.5.24"
    fields = doctored["structs"]["TokenizedGenerateReqInput"]["fields"]
    fields[11], fields[12] = fields[12], fields[11]  # token_ids_logprob <-> stream
    doctored["structs"]["SamplingParams"]["fields"][6]["default"] = -1
    doctored["structs"]["AbortReq"]["fields"].append({"name": "reason", "required": True})
    path = tmp_path / "sglang-0.5.24.json"
    path.write_text(json.dumps(doctored))
    monkeypatch.setenv("ENGINELINK_SGLANG_LAYOUT_FILE", str(path))
    with pytest.raises(Incompatible) as refused:
        engine_compat.check_installed("sglang", "/opt/sglang/bin/python")
    message = str(refused.value)
    assert "the SGLang at /opt/sglang/bin/python is SGLang 0.5.24" in message
    assert ("TokenizedGenerateReqInput field 11 is 'stream' in SGLang 0.5.24, 'token_ids_logprob' in "
            "enginelink's codec") in message
    assert "SamplingParams field 6 'top_k' is default -1 in SGLang 0.5.24, default 1073741824" in message
    assert "AbortReq field 6 'reason' is required in SGLang 0.5.24; enginelink's codec does not send it" in message
    assert "Supported SGLang releases: 0.5.23." in message


@pytest.mark.process
def test_the_cached_layout_is_read_again_when_a_struct_module_or_the_layout_script_changes(tmp_path, monkeypatch):
    """The installed release's layout is cached per installation; a cache written before the codec read
    ``schedule_batch``'s structs (or by an older layout script) lacked them, and every launch after was
    refused: "MultimodalDataItem does not exist in SGLang 0.5.23". The key covers every module the script
    reads a struct from, and the script itself."""
    site = tmp_path / "site"
    modules = {where.partition(":")[0] for where in struct_layout.ENGINES["sglang"]["structs"].values()}
    assert "sglang.srt.managers.schedule_batch" in modules
    for module in modules:
        path = site / (module.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("# v1\n")
    (site / "sglang" / "__init__.py").write_text("")
    calls = tmp_path / "calls"
    one_line = tmp_path / "layout.json"  # as the script prints it
    one_line.write_text(json.dumps(json.loads(LAYOUT_FILE.read_text())) + "\n")
    python = tmp_path / "python"  # a stand-in engine interpreter: where sglang is, and its layout (counted)
    python.write_text(f"""#!/bin/sh
if [ "$1" = -c ]; then echo {site}/sglang/__init__.py; exit 0; fi
echo x >> {calls}
cat {one_line}
""")
    python.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("ENGINELINK_SGLANG_LAYOUT_FILE", raising=False)

    def check() -> int:
        assert engine_compat.check_installed("sglang", str(python)) == ("0.5.23", None)
        return len(calls.read_text().splitlines())

    assert check() == 1 and check() == 1  # asked once, then cached
    (site / "sglang/srt/managers/schedule_batch.py").write_text("# v2\n")
    assert check() == 2
    script = tmp_path / "struct_layout.py"
    script.write_text(engine_compat.LAYOUT_SCRIPT.read_text() + "\n# a newer script\n")
    monkeypatch.setattr(engine_compat, "LAYOUT_SCRIPT", script)
    assert check() == 3 and check() == 3


def test_an_appended_defaulted_field_is_compatible_with_a_warning(tmp_path, monkeypatch):
    newer = copy.deepcopy(json.loads(LAYOUT_FILE.read_text()))
    newer["version"] = "0.5.24"
    newer["structs"]["BatchTokenIDOutput"]["fields"].append({"name": "later", "required": False, "default": None})
    path = tmp_path / "newer.json"
    path.write_text(json.dumps(newer))
    monkeypatch.setenv("ENGINELINK_SGLANG_LAYOUT_FILE", str(path))
    version, warning = engine_compat.check_installed("sglang", "/venv/bin/python")
    assert version == "0.5.24" and "not a release enginelink was tested with (0.5.23)" in warning


def test_the_registry_knows_the_sglang_codec():
    from enginelink.wire import codecs

    assert isinstance(codecs.get("sglang"), g.SglangCodec) and codecs.get("sglang").name == "sglang"


def test_greedy_is_sent_normalised_as_sglang_leaves_it():
    sp = g.request_for(SPECS["greedy"]).sampling_params
    assert (sp.temperature, sp.top_k, sp.is_normalized, sp.stop_strs, sp.stop_regex_strs) == (1.0, 1, True, [], [])
    assert sp.stop_token_ids == [2] and sp.stop is None
    assert g.request_for(spec(top_k=0)).sampling_params.top_k == s.TOP_K_ALL


def test_the_204_byte_request_of_the_reference():
    # reference/sglang-contract.md §5.3: a normalised greedy request, rid r1, ids [1,2,3], max 8, stop id 2.
    frame = g.SglangCodec().encode_add(SPECS["greedy"])[0]
    assert len(frame) == 204
    array = msgspec.msgpack.decode(frame)
    assert array[:4] == ["TokenizedGenerateReqInput", "r1", None, None] and array[4].code == 1
    assert array[8] == [8, None, [2], None, 1.0, 1.0, 1, 0.0, 0.0, 0.0, 1.0, 0, 1, None, None, None, None, None,
                        False, True, True, False, None, None, None, None, None, [], [], 0, 0, True, False]


def test_outputs_decode_to_engine_outputs_with_counts_and_aborts():
    batch = g.SglangCodec().decode_output(g.encode_outputs(_batch()))
    a, b, c, d, e = batch.outputs
    assert (a.new_token_ids, a.finish_reason, a.completion_tokens) == ([5, 6], None, 2)
    assert (b.finish_reason, b.stop_reason, b.cached_tokens) == (FinishReason.STOP, 2, 2)
    assert (c.finish_reason, c.new_token_ids) == (FinishReason.LENGTH, [])
    assert d.finish_reason == FinishReason.ABORT and d.abort == g.AbortInfo("too long", 400, "BadRequestError")
    assert e.stop_reason == "\n\n" and (e.spec_accepted_tokens, e.spec_draft_tokens) == (1, 2)
    sample, prompt = g.SglangCodec.logprobs(a, ())
    assert (sample.rows, sample.cols, list(sample.token_ids)) == (2, 3, [5, 5, 1, 6, 6, 1])  # own token, then top-2
    assert list(sample.logprobs) == [-0.5, -0.5, -0.9, -1.0, -1.0, -1.1]
    assert (prompt.rows, prompt.cols, list(prompt.token_ids)) == (2, 1, [2, 3])  # position 0 has no logprob
    assert g.SglangCodec.logprobs(c, ()) == (None, None)


def test_abort_table_grammar_status_and_plain():
    assert g.abort_outcome(g.AbortInfo("x", 400)).code == "INVALID_ARGUMENT"
    assert g.abort_outcome(g.AbortInfo("x", 429)).code == "RESOURCE_EXHAUSTED"
    assert g.abort_outcome(g.AbortInfo("x", 503)).code == "UNAVAILABLE"
    assert g.abort_outcome(g.AbortInfo("x", 504)).code == "DEADLINE_EXCEEDED"
    assert g.abort_outcome(g.AbortInfo("x", 500)).code == "INTERNAL"
    assert g.abort_outcome(g.AbortInfo("x", reported=True)).code == "INTERNAL"
    assert g.abort_outcome(g.AbortInfo(None, reported=True)).message == "Abort before prefill"
    assert g.abort_outcome(g.AbortInfo("cancelled")) == g.AbortOutcome(None, "cancelled")
    outcome = g.abort_outcome(g.AbortInfo("rejected", 500, g.GRAMMAR_ERR_TYPE))  # the ranks' own name
    assert outcome.code == "FAILED_PRECONDITION" and outcome.trailer == ("smg-constraint-failed", "engine")
    assert outcome.message.startswith("the engine could not continue the request under its constraint")
    # Stock 0.5.23's unnamed grammar aborts keep their status: never attributed by their wording.
    assert g.abort_outcome(g.AbortInfo("Grammar accept_token failed: token 5", 500, "InternalServerError")) \
        == g.AbortOutcome("INTERNAL", "Grammar accept_token failed: token 5")
    assert g.abort_outcome(g.AbortInfo("Failed to compile json_schema grammar: bad", 400, "BadRequestError")).code \
        == "INVALID_ARGUMENT"


def test_scheduler_abort_reports_and_control_replies_decode():
    codec = g.SglangCodec()
    report = codec.decode_output(g.encode_outputs(messages()["abort/scheduler"])).outputs[0]
    assert report.request_id == "r2" and report.abort == g.AbortInfo("queue full", 503, "ServiceUnavailable", True)
    reply = codec.decode_output(g.encode_outputs(messages()["profile/reply"])).utility
    assert (reply.call_id, reply.failure) == (5, "busy")
    with pytest.raises(WireError, match="answers no control call"):
        codec.decode_output(g.encode_outputs(s.FlushCacheReqOutput(success=True)))


@pytest.mark.parametrize("frames", [[b"\x93\x01\x02"], [b""], [b"a", b"b"], [msgspec.msgpack.encode(["Nope", 1])],
                                    [msgspec.msgpack.encode(["BatchTokenIDOutput", ["a"], None])]])
def test_garbage_from_the_scheduler_is_a_wire_error(frames):
    with pytest.raises(WireError):
        g.SglangCodec().decode_output(frames)


def test_more_than_one_abort_id_needs_encode_aborts():
    codec = g.SglangCodec()
    assert [g.decode_input(m).rid for m in codec.encode_aborts(["a", "b"])] == ["a", "b"]
    with pytest.raises(ValueError, match="encode_aborts"):
        codec.encode_abort(["a", "b"])


# --------------------------------------------------------------------------
# Properties: the pure codec round trip
# --------------------------------------------------------------------------

token_ids = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=64)
samplings = st.builds(
    SamplingSpec, max_tokens=st.integers(0, 4096), temperature=st.floats(0, 2), top_p=st.floats(0.01, 1),
    top_k=st.integers(-1, 200), min_p=st.floats(0, 1), seed=st.none() | st.integers(0, 2**63 - 1),
    stop_token_ids=st.lists(st.integers(0, 1000), max_size=4).map(tuple), ignore_eos=st.booleans(),
    logprobs=st.none() | st.integers(0, 5), prompt_logprobs=st.none() | st.integers(0, 5),
    logit_bias=st.none() | st.dictionaries(st.integers(0, 1000), st.floats(-100, 100), max_size=3),
    no_stop_trim=st.booleans(), stream_interval=st.none() | st.integers(1, 8),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rid=st.text(min_size=1, max_size=40), ids=token_ids, sampling=samplings, dp=st.none() | st.integers(0, 7))
def test_property_requests_round_trip(rid, ids, sampling, dp):
    sent = GenerateSpec(request_id=rid, prompt_token_ids=ids, sampling=sampling, data_parallel_rank=dp)
    got = g.decode_input(g.SglangCodec().encode_add(sent))
    assert got.rid == rid and got.input_ids.tolist() == ids and got.routed_dp_rank == dp
    sp = got.sampling_params
    assert sp.max_new_tokens == sampling.max_tokens and sp.is_normalized
    assert sp.sampling_seed == sampling.seed and sp.ignore_eos == sampling.ignore_eos
    assert sp.stop_token_ids == (sorted(set(sampling.stop_token_ids)) or None)
    greedy = sampling.temperature < 1e-6
    assert sp.top_k == (1 if greedy else s.TOP_K_ALL if sampling.top_k in (0, -1) else sampling.top_k)
    assert sp.temperature == (1.0 if greedy else sampling.temperature)
    assert got.return_logprob == (sampling.logprobs is not None or sampling.prompt_logprobs is not None)
    assert canon(got) == canon(g.request_for(sent))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.text(max_size=10), st.lists(st.integers(0, 2**31 - 1), max_size=8),
                          st.sampled_from([None, ("stop", 3), ("stop", "ab"), ("length", 5), ("abort", 429)]),
                          st.integers(0, 10**6)), max_size=6))
def test_property_outputs_round_trip(rows):
    def reason(r):
        if r is None:
            return None
        return {"stop": g.finish_stop, "length": g.finish_length}.get(r[0], lambda c: g.finish_abort("m", c))(r[1])

    batch = g.token_batch([r[0] for r in rows], [r[1] for r in rows], [reason(r[2]) for r in rows],
                          prompt_tokens=[r[3] for r in rows], completion_tokens=[len(r[1]) for r in rows])
    outputs = g.SglangCodec().decode_output(g.encode_outputs(batch)).outputs
    assert [(o.request_id, o.new_token_ids, o.prompt_tokens) for o in outputs] == [(r[0], r[1], r[3]) for r in rows]
    kinds = {None: None, "stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
    assert [o.finish_reason for o in outputs] == [kinds[r[2] and r[2][0]] for r in rows]
    assert [o.abort.status_code for o in outputs if o.abort] == [r[2][1] for r in rows if r[2] and r[2][0] == "abort"]


def test_the_routers_request_features_ride_in_the_schedulers_own_fields():
    request = g.request_for(SPECS["lora_processor_reasoning"])
    assert (request.lora_id, request.require_reasoning) == ("adapter-a", True)
    assert request.custom_logit_processor == '{"callable": "gASV"}'
    outputs = g.SglangCodec().decode_output(g.encode_outputs(_batch())).outputs
    assert [o.reasoning_tokens for o in outputs] == [0, 1, 5, 0, 2]


def test_prompt_logprobs_from_a_start_position_go_as_logprob_start_len_and_come_back_as_its_slice():
    """Issue 33 item 7: the start goes in the scheduler's own field; its slice (the start's id with no
    value, then one value per later prompt token) comes back as the prompt's positions from there."""
    from enginelink.machines.logprobs import ChoiceLogprobs

    request = g.request_for(SPECS["prompt_logprobs_from_2"])
    assert (request.return_logprob, request.logprob_start_len, request.top_logprobs_num) == (True, 2, 1)
    assert g.request_for(SPECS["logprobs"]).logprob_start_len == 0
    assert g.request_for(spec(logprobs=2)).logprob_start_len == -1
    batch = g.token_batch(["a"], [[9]], [None], prompt_tokens=[5], completion_tokens=[1],
                          output_token_logprobs_val=[[-0.5]], output_token_logprobs_idx=[[9]],
                          output_top_logprobs_val=[[[-0.5]]], output_top_logprobs_idx=[[[9]]],
                          input_token_logprobs_val=[[None, -1.5, -2.5]], input_token_logprobs_idx=[[3, 4, 5]],
                          input_top_logprobs_val=[[None, [-1.0], [-2.0]]], input_top_logprobs_idx=[[None, [7], [8]]])
    frames = g.encode_outputs(batch)
    (out,) = g.SglangCodec().decode_output(frames).outputs
    sample, prompt = g.SglangCodec.logprobs(out, frames)
    lp = ChoiceLogprobs(1, 1, keep_all=True, prompt_start=2)
    lp.feed(sample, prompt, 1, [9], [1, 2, 3, 4, 5])
    assert lp.prompt.ids == [3, 4, 5] and [p[0] for p in lp.prompt.positions] == [-1.5, -2.5]
    assert [list(p[3]) for p in lp.prompt.positions] == [[7], [8]]
    # Started at the prompt's last token: its id alone, with no value (the scheduler's [None]).
    batch = g.token_batch(["a"], [[9]], [None], prompt_tokens=[5], completion_tokens=[1],
                          input_token_logprobs_val=[[None]], input_token_logprobs_idx=[[5]])
    frames = g.encode_outputs(batch)
    (out,) = g.SglangCodec().decode_output(frames).outputs
    _, prompt = g.SglangCodec.logprobs(out, frames)
    last = ChoiceLogprobs(None, 0, keep_all=True, prompt_start=4)
    last.feed(None, prompt, 1, [9], [1, 2, 3, 4, 5])
    assert last.prompt.ids == [5] and last.prompt.positions == []
