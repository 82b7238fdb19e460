"""Each vLLM release's engine-core wire, as data: the layout files and their comparison.

vLLM's engine wire is msgspec structs (positional arrays and maps),
dataclasses sent as maps, enums sent as values, and utility calls sent as a
method name and positional arguments; every release may move any of them.
enginelink speaks one codec (``wire/vllm.py``) and reads what differs from
one release to the next from a layout file per release,
``wire/vllm_releases/<release>.json``, generated from that release's own
package by ``tools/vllm_layouts.py`` (the Python source read out of the
wheel with ``ast``; nothing installed) and committed.

A layout holds, for the structs, enums, utility methods and engine
arguments named in ``SPEC``: each struct's kind and msgspec options
(``array_like``, ``omit_defaults``, tag) and its fields in wire order (name,
annotation, required or the default), each enum's members, each public
method of ``EngineCoreProc`` with its parameters (a utility call's target),
the engine arguments (``--flag`` names) and the keys of the handshake's
HELLO / READY maps.

This file is also a script, run BY PATH with an engine's interpreter (it
then imports only the standard library, msgspec and vLLM, never enginelink):

    VLLM_VENV/bin/python vllm_layout.py     # one JSON line: the installed release's layout

which is the same description made by introspection (``installed``), to
check a committed file against the real package (``compare``, the suite's
check) and to describe a release outside the window at launch.

Rules:
- ``compare`` is pure and names the release, the struct and the field; an
  annotation (``type``) or a default that one side could not evaluate
  (``{"expr": ...}``) is not compared: introspection sees resolved types,
  ``ast`` sees source, and the handshake keys exist only in source;
- values are JSON: enum members by value, bytes as ``{"hex": ...}``;
- the layout files are this package's data, read when first asked for.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import enum
import functools
import hashlib
import importlib
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any, Final

# The vLLM releases enginelink supports: each has a committed layout file and docs/vllm-releases.md's notes.
WINDOW: Final = ("0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
RELEASES_DIR: Final = Path(__file__).with_name("vllm_releases")
# Bumped when the layout description changes (tools/vllm_layouts.py regenerates every file).
SCHEMA: Final = 1

# What a layout describes: the struct or enum name -> the module that defines it.
STRUCTS: Final = {
    "EngineCoreRequest": "vllm.v1.engine",
    "EngineCoreOutput": "vllm.v1.engine",
    "EngineCoreOutputs": "vllm.v1.engine",
    "EngineCoreEvent": "vllm.v1.engine",
    "UtilityOutput": "vllm.v1.engine",
    "EngineCoreReadyResponse": "vllm.v1.engine",
    "EngineZmqAddresses": "vllm.v1.engine.utils",
    "EngineHandshakeMetadata": "vllm.v1.engine.utils",
    "SamplingParams": "vllm.sampling_params",
    "StructuredOutputsParams": "vllm.sampling_params",
    "PoolingParams": "vllm.pooling_params",
    "SchedulerStats": "vllm.v1.metrics.stats",
    "PrefillStats": "vllm.v1.metrics.stats",
    "PrefixCacheStats": "vllm.v1.metrics.stats",
    "LogprobsLists": "vllm.v1.outputs",
    "LogprobsTensors": "vllm.v1.outputs",
    "KVEventBatch": "vllm.distributed.kv_events",
    "BlockStored": "vllm.distributed.kv_events",
    "BlockRemoved": "vllm.distributed.kv_events",
    "AllBlocksCleared": "vllm.distributed.kv_events",
    "KVEventsConfig": "vllm.config.kv_events",
    "StructuredOutputsConfig": "vllm.config.structured_outputs",
}
ENUMS: Final = {
    "FinishReason": "vllm.v1.engine",
    "EngineCoreRequestType": "vllm.v1.engine",
    "EngineCoreEventType": "vllm.v1.engine",
    "RequestOutputKind": "vllm.sampling_params",
}
# The class whose public methods a utility call may name (the engine process of a headless engine).
UTILITY_CLASS: Final = ("vllm.v1.engine.core", "EngineCoreProc")
# The engine arguments (``--flag-name`` for each field): what the headless launcher parses.
ENGINE_ARGS_CLASS: Final = ("vllm.engine.arg_utils", "AsyncEngineArgs")
# Where the handshake's HELLO and READY maps are built (read from source only).
HANDSHAKE_MODULE: Final = "vllm.v1.engine.core"
# Front-end code enginelink does the work of (a direct-wire servicer is the front end): a digest of
# each function's syntax tree, so a release that changes one is seen (runtime/requests/constraints.py
# says which digests its rules were written from; docs/vllm-releases.md what changed).
FUNCTIONS: Final = {
    "has_xgrammar_unsupported_json_features": "vllm.v1.structured_output.backend_xgrammar",
    "has_guidance_unsupported_json_features": "vllm.v1.structured_output.backend_guidance",
    "choice_as_grammar": "vllm.v1.structured_output.utils",
    "SamplingParams._validate_structured_outputs": "vllm.sampling_params",
    "SamplingParams.update_from_generation_config": "vllm.sampling_params",
}


class LayoutError(Exception):
    """No layout file for a release, or one that does not read (ours: a packaging fault)."""


def plain(value: Any) -> Any:
    """A value as the layout writes it: JSON, enum members by value, bytes as ``{"hex": ...}``."""
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, (bytes, bytearray)):
        return {"hex": bytes(value).hex()}
    if isinstance(value, (set, frozenset, tuple, list)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return {"expr": None}  # not a plain value (an instance, a function): not compared


def digest(function: ast.FunctionDef) -> str:
    """A function's syntax tree, hashed: the same for the same code, whatever its comments,
    docstrings or layout."""
    tree = copy.deepcopy(function)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree, annotate_fields=False).encode()).hexdigest()[:16]


def unknown(default: Any) -> bool:
    return isinstance(default, dict) and set(default) == {"expr"}


@functools.cache
def load(release: str) -> dict:
    """The committed layout of ``release`` (one of ``WINDOW``)."""
    path = RELEASES_DIR / f"{release}.json"
    try:
        return json.loads(path.read_text())
    except OSError:
        raise LayoutError(f"no layout file for vLLM {release} ({path.name}); "
                          f"the releases with one are {', '.join(WINDOW)}") from None
    except ValueError as exc:
        raise LayoutError(f"{path.name} does not read: {exc}") from None


# --------------------------------------------------------------------------
# Comparison (pure)
# --------------------------------------------------------------------------


def _fields_problems(name: str, ours: dict, theirs: dict, release: str) -> list[str]:
    problems: list[str] = []
    for key in ("kind", "array_like", "omit_defaults", "tag", "tag_field"):
        if ours.get(key) != theirs.get(key):
            problems.append(f"{name} has {key} {theirs.get(key)!r} in the installed {release}, "
                            f"{ours.get(key)!r} in its layout file")
    mine = [f["name"] for f in ours["fields"]]
    there = [f["name"] for f in theirs["fields"]]
    if mine != there:
        index = next((i for i, (a, b) in enumerate(zip(mine, there)) if a != b), min(len(mine), len(there)))
        problems.append(f"{name} field {index} is {there[index] if index < len(there) else '(none)'!r} in the "
                        f"installed {release}, {mine[index] if index < len(mine) else '(none)'!r} in its layout file "
                        f"({len(there)} and {len(mine)} fields)")
        return problems
    for a, b in zip(ours["fields"], theirs["fields"]):
        if a["required"] != b["required"]:
            problems.append(f"{name}.{a['name']} is {'required' if b['required'] else 'optional'} in the installed "
                            f"{release}, {'required' if a['required'] else 'optional'} in its layout file")
        elif not a["required"] and not (unknown(a.get("default")) or unknown(b.get("default"))) \
                and a.get("default") != b.get("default"):
            problems.append(f"{name}.{a['name']} defaults to {b.get('default')!r} in the installed {release}, "
                            f"{a.get('default')!r} in its layout file")
    return problems


def signature(params: list[dict]) -> str:
    """A method's parameters as Python writes them: ``(is_start=True, profile_prefix=None)``."""
    out = []
    for p in params:
        kind = p.get("kind", "positional")
        name = {"var_positional": "*", "var_keyword": "**"}.get(kind, "") + p["name"]
        out.append(name if p["required"] or "default" not in p else f"{name}={p['default']!r}")
    return f"({', '.join(out)})"


def _params_problems(method: str, ours: list[dict], theirs: list[dict], release: str) -> list[str]:
    def same(a: dict, b: dict) -> bool:
        if (a["name"], a.get("kind"), a["required"]) != (b["name"], b.get("kind"), b["required"]):
            return False
        if a["required"] or "default" not in a or unknown(a.get("default")) or unknown(b.get("default")):
            return True
        return a.get("default") == b.get("default")

    if len(ours) != len(theirs) or not all(same(a, b) for a, b in zip(ours, theirs)):
        return [f"utility method {method} takes {signature(theirs)} in the installed {release}, "
                f"{signature(ours)} in its layout file"]
    return []


def compare(ours: dict, theirs: dict) -> list[str]:
    """Every way ``theirs`` (an installed release, described by ``installed``) differs from
    ``ours`` (its layout file): structs, enums, utility methods, engine arguments."""
    release = f"vLLM {theirs.get('release', '?')}"
    problems: list[str] = []
    if ours.get("release") != theirs.get("release"):
        problems.append(f"the installed release is {release}; the layout file is vLLM {ours.get('release')}'s")
    for name, struct in ours["structs"].items():
        other = theirs["structs"].get(name)
        if other is None:
            problems.append(f"{name} does not exist in the installed {release}")
            continue
        problems += _fields_problems(name, struct, other, release)
    for name in sorted(set(theirs["structs"]) - set(ours["structs"])):
        problems.append(f"{name} exists in the installed {release} but not in its layout file")
    for name, members in ours["enums"].items():
        if theirs["enums"].get(name) != members:
            problems.append(f"{name} is {theirs['enums'].get(name)} in the installed {release}, {members} in its layout file")
    mine, there = ours["methods"], theirs["methods"]
    for method in sorted(set(mine) | set(there)):
        if method not in there:
            problems.append(f"utility method {method} does not exist in the installed {release}")
        elif method not in mine:
            problems.append(f"utility method {method} exists in the installed {release} but not in its layout file")
        else:
            problems += _params_problems(method, mine[method], there[method], release)
    for name, mine in ours.get("functions", {}).items():
        if theirs.get("functions", {}).get(name) != mine:
            problems.append(f"{name} in the installed {release} is not the code its layout file was read from")
    if sorted(ours["engine_args"]) != sorted(theirs["engine_args"]):
        extra = sorted(set(theirs["engine_args"]) - set(ours["engine_args"]))
        missing = sorted(set(ours["engine_args"]) - set(theirs["engine_args"]))
        problems.append(f"engine arguments differ in the installed {release}: it has {extra or 'no'} more, "
                        f"{missing or 'no'} fewer than its layout file")
    return problems


# --------------------------------------------------------------------------
# The installed release, by introspection (run inside the engine's interpreter)
# --------------------------------------------------------------------------


def _field_entry(name: str, required: bool, default: Any, annotation: Any = None) -> dict:
    entry: dict[str, Any] = {"name": name, "required": required}
    if annotation is not None:  # resolved, so not comparable with the source's spelling; the codec reads it
        entry["type"] = _type_name(annotation)
    if not required:
        entry["default"] = plain(default)
    return entry


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    if isinstance(annotation, type):
        module = annotation.__module__
        return annotation.__qualname__ if module == "builtins" else f"{module}.{annotation.__qualname__}"
    return repr(annotation).replace("typing.", "")


def describe_class(cls: type) -> dict:
    """One struct, dataclass or NamedTuple as the layout writes it (by introspection)."""
    import msgspec

    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        config = cls.__struct_config__
        fields = [_field_entry(f.encode_name, f.required,
                               None if f.required else (f.default if f.default_factory is msgspec.NODEFAULT
                                                        else f.default_factory()), f.type)
                  for f in msgspec.structs.fields(cls)]
        return {"kind": "msgspec", "array_like": config.array_like, "omit_defaults": config.omit_defaults,
                "tag": config.tag, "tag_field": config.tag_field, "fields": fields}
    if dataclasses.is_dataclass(cls):
        fields = []
        for f in dataclasses.fields(cls):
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            default = None if required else (f.default if f.default is not dataclasses.MISSING else f.default_factory())
            fields.append(_field_entry(f.name, required, default, f.type))
        return {"kind": "dataclass", "array_like": False, "omit_defaults": False, "tag": None, "tag_field": None,
                "fields": fields}
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        defaults = getattr(cls, "_field_defaults", {})
        fields = [_field_entry(n, n not in defaults, defaults.get(n)) for n in cls._fields]
        return {"kind": "namedtuple", "array_like": True, "omit_defaults": False, "tag": None, "tag_field": None,
                "fields": fields}
    raise TypeError(f"{cls!r} is not a struct, dataclass or NamedTuple")


def describe_method(function: Any) -> list[dict]:
    params = []
    for p in list(inspect.signature(function).parameters.values())[1:]:  # after self
        kind = {p.VAR_POSITIONAL: "var_positional", p.VAR_KEYWORD: "var_keyword",
                p.KEYWORD_ONLY: "keyword"}.get(p.kind, "positional")
        required = p.default is p.empty and kind in ("positional", "keyword")
        entry = {"name": p.name, "kind": kind, "required": required}
        if not required and kind in ("positional", "keyword"):
            entry["default"] = plain(p.default)
        params.append(entry)
    return params


def installed() -> dict:
    """The installed vLLM's layout (run inside the engine's interpreter; imports vLLM)."""
    import vllm

    def get(module: str, name: str) -> Any:
        return getattr(importlib.import_module(module), name)

    structs = {name: describe_class(get(module, name)) for name, module in STRUCTS.items()}
    enums = {name: {m.name: plain(m.value) for m in get(module, name)} for name, module in ENUMS.items()}
    cls = get(*UTILITY_CLASS)
    methods = {}
    for name in dir(cls):
        if name.startswith("_"):
            continue
        static = inspect.getattr_static(cls, name)
        if isinstance(static, (staticmethod, classmethod, property)) or not inspect.isfunction(static):
            continue
        methods[name] = describe_method(static)
    args = [f.name for f in dataclasses.fields(get(*ENGINE_ARGS_CLASS))]
    functions = {}
    for name, module in FUNCTIONS.items():
        owner, _, attr = name.rpartition(".")
        function = getattr(get(module, owner), attr) if owner else get(module, attr)
        functions[name] = _digest_of(function)
    return {"schema": SCHEMA, "release": vllm.__version__.split("+")[0], "structs": structs, "enums": enums,
            "methods": methods, "engine_args": args, "functions": functions}


def _digest_of(function: Any) -> str:
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(function))))
    return digest(tree.body[0])


if __name__ == "__main__":
    # Run by path, this folder is sys.path[0]: its vllm.py would shadow the real vLLM.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    print(json.dumps(installed(), sort_keys=True))
