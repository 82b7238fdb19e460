"""Constraints as vLLM 0.32's front end hands them to its engine (runtime/requests/constraints.py, wire/vllm.py).

What the engine receives is checked on the wire bytes (msgpack), as vLLM's
EngineCore decodes them: the ``_backend`` key its grammar_init reads, the
choice→EBNF rewrite xgrammar needs, ``auto`` resolved as vLLM resolves it.
"""

from __future__ import annotations

import json

import msgspec
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.runtime.requests.constraints import choice_as_grammar, constraint_of
from enginelink.runtime.errors import ClientError
from enginelink.runtime.requests.inputs import InputLimits
from enginelink.runtime.contracts.vllm.edge import validate_generate
from enginelink.runtime.requests.validate import EngineLimits
from enginelink.wire.vllm import VllmCodec, sampling_params_for
from tests.harness import generate_request

LIMITS = InputLimits()


def _engine(backend: str = "auto") -> EngineLimits:
    return EngineLimits(max_model_len=2048, vocab_size=4096, eos_token_ids=(2,), grammar_backend=backend)


def _on_the_wire(backend: str = "auto", **sampling) -> dict:
    """The ``structured_outputs`` map the engine would decode for this request."""
    call = validate_generate(generate_request("r", [5, 6, 7], max_tokens=4, **sampling), _engine(backend), 0.0)
    params = msgspec.msgpack.decode(msgspec.msgpack.encode(sampling_params_for(call.specs[0].sampling)))
    return params.get("structured_outputs")


def test_every_kind_carries_the_backend_the_engine_reads():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cases = {
        "regex": ({"regex": "[0-9]{3}"}, {"regex": "[0-9]{3}"}),
        "json_schema": ({"json_schema": json.dumps(schema)}, {"json": schema}),
        "json_object": ({"json_object": True}, {"json_object": True}),
        "grammar": ({"grammar": 'root ::= "a" | "b"'}, {"grammar": 'root ::= "a" | "b"'}),
        "structural_tag": ({"structural_tag": '{"type": "x"}'}, {"structural_tag": '{"type": "x"}'}),
    }
    for kind, (sampling, params) in cases.items():
        assert _on_the_wire(**sampling) == {**params, "_backend": "xgrammar", "_backend_was_auto": True}, kind
        assert _on_the_wire("xgrammar", **sampling) == {**params, "_backend": "xgrammar"}, kind
        assert _on_the_wire("guidance", **sampling) == {**params, "_backend": "guidance"}, kind
    assert _on_the_wire(temperature=0.0) is None


def test_a_choice_becomes_vllms_ebnf_for_xgrammar_and_stays_a_list_otherwise():
    choices = ["yes", 'say "no"', "a\\b\n"]
    grammar = 'root ::= "yes" | "say \\"no\\"" | "a\\\\b\\n"'
    assert choice_as_grammar(choices) == grammar
    assert _on_the_wire(choice=pb.ChoiceConstraint(choices=choices)) == {
        "grammar": grammar, "_backend": "xgrammar", "_backend_was_auto": True}
    assert _on_the_wire("guidance", choice=pb.ChoiceConstraint(choices=choices)) == {
        "choice": choices, "_backend": "guidance"}


def test_auto_falls_back_as_vllm_does_for_schemas_xgrammar_does_not_enforce():
    multiple_of = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}
    pattern_properties = {"type": "object", "patternProperties": {"^a": {"type": "string"}},
                          "properties": {"b": {"type": "number", "multipleOf": 2}}}
    assert _on_the_wire(json_schema=json.dumps(multiple_of))["_backend"] == "guidance"
    assert _on_the_wire(json_schema=json.dumps(pattern_properties))["_backend"] == "outlines"
    # A format xgrammar knows keeps it.
    assert _on_the_wire(json_schema=json.dumps({"type": "string", "format": "email"}))["_backend"] == "xgrammar"
    # An explicit xgrammar backend: vLLM's front end refuses such a schema.
    with pytest.raises(ClientError, match="json_schema.*xgrammar"):
        _on_the_wire("xgrammar", json_schema=json.dumps(multiple_of))
    for deep in ({"type": "array", "items": {"type": "array", "uniqueItems": True}},
                 {"allOf": [{"type": "string"}, {"enum": ["a"]}]}):
        with pytest.raises(ClientError, match="json_schema"):
            _on_the_wire("xgrammar", json_schema=json.dumps(deep))


@pytest.mark.parametrize(
    "sampling, field",
    [
        ({"json_object": False}, "json_object"),
        ({"grammar": "  \n\t"}, "grammar"),
        ({"structural_tag": " "}, "structural_tag"),
        ({"regex": "a\x00b"}, "regex"),
        ({"regex": ""}, "regex"),
        ({"json_schema": "[1]"}, "json_schema"),
        ({"json_schema": "true"}, "json_schema"),
        ({"json_schema": "{nope"}, "json_schema"),
        ({"choice": pb.ChoiceConstraint()}, "choice"),
    ],
)
def test_what_vllms_front_end_refuses_for_every_backend_is_refused_here(sampling, field):
    for backend in ("auto", "xgrammar", "guidance"):
        with pytest.raises(ClientError, match=f"sampling_params.{field}"):
            _on_the_wire(backend, **sampling)


def test_a_regex_is_not_judged_by_pythons_re():
    # Valid for xgrammar, an error for Python's re: the engine judges regexes.
    assert _on_the_wire(regex="(?<n>a)")["regex"] == "(?<n>a)"


def test_two_constraints_on_the_wire_reach_the_engine_as_one():
    # The contract's constraints are one protobuf oneof: a message carrying two
    # decodes to the last (protobuf's rule), so the engine never gets two (which
    # vLLM's StructuredOutputsParams would refuse).
    request = generate_request("r", [5, 6], max_tokens=2, regex="[0-9]+")
    body = request.SerializeToString()
    sp = pb.SamplingParams(json_object=True).SerializeToString()
    # GenerateRequest.sampling_params is field 4 (tag 0x22): a second occurrence merges into the first.
    decoded = pb.GenerateRequest.FromString(body + b"\x22" + bytes([len(sp)]) + sp)
    assert decoded.sampling_params.WhichOneof("constraint") == "json_object"
    call = validate_generate(decoded, _engine(), 0.0)
    assert call.specs[0].sampling.structured_outputs == {"json_object": True}
    assert call.constraint == "sampling_params.json_object"


def test_grammar_from_first_token_tells_the_engine_reasoning_has_ended():
    codec = VllmCodec()
    for flag, expected in ((True, True), (False, None)):
        call = validate_generate(generate_request("r", [5], max_tokens=2, regex="a", grammar_from_first_token=flag),
                                 _engine(), 0.0)
        assert call.specs[0].reasoning_ended is expected
        assert codec.encode_add(call.specs[0])  # encodes
    call = validate_generate(generate_request("r", [5], max_tokens=2, grammar_from_first_token=True), _engine(), 0.0)
    assert call.specs[0].reasoning_ended is None  # no constraint: nothing to start


def test_constraint_of_names_the_field_and_backend():
    sp = pb.SamplingParams(regex="x")
    constraint = constraint_of(sp, LIMITS, "outlines")
    assert (constraint.field, constraint.backend, constraint.backend_was_auto) == ("sampling_params.regex", "outlines", False)
    assert constraint_of(pb.SamplingParams(), LIMITS) is None
