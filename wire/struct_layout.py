"""Struct layouts of positional msgspec wires, and their comparison.

SGLang and TokenSpeed send msgspec structs as tagged positional arrays: a
release that moves, renames, adds a required field or changes a default
silently changes what every position means. This module describes a struct as
data (tag field, tag, array-like, each field's wire name, whether it is
required and its default) so that enginelink's codec and an installed engine
can be compared field by field before launch.

It is also a script, run by path with the *engine's* interpreter (it imports
only the standard library and msgspec, never enginelink):

    ENGINE_VENV/bin/python struct_layout.py sglang      # prints one JSON line

Rules:
- ``layout_of`` is the one description both sides use, so a difference is a
  real difference and never an artefact of two describers;
- ``compare`` is pure and names the release, the struct and the field;
  positional structs compare position by position (name, required, default),
  map-encoded ones (handshake messages) by their set of keys;
- a default that is not JSON (an Enum member) is written as its value, which
  is what msgpack carries.
"""

from __future__ import annotations

import enum
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import msgspec

# Where each engine declares the structs its codec speaks: name -> "module:Class".
ENGINES: dict[str, dict[str, Any]] = {
    "sglang": {
        "distribution": "sglang",
        "structs": {
            name: ("sglang.srt.sampling.sampling_params" if name == "SamplingParams"
                   else "sglang.srt.managers.io_struct") + f":{name}"
            for name in ("SamplingParams", "TokenizedGenerateReqInput", "TokenizedEmbeddingReqInput", "AbortReq",
                         "FlushCacheReqInput", "FlushCacheReqOutput", "ProfileReq", "ProfileReqOutput",
                         "HealthCheckOutput", "BatchTokenIDOutput", "BatchEmbeddingOutput")
        } | {  # a request's mm_inputs (router-preprocessed images)
            name: f"sglang.srt.managers.schedule_batch:{name}"
            for name in ("MultimodalDataItem", "MultimodalProcessorOutput")
        },
    },
    "tokenspeed": {
        "distribution": "tokenspeed",
        "structs": {
            "SamplingParams": "tokenspeed.runtime.sampling.sampling_params:SamplingParams",
            "TokenizedGenerateReqInput": "tokenspeed.runtime.engine.io_struct:TokenizedGenerateReqInput",
            "BatchTokenIDOutSlim": "tokenspeed.runtime.engine.io_struct:BatchTokenIDOutSlim",
            "WireReadyMessage": "tokenspeed.runtime.engine.zmq_wire:WireReadyMessage",
            "WireHandshakeAddresses": "tokenspeed.runtime.engine.zmq_wire:WireHandshakeAddresses",
            "WireHandshakeInitMessage": "tokenspeed.runtime.engine.zmq_wire:WireHandshakeInitMessage",
            "WireEngineCoreReadyResponse": "tokenspeed.runtime.engine.zmq_wire:WireEngineCoreReadyResponse",
        },
    },
}


def read_struct(cls: type[msgspec.Struct], kind_of: Callable[[Any], Any]) -> type[msgspec.Struct]:
    """``cls``'s layout (tag, positions, required fields, defaults) as a front end reads it:
    each field decoded as ``kind_of(field_info)`` says, ``msgspec.Raw`` for a column it reads
    only when asked (or never). Named ``<cls>Read``; ``layout_of`` describes both alike."""
    fields = []
    for info in msgspec.structs.fields(cls):
        kind = kind_of(info)
        fields.append((info.name, kind) if info.required else (info.name, kind, info.default))
    config = cls.__struct_config__
    return msgspec.defstruct(f"{cls.__name__}Read", fields, tag=config.tag, tag_field=config.tag_field,
                             array_like=config.array_like, kw_only=True, gc=False)  # fmt: skip


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, (set, frozenset, tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def layout_of(cls: type[msgspec.Struct]) -> dict[str, Any]:
    """One struct's wire description."""
    config = cls.__struct_config__
    fields = []
    for f in msgspec.structs.fields(cls):
        entry: dict[str, Any] = {"name": f.encode_name, "required": f.required}
        if not f.required:
            entry["default"] = _plain(f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory())
        fields.append(entry)
    return {"tag_field": config.tag_field, "tag": config.tag, "array_like": config.array_like, "fields": fields}


def _default(field: dict) -> str:
    return "required" if field["required"] else f"default {field.get('default')!r}"


def compare(ours: dict, theirs: dict, engine: str) -> list[str]:
    """Every way ``theirs`` (the installed release's layout) differs from ``ours`` (the codec's).

    Within the fields both declare, names, required-ness and defaults must be
    equal; fields the release appends past ours must have defaults (we never
    send them; a required one would make every message we send invalid).
    """
    problems: list[str] = []
    release = f"{engine} {theirs.get('version', '?')}"
    installed = theirs.get("structs", {})
    for name, mine in ours["structs"].items():
        other = installed.get(name)
        if other is None:
            problems.append(f"{name} does not exist in {release}")
            continue
        for key in ("tag_field", "tag", "array_like"):
            if mine[key] != other.get(key):
                problems.append(f"{name} has {key} {other.get(key)!r} in {release}, {mine[key]!r} in enginelink's codec")
        sent, there = mine["fields"], other.get("fields", [])
        if not mine["array_like"]:
            problems += _compare_map(name, sent, there, release)
            continue
        for index, field in enumerate(sent):
            if index >= len(there):
                problems.append(f"{name} has {len(there)} fields in {release}; enginelink's codec has {len(sent)} "
                                f"(field {index} {field['name']!r} does not exist there)")
                break
            theirs_field = there[index]
            if theirs_field["name"] != field["name"]:
                problems.append(f"{name} field {index} is {theirs_field['name']!r} in {release}, "
                                f"{field['name']!r} in enginelink's codec")
            elif _default(theirs_field) != _default(field):
                problems.append(f"{name} field {index} {field['name']!r} is {_default(theirs_field)} in {release}, "
                                f"{_default(field)} in enginelink's codec")
        for index in range(len(sent), len(there)):
            if there[index]["required"]:
                problems.append(f"{name} field {index} {there[index]['name']!r} is required in {release}; "
                                "enginelink's codec does not send it")
    return problems


def _compare_map(name: str, sent: list[dict], there: list[dict], release: str) -> list[str]:
    """A map-encoded struct (a handshake message) is matched by key: order and defaults do not travel."""
    mine, theirs = {f["name"] for f in sent}, {f["name"] for f in there}
    return ([f"{name} has no key {key!r} in {release}; enginelink's codec has it" for key in sorted(mine - theirs)]
            + [f"{name} has key {key!r} in {release}; enginelink's codec does not know it"
               for key in sorted(theirs - mine)])


def installed(engine: str) -> dict[str, Any]:
    """The installed release's layouts (run inside the engine's interpreter)."""
    from importlib import metadata

    spec = ENGINES[engine]
    structs = {}
    for name, where in spec["structs"].items():
        module, _, attr = where.partition(":")
        structs[name] = layout_of(getattr(importlib.import_module(module), attr))
    return {"engine": engine, "version": metadata.version(spec["distribution"]), "structs": structs}


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ENGINES:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(ENGINES)}}}")
    # Run by path, this folder is sys.path[0]: its sglang.py / tokenspeed.py would shadow the engines.
    # Real paths on both sides: Python resolves a symlinked script's folder, __file__ keeps the link.
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    print(json.dumps(installed(sys.argv[1]), sort_keys=True))
