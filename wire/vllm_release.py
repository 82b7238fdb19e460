"""One vLLM release as enginelink's vLLM codec speaks it: what its layout changes.

The codec (``wire/vllm.py``) declares vLLM's structs as vLLM 0.32.0 has them
(the *canonical* structs). A release's layout (``wire/vllm_layout.py``: the
committed file of a release in the window, or an installed release's own
description) says how that release differs, and ``ReleaseWire`` is what the
codec then does differently:

- ADD: the release's ``EngineCoreRequest`` fields in its order, each filled
  by name from the canonical request or, for a field the codec does not
  know, with the release's own default; prompt ids as an int32 array
  (``[dtype, shape, data]``) where the release declares ``np.ndarray``
  (0.34.0), a list elsewhere; ``PoolingParams`` by name the same way;
- outputs: decoded by the canonical structs, which is exact when the
  release's fields sit at the canonical positions (msgspec fills a shorter
  array's missing trailing fields with defaults and ignores extra ones);
- utility calls: the arguments cut to the release's signature when the ones
  cut are the canonical defaults (``profile`` takes 2 before 0.32.0, 4
  since), a method the release does not have refused by name.

``speakable`` lists everything in a layout the codec cannot speak. Every
release of the window has nothing listed (a test); a release outside it is
used (``--allow-untested-vllm``) only when its installed layout has nothing
listed. Rules: pure (a layout in, problems or a ``ReleaseWire`` out); the
fast path (a release whose request is the canonical one) encodes the
canonical struct itself, as before.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any, Final, Sequence

import msgspec

from enginelink.wire import vllm
from enginelink.wire.engine import FinishReason
from enginelink.wire.vllm_arrays import EXT_RAW_VIEW
from enginelink.wire.vllm_layout import load, signature, unknown

CANONICAL: Final = vllm.VLLM_VERSION


def _names(cls: type[msgspec.Struct]) -> list[str]:
    return [f.encode_name for f in msgspec.structs.fields(cls)]


def _defaults(cls: type[msgspec.Struct]) -> dict[str, Any]:
    return {f.encode_name: (f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory())
            for f in msgspec.structs.fields(cls) if not f.required}


# What the codec fills in a request (request_for): every other field is left at its default.
FILLED_REQUEST: Final = ("request_id", "prompt_token_ids", "mm_features", "sampling_params", "pooling_params",
                         "arrival_time", "lora_request", "cache_salt", "data_parallel_rank", "client_index",
                         "trace_headers", "reasoning_ended", "abort_immediately")
FILLED_POOLING: Final = ("use_activation", "task", "skip_reading_prefix_cache", "output_kind")
# The utility methods enginelink calls (liveness probe, FlushCache / warm-up, the profiler RPCs).
CALLED_METHODS: Final = ("is_sleeping", "reset_prefix_cache", "profile")
# The engine arguments enginelink writes on the engine's command line or reads from it (the KV-event
# publisher, the capture cap, DP ranks, the launcher's own settings, the facts it reports).
ENGINE_ARGS: Final = (
    "kv_events_config", "max_cudagraph_capture_size", "compilation_config", "cudagraph_capture_sizes",
    "data_parallel_size", "data_parallel_size_local", "data_parallel_rank", "data_parallel_start_rank",
    "data_parallel_address", "data_parallel_rpc_port", "node_rank", "nnodes", "kv_cache_memory_bytes",
    "max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_logprobs", "enforce_eager",
    "served_model_name", "structured_outputs_config", "speculative_config", "disable_log_stats", "shutdown_timeout",
)
# Request type bytes, output kinds and event types the codec writes or reads.
REQUEST_TYPES: Final = {"ADD": vllm.REQ_ADD.hex(), "ABORT": vllm.REQ_ABORT.hex(), "UTILITY": vllm.REQ_UTILITY.hex()}
OUTPUT_KINDS: Final = {"DELTA": vllm.OUTPUT_KIND_DELTA, "FINAL_ONLY": vllm.OUTPUT_KIND_FINAL_ONLY}
EVENT_TYPES: Final = {"QUEUED": vllm.EVENT_QUEUED, "SCHEDULED": vllm.EVENT_SCHEDULED, "PREEMPTED": vllm.EVENT_PREEMPTED}


# vLLM front-end code enginelink does the work of, by the first release each version of it applies
# to: the digest (wire/vllm_layout.py FUNCTIONS) of the code each of enginelink's mirrors was written
# from. runtime/requests/constraints.py keeps a rule set per entry of the structured-output functions
# (vllm_minor picks it); wire/vllm.py's sampling_params_for mirrors update_from_generation_config. A
# release whose code is not the one listed for it fails tests/wire/test_vllm_layouts.py: re-read it.
MIRRORED: Final = {
    "has_xgrammar_unsupported_json_features": {28: "736abf6bbaef8843", 29: "faf312c0edf06ea0",
                                               30: "8a449cf271507392", 31: "6a2894604a4da854",
                                               32: "dc4772baaab631f1"},
    "has_guidance_unsupported_json_features": {28: "8356f1e6c581361b"},
    "choice_as_grammar": {28: "8ad376e6e3672b7d", 31: "bd041cc449ed3391"},
    "SamplingParams._validate_structured_outputs": {28: "c056b48b1549d8b5", 31: "a88ff872129d1710",
                                                    32: "b344b37a9a74bfd9"},
    "SamplingParams.update_from_generation_config": {28: "0e2828c322cd2f47"},
}


def mirrored(function: str, release: str) -> str | None:
    """The digest of ``function``'s code that enginelink mirrors for ``release`` (0.<minor>.x)."""
    minor = int(release.split(".")[1])
    versions = [m for m in MIRRORED[function] if m <= minor]
    return MIRRORED[function][max(versions)] if versions else None


def _fields(layout: dict, struct: str) -> list[dict]:
    return layout["structs"][struct]["fields"]


def _field_names(layout: dict, struct: str) -> list[str]:
    return [f["name"] for f in _fields(layout, struct)]


def prompt_ids_kind(layout: dict) -> str | None:
    """How the release types ``EngineCoreRequest.prompt_token_ids``: "array", "list" or None (neither)."""
    spelled = next((f.get("type", "") for f in _fields(layout, "EngineCoreRequest") if f["name"] == "prompt_token_ids"), "")
    if "ndarray" in spelled:
        return "array"
    if "list[int]" in spelled or "List[int]" in spelled:
        return "list"
    return None


def _positional(name: str, layout: dict, canonical: type[msgspec.Struct], filled: Sequence[str]) -> list[str]:
    """A positional struct the codec writes by name: it must take every field the codec fills, and
    every other field it has must be optional with a default the layout could read."""
    release = layout["release"]
    fields = {f["name"]: f for f in _fields(layout, name)}
    problems = [f"{name} has no field {n!r} in vLLM {release}; enginelink fills it" for n in filled if n not in fields]
    known = set(_names(canonical))
    for f in fields.values():
        if f["name"] in known:
            continue
        if f["required"]:
            problems.append(f"{name} field {f['name']!r} is required in vLLM {release}; enginelink does not know it")
        elif unknown(f.get("default")):
            problems.append(f"{name} field {f['name']!r} of vLLM {release} has a default enginelink cannot "
                            f"write ({f['default']['expr']})")
    return problems


def _read_in_place(name: str, layout: dict, canonical: type[msgspec.Struct], required: Sequence[str]) -> list[str]:
    """A positional struct the codec decodes: each release field at the canonical position, or past them."""
    release = layout["release"]
    mine, theirs = _names(canonical), _field_names(layout, name)
    problems = [f"{name} field {i} is {theirs[i]!r} in vLLM {release}, {mine[i]!r} in enginelink's codec"
                for i in range(min(len(mine), len(theirs))) if mine[i] != theirs[i]]
    problems += [f"{name} has no field {n!r} in vLLM {release}" for n in required if n not in theirs]
    return problems


def _enum(name: str, layout: dict, expected: dict[str, Any], exhaustive: bool = False) -> list[str]:
    release, members = layout["release"], layout["enums"].get(name, {})
    problems = [f"{name} {member} is {members.get(member, 'missing')!r} in vLLM {release}, {value!r} in "
                "enginelink's codec" for member, value in expected.items() if members.get(member) != value]
    if exhaustive:
        problems += [f"{name} {member} is {value!r} in vLLM {release}, unknown in enginelink's codec"
                     for member, value in members.items() if member not in expected]
    return problems


def speakable(layout: dict) -> list[str]:
    """Everything in ``layout`` (a release's) that enginelink's codec cannot speak; [] when it can."""
    release = layout.get("release", "?")
    problems: list[str] = []
    missing = [s for s in ("EngineCoreRequest", "EngineCoreOutput", "EngineCoreOutputs", "SamplingParams",
                           "PoolingParams", "UtilityOutput", "EngineCoreReadyResponse", "EngineZmqAddresses",
                           "EngineHandshakeMetadata", "KVEventBatch", "BlockStored", "BlockRemoved",
                           "AllBlocksCleared", "LogprobsLists", "LogprobsTensors") if s not in layout["structs"]]
    if missing:
        return [f"vLLM {release} has no {', '.join(missing)}"]
    problems += _positional("EngineCoreRequest", layout, vllm.EngineCoreRequest, FILLED_REQUEST)
    if prompt_ids_kind(layout) is None:
        problems.append(f"EngineCoreRequest.prompt_token_ids of vLLM {release} is neither a list of ints nor an array")
    problems += _positional("PoolingParams", layout, vllm.PoolingParams, FILLED_POOLING)
    problems += _read_in_place("EngineCoreOutputs", layout, vllm.EngineCoreOutputs, ("engine_index", "outputs"))
    problems += _read_in_place("EngineCoreOutput", layout, vllm.EngineCoreOutput, ("request_id", "new_token_ids"))
    problems += _read_in_place("UtilityOutput", layout, vllm.UtilityOutput, ("call_id", "failure_message", "result"))
    for struct, reads in (("LogprobsLists", 3), ("LogprobsTensors", 3)):
        names = _field_names(layout, struct)[:reads]
        if len(names) < reads or names[1] != "logprobs":
            problems.append(f"{struct} of vLLM {release} is {names}: enginelink reads [token ids, logprobs, ranks]")
    # SamplingParams is a map: the keys the codec may send must exist, with the default the codec
    # assumes (omit_defaults leaves a key at its default off the wire).
    sampling = {f["name"]: f for f in _fields(layout, "SamplingParams")}
    for key, default in _defaults(vllm.SamplingParams).items():
        theirs = sampling.get(key)
        if theirs is None:
            problems.append(f"SamplingParams has no key {key!r} in vLLM {release}; enginelink sends it")
        elif theirs["required"] or (not unknown(theirs.get("default")) and theirs.get("default") != default):
            problems.append(f"SamplingParams {key!r} defaults to {theirs.get('default', 'nothing')!r} in vLLM "
                            f"{release}, {default!r} in enginelink's codec (a key left at its default is not sent)")
    problems += _enum("FinishReason", layout, {r.name: r.value for r in FinishReason}, exhaustive=True)
    problems += _enum("EngineCoreRequestType", layout, {k: {"hex": v} for k, v in REQUEST_TYPES.items()})
    problems += _enum("RequestOutputKind", layout, OUTPUT_KINDS)
    problems += _enum("EngineCoreEventType", layout, EVENT_TYPES)
    for struct, sent in (("EngineHandshakeMetadata", ("addresses", "parallel_config")),
                         ("EngineZmqAddresses", ("inputs", "outputs"))):
        needed = [f["name"] for f in _fields(layout, struct) if f["required"] and f["name"] not in sent]
        if needed:
            problems.append(f"{struct} needs {needed} in vLLM {release}; enginelink's handshake does not send them")
    if "vllm_version" not in _field_names(layout, "EngineCoreReadyResponse"):
        problems.append(f"EngineCoreReadyResponse has no vllm_version in vLLM {release}")
    for name, tag in (("BlockStored", "BlockStored"), ("BlockRemoved", "BlockRemoved"),
                      ("AllBlocksCleared", "AllBlocksCleared")):
        struct = layout["structs"][name]
        if struct["tag"] != tag or struct["tag_field"] != "type" or struct["array_like"]:
            problems.append(f"{name} of vLLM {release} is not a map tagged type={tag!r}")
    if _field_names(layout, "KVEventBatch")[:3] != ["ts", "events", "data_parallel_rank"]:
        problems.append(f"KVEventBatch of vLLM {release} is {_field_names(layout, 'KVEventBatch')}")
    methods = layout.get("methods", {})
    problems += [f"vLLM {release} has no utility method {m!r}" for m in CALLED_METHODS if m not in methods]
    args = set(layout.get("engine_args", ()))
    problems += [f"vLLM {release} has no engine argument --{a.replace('_', '-')}" for a in ENGINE_ARGS if a not in args]
    return problems


@dataclass(frozen=True)
class ReleaseWire:
    """What the codec does for one release (``for_layout``)."""

    release: str
    request_fields: tuple[str, ...]
    # Defaults of the request fields the canonical struct does not have.
    request_extra: dict[str, Any]
    prompt_ids_array: bool
    pooling_fields: tuple[str, ...]
    pooling_extra: dict[str, Any]
    methods: dict[str, list[dict]] = field(repr=False)
    canonical_methods: dict[str, list[dict]] = field(repr=False)
    # The request is the canonical struct as it is (0.31.0 to 0.33.0): it goes on the wire itself.
    canonical_request: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "canonical_request",
                           not self.prompt_ids_array and self.request_fields == _CANONICAL_REQUEST)

    def request(self, req: vllm.EngineCoreRequest) -> vllm.EngineCoreRequest | list:
        """What goes on the wire for ``req``: itself, or the release's positional array."""
        if self.canonical_request and (req.pooling_params is None or self.pooling_fields == _CANONICAL_POOLING):
            return req
        values = []
        for name in self.request_fields:
            if name in self.request_extra:
                values.append(self.request_extra[name])
                continue
            value = getattr(req, name)
            if name == "prompt_token_ids" and self.prompt_ids_array and value is not None:
                value = prompt_ids_array(value)
            elif name == "pooling_params" and value is not None and self.pooling_fields != _CANONICAL_POOLING:
                value = [self.pooling_extra[n] if n in self.pooling_extra else getattr(value, n)
                         for n in self.pooling_fields]
            values.append(value)
        return values

    def utility_args(self, method: str, args: Sequence[object]) -> list:
        """``args`` as this release's ``method`` takes them; ValueError when it cannot take them."""
        params = self.methods.get(method)
        if params is None:
            raise ValueError(f"vLLM {self.release} has no utility method {method!r}")
        if any(p.get("kind") == "var_positional" for p in params):
            return list(args)
        positional = [p for p in params if p.get("kind", "positional") == "positional"]
        if len(args) <= len(positional):
            return list(args)
        # Arguments past the release's parameters may go only when they say what the default says.
        newer = [p for p in self.canonical_methods.get(method, []) if p.get("kind", "positional") == "positional"]
        for index in range(len(positional), len(args)):
            default = newer[index].get("default", ...) if index < len(newer) else ...
            if default is ... or args[index] != default:
                raise ValueError(f"vLLM {self.release}'s {method} takes {signature(params)}: "
                                 f"argument {index + 1} ({args[index]!r}) cannot be given")
        return list(args[: len(positional)])


_CANONICAL_REQUEST: Final = tuple(_names(vllm.EngineCoreRequest))
_CANONICAL_POOLING: Final = tuple(_names(vllm.PoolingParams))


def prompt_ids_array(ids: Sequence[int]) -> list:
    """Prompt ids as vLLM 0.34's front end sends them: an int32 array, ``[dtype, shape, data]``
    (inline, raw bytes as msgpack Ext 3; vLLM's decoder takes inline data at any size)."""
    data = array("i", ids).tobytes()  # little-endian hosts only, as vllm_arrays
    return ["<i4", [len(ids)], msgspec.msgpack.Ext(EXT_RAW_VIEW, data)]


class Unspeakable(ValueError):
    """A layout the codec cannot speak: the problems, one a line."""


def for_layout(layout: dict) -> ReleaseWire:
    """The codec's view of a release; ``Unspeakable`` when ``speakable`` lists anything."""
    problems = speakable(layout)
    if problems:
        raise Unspeakable("; ".join(problems))
    known_request, known_pooling = set(_CANONICAL_REQUEST), set(_CANONICAL_POOLING)
    return ReleaseWire(
        release=layout["release"],
        request_fields=tuple(_field_names(layout, "EngineCoreRequest")),
        request_extra={f["name"]: f.get("default") for f in _fields(layout, "EngineCoreRequest")
                       if f["name"] not in known_request},
        prompt_ids_array=prompt_ids_kind(layout) == "array",
        pooling_fields=tuple(_field_names(layout, "PoolingParams")),
        pooling_extra={f["name"]: f.get("default") for f in _fields(layout, "PoolingParams")
                       if f["name"] not in known_pooling},
        methods=layout.get("methods", {}),
        canonical_methods=load(CANONICAL)["methods"],
    )


def for_release(release: str) -> ReleaseWire:
    """A release of the window, from its committed layout file."""
    return for_layout(load(release))
