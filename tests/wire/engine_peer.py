"""The real engine's side of the codec round-trip tests, run in its struct-only venv.

    ENGINE_VENV/bin/python engine_peer.py {sglang|tokenspeed} CASES.msgpack RESULTS.msgpack

It imports nothing of enginelink: it builds the *real* package's structs
from plain keyword arguments and answers, for each case, in one process (the
struct modules import torch, so one start serves every case):

- ``decode``: the real package's own decoder reads our encoder's bytes; is
  the result equal to the real struct built from the same arguments?
- ``encode``: the real struct built from the arguments, encoded by the real
  package's own encoder (its bytes go back to enginelink's decoder).

Keyword arguments are plain msgpack values, except ``{"__array__": [typecode,
values]}`` (an ``array.array``) and ``{"__struct__": NAME, "fields": {...}}``
(a nested struct, built the same way).
"""

from __future__ import annotations

import sys
from array import array

import msgspec


def _sglang():
    from sglang.srt.managers import io_struct
    from sglang.srt.sampling.sampling_params import SamplingParams

    classes = {name: getattr(io_struct, name) for name in (
        "TokenizedGenerateReqInput", "TokenizedEmbeddingReqInput", "AbortReq", "FlushCacheReqInput",
        "FlushCacheReqOutput", "ProfileReq", "ProfileReqOutput", "HealthCheckOutput", "BatchTokenIDOutput",
        "BatchEmbeddingOutput")}
    classes["SamplingParams"] = SamplingParams

    def fix(name, fields):
        if name == "ProfileReq" and "req_type" in fields:
            fields["req_type"] = io_struct.ProfileReqType(fields["req_type"])
        if name == "SamplingParams" and fields.get("stop_token_ids") is not None:
            fields["stop_token_ids"] = set(fields["stop_token_ids"])
        return fields

    def decode(frames, name):
        return io_struct.msgpack_decode(frames[0])

    def encode(obj):
        return [io_struct.msgpack_encode(obj)]

    return classes, fix, decode, encode


def _tokenspeed():
    from tokenspeed.runtime.engine import io_struct, zmq_wire
    from tokenspeed.runtime.sampling.sampling_params import SamplingParams

    classes = {"TokenizedGenerateReqInput": io_struct.TokenizedGenerateReqInput,
               "BatchTokenIDOutSlim": io_struct.BatchTokenIDOutSlim, "SamplingParams": SamplingParams}
    for name in ("WireReadyMessage", "WireHandshakeAddresses", "WireHandshakeInitMessage",
                 "WireEngineCoreReadyResponse"):
        classes[name] = getattr(zmq_wire, name)
    outputs = io_struct.MsgpackDecoder(io_struct.ipc_message_union())
    encoder = io_struct.MsgpackEncoder()

    def fix(name, fields):
        if name == "SamplingParams" and fields.get("stop_token_ids") is not None:
            fields["stop_token_ids"] = set(fields["stop_token_ids"])
        return fields

    def decode(frames, name):
        if name == "TokenizedGenerateReqInput":
            raw = zmq_wire._DEC_ADD.decode(frames[1:])
            # The engine's whole receive path must take it too (it normalises in place).
            received = zmq_wire.decode_request_frames(list(frames))[0]
            if received.validation_error is not None:
                raise ValueError(f"the engine marks it invalid: {received.validation_error}")
            return raw
        if name == "WireHandshakeInitMessage":
            return zmq_wire.decode_init(frames[0])
        if name == "AbortList":
            return zmq_wire.decode_request_frames(list(frames))
        return outputs.decode(list(frames))

    def encode(obj):
        if isinstance(obj, (zmq_wire.WireReadyMessage, zmq_wire.WireEngineCoreReadyResponse)):
            return [zmq_wire.encode(obj)]
        return [bytes(b) for b in encoder.encode(obj)]

    return classes, fix, decode, encode


def main(engine: str, cases_path: str, results_path: str) -> None:
    classes, fix, decode, encode = {"sglang": _sglang, "tokenspeed": _tokenspeed}[engine]()

    def value(v):
        if isinstance(v, dict) and "__array__" in v:
            typecode, values = v["__array__"]
            return array(typecode, values)
        if isinstance(v, dict) and "__struct__" in v:
            return build(v["__struct__"], v["fields"])
        if isinstance(v, list):
            return [value(x) for x in v]
        if isinstance(v, dict):
            return {k: value(x) for k, x in v.items()}
        return v

    def build(name, fields):
        return classes[name](**fix(name, {k: value(v) for k, v in fields.items()}))

    results = {}
    for case in msgspec.msgpack.decode(open(cases_path, "rb").read()):
        try:
            if case["op"] == "decode":
                got = decode(case["frames"], case["name"])
                if case["name"] == "AbortList":
                    expected = [classes_abort(engine)(rid=r) for r in case["fields"]["rids"]]
                else:
                    expected = build(case["name"], case["fields"])
                diff = [] if got == expected else _diff(got, expected)
                results[case["id"]] = {"equal": got == expected, "type": type(got).__name__, "diff": diff}
            else:
                results[case["id"]] = {"frames": encode(build(case["name"], case["fields"]))}
        except Exception as exc:  # reported to the test, which fails naming the case
            results[case["id"]] = {"error": f"{type(exc).__name__}: {exc}"}
    open(results_path, "wb").write(msgspec.msgpack.encode(results))


def classes_abort(engine):
    from tokenspeed.runtime.engine.io_struct import AbortReq

    return AbortReq


def _diff(got, expected) -> list[str]:
    if type(got) is not type(expected) or not isinstance(got, msgspec.Struct):
        return [f"{got!r} != {expected!r}"]
    out = []
    for name in got.__struct_fields__:
        a, b = getattr(got, name), getattr(expected, name)
        if a != b:
            out.append(f"{name}: decoded {a!r}, expected {b!r}")
    return out


if __name__ == "__main__":
    main(*sys.argv[1:4])
