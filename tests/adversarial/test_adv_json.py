"""Hostile structure: deeply nested or oversized JSON, and request bytes that are not a
message, are the client's fault (INVALID_ARGUMENT), never INTERNAL (issue 21, item 8).

JSON is attacked through each field that carries it (``json_schema``,
``kv_transfer_params_json``, ``structural_tag``), nested as arrays and as
objects, just past the depth limit and far past it (where Python's own
parser gives up with RecursionError), and over the size limits. Request
bytes are attacked through grpcio with an identity serializer (garbage,
truncated varints, a length running past the end) on several RPCs, and
through raw HTTP/2 (a body shorter than its gRPC length prefix, a
compressed-flag message).
"""

from __future__ import annotations

import json
import socket

import grpc
import h2.config
import h2.connection
import h2.events
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.runtime.errors import ClientError
from enginelink.runtime.requests.inputs import InputLimits
from enginelink.runtime.contracts.vllm.edge import validate_generate
from enginelink.runtime.requests.validate import EngineLimits
from tests.harness import generate_request

LIMITS = InputLimits()
ENGINE = EngineLimits(max_model_len=2048, vocab_size=4096, eos_token_ids=(2,))
SERVICE = "/vllm.grpc.engine.VllmEngine"


def arrays(depth: int) -> str:
    return "[" * depth + "]" * depth


def objects(depth: int) -> str:
    return '{"a":' * (depth - 1) + "{}" + "}" * (depth - 1)


def _request(**fields) -> pb.GenerateRequest:
    kv = fields.pop("kv_transfer_params_json", None)
    request = generate_request("j", [5, 6, 7], max_tokens=4, **fields)
    if kv is not None:
        request.kv_transfer_params_json = kv
    return request


def _refused(**fields) -> ClientError:
    with pytest.raises(ClientError) as error:
        validate_generate(_request(**fields), ENGINE, 0.0)
    return error.value


@pytest.mark.parametrize("nest", [arrays, objects])
@pytest.mark.parametrize("depth", [LIMITS.json_depth + 1, 5_000, 30_000])
@pytest.mark.parametrize("field", ["json_schema", "kv_transfer_params_json", "structural_tag"])
def test_json_nested_past_the_limit_is_refused(field, depth, nest):
    text = nest(depth)
    if field == "kv_transfer_params_json" and nest is arrays:
        text = '{"a":' + text + "}"  # it must be an object; the array inside nests
    cap = LIMITS.kv_transfer_params_bytes if field == "kv_transfer_params_json" else LIMITS.constraint_bytes
    error = _refused(**{field: text})
    assert error.field.endswith(field)
    if len(text.encode()) > cap:
        assert "bytes; at most" in str(error)
    else:
        assert f"nests deeper than {LIMITS.json_depth} levels" in str(error)


@pytest.mark.parametrize("field", ["json_schema", "kv_transfer_params_json", "structural_tag"])
def test_json_at_the_depth_limit_is_taken(field):
    text = objects(LIMITS.json_depth)
    call = validate_generate(_request(**{field: text}), ENGINE, 0.0)
    assert call.request_id == "j"


@pytest.mark.parametrize(
    "field, text, knob",
    [
        ("json_schema", json.dumps({"enum": ["x" * 100] * 700}), "ENGINELINK_MAX_CONSTRAINT_BYTES"),
        ("regex", "a" * (LIMITS.constraint_bytes + 1), "ENGINELINK_MAX_CONSTRAINT_BYTES"),
        ("grammar", "root ::= " + "x" * LIMITS.constraint_bytes, "ENGINELINK_MAX_CONSTRAINT_BYTES"),
        ("kv_transfer_params_json", json.dumps({"k": "v" * LIMITS.kv_transfer_params_bytes}),
         "ENGINELINK_MAX_KV_TRANSFER_PARAMS_BYTES"),
    ],
)
def test_oversized_client_text_is_refused_before_it_is_parsed(field, text, knob):
    error = _refused(**{field: text})
    assert error.field.endswith(field) and knob in str(error)


def test_oversized_choices_are_refused():
    request = _request()
    request.sampling_params.choice.choices.extend(["c" * 1000] * 70)
    with pytest.raises(ClientError, match="ENGINELINK_MAX_CONSTRAINT_BYTES"):
        validate_generate(request, ENGINE, 0.0)


def test_a_structural_tag_that_is_not_json_is_still_the_engines_to_judge():
    call = validate_generate(_request(structural_tag="<tag> not json"), ENGINE, 0.0)
    assert call.specs[0].sampling.structured_outputs == {"structural_tag": "<tag> not json"}


# JSON that ``json.loads`` takes but no engine wire carries (issue 38, item 1): it passed
# validation, was admitted, failed while encoded for the engine, and its id stayed in flight.
NOT_WIRE_JSON = {
    "lone surrogate": ('{"description":"\\ud800"}', "lone UTF-16 surrogate"),
    "lone surrogate key": ('{"\\udfff":1}', "lone UTF-16 surrogate"),
    "integer past uint64": ('{"x":100000000000000000000}', "integer outside"),
    "integer below int64": ('{"x":-9223372036854775809}', "integer outside"),
    "NaN": ('{"x":NaN}', "NaN is not JSON"),
    "Infinity": ('{"x":-Infinity}', "-Infinity is not JSON"),
    "number past a double": ('{"x":1e999}', "too large for a double"),
}


@pytest.mark.parametrize("case", sorted(NOT_WIRE_JSON))
@pytest.mark.parametrize("field", ["json_schema", "kv_transfer_params_json", "structural_tag"])
def test_json_the_engine_wire_cannot_carry_is_refused(field, case):
    text, words = NOT_WIRE_JSON[case]
    if field == "structural_tag" and words.endswith("is not JSON"):
        # A structural tag that is not JSON at all goes to the engine as text, its to judge (below).
        assert validate_generate(_request(**{field: text}), ENGINE, 0.0).request_id == "j"
        return
    error = _refused(**{field: text})
    assert error.field.endswith(field) and words in str(error)


def test_json_at_the_wire_s_edges_is_taken():
    """The largest and smallest integers msgpack carries, a surrogate pair (one character) and non-ASCII."""
    text = '{"a":18446744073709551615,"b":-9223372036854775808,"c":"\\ud83d\\ude00","d":"é","e":1e308}'
    for field in ("json_schema", "kv_transfer_params_json"):
        call = validate_generate(_request(**{field: text}), ENGINE, 0.0)
        assert call.request_id == "j"


# -- over gRPC: JSON, then bytes that are not a message ----------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("field", ["json_schema", "kv_transfer_params_json"])
def test_the_issue_s_values_are_refused_and_leave_the_id_free(servicer, field):
    """The two reproductions of issue 38: INVALID_ARGUMENT each time (never ALREADY_EXISTS), then the id serves."""
    text = '{"description":"\\ud800"}' if field == "json_schema" else '{"x":100000000000000000000}'
    request = _request(**{field: text})
    request.request_id = f"leak-{field}"
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as error:
            list(servicer.stub.Generate(request, timeout=10))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
        assert field in error.value.details()
    good = generate_request(request.request_id, [5, 6, 7], max_tokens=2)
    responses = list(servicer.stub.Generate(good, timeout=10))
    assert responses[-1].WhichOneof("response") == "complete"




@pytest.mark.slow
@pytest.mark.parametrize("field", ["json_schema", "kv_transfer_params_json"])
def test_deep_json_over_grpc_is_invalid_argument(servicer, field):
    for text in (arrays(20_000), objects(200)):
        if field == "kv_transfer_params_json":
            text = '{"a":' + text + "}"
        with pytest.raises(grpc.RpcError) as error:
            list(servicer.stub.Generate(_request(**{field: text}), timeout=10))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
        assert field in error.value.details()


GARBAGE = [
    b"\x0a\x80",  # field 1 (request_id), its length varint cut off
    b"\x0a\x05ab",  # a length running past the end
    b"\x12\x10\x0a\x02\x08",  # a sub-message cut inside
    b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # a tag varint of eleven bytes
    bytes(range(256)),
]


@pytest.mark.slow
@pytest.mark.parametrize("body", GARBAGE)
def test_bytes_that_are_not_a_message_are_invalid_argument(servicer, body):
    identity = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    calls = [
        servicer.channel.unary_stream(f"{SERVICE}/Generate", **identity),
        servicer.channel.unary_unary(f"{SERVICE}/Abort", **identity),
        servicer.channel.unary_unary(f"{SERVICE}/HealthCheck", **identity),
    ]
    for rpc in calls:
        with pytest.raises(grpc.RpcError) as error:
            result = rpc(body, timeout=10)
            if not isinstance(result, bytes):
                list(result)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
        assert "does not decode" in error.value.details()
    # The servicer serves on.
    assert servicer.stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy


def raw_grpc_call(port: int, path: str, body: bytes) -> dict[str, str]:
    """One gRPC call over a bare HTTP/2 connection: the response's headers and trailers."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    stream_id = conn.get_next_available_stream_id()
    conn.send_headers(stream_id, [(":method", "POST"), (":scheme", "http"), (":path", path),
                                  (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc"),
                                  ("te", "trailers")])
    conn.send_data(stream_id, body, end_stream=True)
    got: dict[str, str] = {}
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(conn.data_to_send())
        while True:
            data = sock.recv(65536)
            assert data, f"the servicer closed the connection; so far {got}"
            for event in conn.receive_data(data):
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    got.update(dict(event.headers))
                elif isinstance(event, h2.events.StreamReset) and event.stream_id == stream_id:
                    return {**got, "reset": str(event.error_code)}
                elif isinstance(event, h2.events.StreamEnded) and event.stream_id == stream_id:
                    return got
            sock.sendall(conn.data_to_send())


@pytest.mark.slow
@pytest.mark.parametrize("rpc", ["Generate", "HealthCheck", "SubscribeKvEvents"])
def test_a_body_shorter_than_its_length_prefix_is_invalid_argument(servicer, rpc):
    message = pb.HealthCheckRequest().SerializeToString() + b"\x0a\x01x" * 3
    # Small declared lengths: a prefix over the receive limit is refused earlier, as RESOURCE_EXHAUSTED.
    for declared, sent in [(100, message), (4, b"\x0a")]:
        got = raw_grpc_call(servicer.port, f"{SERVICE}/{rpc}", b"\x00" + declared.to_bytes(4, "big") + sent)
        assert got.get("grpc-status") == str(grpc.StatusCode.INVALID_ARGUMENT.value[0]), got
        assert "ended before" in got.get("grpc-message", "")


@pytest.mark.slow
@pytest.mark.parametrize("rpc", ["HealthCheck", "Abort"])
def test_a_compressed_message_is_unimplemented_not_internal(servicer, rpc):
    body = pb.AbortRequest(request_ids=["x"]).SerializeToString()
    got = raw_grpc_call(servicer.port, f"{SERVICE}/{rpc}", b"\x01" + len(body).to_bytes(4, "big") + body)
    assert got.get("grpc-status") == str(grpc.StatusCode.UNIMPLEMENTED.value[0]), got
    assert "compressed" in got.get("grpc-message", "")
