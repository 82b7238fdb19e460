"""Structured-output constraints: checked, and shaped as vLLM's own front end hands them to its engine.

Why this exists. vLLM's EngineCore does not validate or route a constraint
itself: its front end (``SamplingParams._validate_structured_outputs``) picks
the grammar backend and writes it into the private ``_backend`` key of
``StructuredOutputsParams``, and the engine builds its grammar backend from
that key (``v1/structured_output/__init__.py`` ``grammar_init``); without it
every constrained request ends ``FINISHED_ERROR`` ("Unsupported structured
output backend: None"). A direct-wire servicer is that front end, so this
module does its part:

- the backend is the engine's configured one (``--structured-outputs-config``,
  read by the engine's own argument parser and reported in its facts), else
  vLLM's default ``auto``;
- ``auto`` is resolved as vLLM resolves it: ``xgrammar``, unless the JSON
  schema uses a feature xgrammar does not enforce (``_xgrammar_unsupported``,
  vLLM's list), then ``guidance``, or ``outlines`` when guidance cannot
  either; ``_backend_was_auto`` is set as vLLM sets it. vLLM's list of
  those features grew release by release (0.28.0 to 0.32.0;
  docs/vllm-releases.md): the engine's own release decides which applies
  (``release``, the ready response's ``vllm_version``; the newest list when
  it does not say), as it decides how a ``choice`` is escaped. vLLM also falls back
  when xgrammar fails to *compile* a regex, grammar or schema; that needs
  xgrammar itself, which this venv does not have (it pulls in torch), so such
  a constraint goes to the engine as ``xgrammar`` and its compile error comes
  back as ``ConstraintFailed`` (hub);
- for xgrammar a ``choice`` becomes the EBNF grammar vLLM's front end makes
  of it (xgrammar's engine side has no choice type);
- refused here (INVALID_ARGUMENT, naming the field) is only what vLLM's front
  end refuses for every backend and what needs no grammar compiler: an empty
  choice list, a whitespace-only grammar or structural tag, ``json_object``
  false, a NUL in a regex, a JSON schema that is not JSON or not an object, a
  structural tag that is not a JSON object, JSON nested too deep, and (for an
  explicit ``xgrammar`` backend) a schema feature xgrammar ignores. A regex is
  *not* pre-checked with Python's ``re``: the dialects differ both ways
  (``(?<n>a)`` is valid for xgrammar and not for ``re``; ``a(?=b)`` the
  reverse), so ``re`` would refuse good regexes and pass bad ones.

Sans-io and pure: no engine, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from enginelink.runtime.errors import ClientError
from enginelink.runtime.requests.inputs import (
    CHOICE_OVERHEAD_BYTES, InputLimits, check_count, check_json_nesting, parse_json, utf8_len,
)

DEFAULT_BACKEND = "auto"


@dataclass(frozen=True)
class Constraint:
    """One validated constraint, ready for the engine."""

    kind: str  # the contract's oneof name: json_schema, regex, grammar, structural_tag, json_object, choice
    params: dict  # vLLM ``StructuredOutputsParams`` keys, without the private ones
    backend: str  # the resolved backend (never "auto")
    backend_was_auto: bool

    @property
    def field(self) -> str:
        return f"sampling_params.{self.kind}"


def constraint_of(sp, limits: InputLimits, configured_backend: str = DEFAULT_BACKEND,
                  release: str = "") -> Constraint | None:
    """The call's constraint (``sp``: the contract's SamplingParams), or None; ClientError if refused.
    ``release``: the vLLM release the engine runs, whose front end's rules apply (""; the newest)."""
    kind = sp.WhichOneof("constraint")
    if kind is None:
        return None
    name = f"sampling_params.{kind}"
    params = _params(kind, sp, name, limits)
    backend = configured_backend or DEFAULT_BACKEND
    was_auto = backend == "auto"
    minor = vllm_minor(release)
    if kind == "json_schema" and _xgrammar_unsupported(params["json"], minor):
        if backend == "xgrammar":
            raise ClientError(name, "uses a JSON Schema feature the engine's grammar backend (xgrammar) does not "
                                    "enforce (multipleOf, uniqueItems, contains, an unknown string format, a pattern "
                                    "or format with a length bound, allOf with several branches, …)")
        if was_auto:
            backend = "outlines" if _guidance_unsupported(params["json"]) else "guidance"
    if backend == "auto":
        backend = "xgrammar"
    if backend == "xgrammar" and kind == "choice":
        params = {"grammar": choice_as_grammar(params["choice"], minor)}
    return Constraint(kind, params, backend, was_auto)


# The newest rules: vLLM 0.32.0's, unchanged to 0.34.0 (and what an engine that names no release gets).
NEWEST_MINOR = 32


def vllm_minor(release: str) -> int:
    """``0.28.0`` -> 28: which release's front-end rules apply; another engine's or none: the newest."""
    parts = release.split(".")
    if len(parts) >= 2 and parts[0] == "0" and parts[1].isdigit():
        return min(int(parts[1]), NEWEST_MINOR)
    return NEWEST_MINOR


def _params(kind: str, sp, name: str, limits: InputLimits) -> dict:
    cap = limits.constraint_bytes
    if kind == "json_object":
        if not sp.json_object:
            raise ClientError(name, "must be true if set; leave the constraint unset for unconstrained output")
        return {"json_object": True}
    if kind == "choice":
        # Counted before they are copied, and each costs its bytes plus its place in the grammar
        # (CHOICE_OVERHEAD_BYTES): an empty choice is 2 bytes on the wire, not free (issue 38).
        count = check_count(name, sp.choice.choices, limits.choices, "ENGINELINK_MAX_CHOICES", "choices")
        if not count:
            raise ClientError(name, "needs at least one choice")
        choices = list(sp.choice.choices)
        size = CHOICE_OVERHEAD_BYTES * count
        for choice in choices:  # stops at the cap: what is encoded to be measured is at most twice the cap
            size += utf8_len(choice, cap)
            if size > cap:
                raise ClientError(name, f"choices total over {cap} bytes, {CHOICE_OVERHEAD_BYTES} a choice beyond "
                                        f"its text (ENGINELINK_MAX_CONSTRAINT_BYTES)")
        return {"choice": choices}
    value = getattr(sp, kind)
    if not value:
        raise ClientError(name, "must not be empty")
    if kind == "json_schema":
        schema = parse_json(name, value, cap, "ENGINELINK_MAX_CONSTRAINT_BYTES", limits)
        if not isinstance(schema, dict):
            raise ClientError(name, f"must be a JSON Schema object, got a JSON {type(schema).__name__}")
        return {"json": schema}
    size = utf8_len(value, cap)
    if size > cap:
        raise ClientError(name, f"is {size} bytes; at most {cap} (ENGINELINK_MAX_CONSTRAINT_BYTES)")
    if kind == "regex":
        if "\x00" in value:
            raise ClientError(name, "must not contain a NUL character")
        return {"regex": value}
    if not value.strip():
        raise ClientError(name, "must not be blank")
    if kind == "structural_tag":
        check_json_nesting("structural_tag", value, limits)
        return {"structural_tag": value}
    if kind == "grammar":
        return {"grammar": value}
    raise ClientError("sampling_params.constraint", f"unknown constraint kind {kind!r}")


def choice_as_grammar(choices: list[str], minor: int = NEWEST_MINOR) -> str:
    """vLLM's ``choice_as_grammar`` (v1/structured_output/utils.py): one EBNF alternative per choice.
    Before 0.31.0 only quotes and backslashes were escaped; since, control characters too."""
    escapes = {"\\": r"\\", '"': r"\""}
    if minor >= 31:
        escapes.update({"\n": r"\n", "\r": r"\r", "\t": r"\t"})

    def escape(ch: str) -> str:
        if ch in escapes:
            return escapes[ch]
        if minor >= 31 and (ord(ch) < 0x20 or ord(ch) == 0x7F):
            return f"\\u{ord(ch):04x}"
        return ch

    return "root ::= " + " | ".join('"' + "".join(map(escape, c)) + '"' for c in choices)


# -- vLLM's schema feature checks (backend_xgrammar.py, backend_guidance.py), release by release --

# The string formats xgrammar enforces (backend_xgrammar.py STRING_SUPPORTED_FORMATS).
_XGRAMMAR_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})


def _types(schema: dict) -> set[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    return set()


def _pattern_with_length(schema: dict) -> bool:
    return ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema)


def _xgrammar_unsupported_here(obj: dict, minor: int = NEWEST_MINOR) -> bool:
    """One schema node against ``has_xgrammar_unsupported_json_features`` of vLLM 0.<minor>."""
    if minor >= 31:
        types = _types(obj)
    else:  # before 0.31.0 only a single "type" string counted
        types = {obj["type"]} if isinstance(obj.get("type"), str) else set()
    if types & {"integer", "number"} and "multipleOf" in obj:
        return True
    if "array" in types and any(k in obj for k in ("uniqueItems", "contains", "minContains", "maxContains")):
        return True
    if "string" in types and "format" in obj and obj["format"] not in _XGRAMMAR_FORMATS:
        return True
    if minor >= 29 and "string" in types and _pattern_with_length(obj):
        return True
    all_of = obj.get("allOf")
    if minor >= 32 and isinstance(all_of, list) and len(all_of) >= 2:
        return True
    if "object" not in types:
        return False
    if minor <= 29:
        return "patternProperties" in obj or "propertyNames" in obj
    names = obj.get("propertyNames")
    if isinstance(names, dict) and _pattern_with_length(names):
        return True
    if "propertyNames" in obj:
        others = "patternProperties" in obj or "properties" in obj or obj.get("unevaluatedProperties", True) is not True
        if others or (minor <= 31 and isinstance(obj.get("additionalProperties"), dict)):
            return True
    return isinstance(obj.get("patternProperties"), dict) and ("properties" in obj or len(obj["patternProperties"]) > 1)


def _any_node(schema: Any, test) -> bool:
    """Whether ``test`` holds for any object in the schema (vLLM's recursive walk; depth already bounded)."""
    if not isinstance(schema, dict):
        return False
    if test(schema):
        return True
    for value in schema.values():
        if isinstance(value, dict) and _any_node(value, test):
            return True
        if isinstance(value, list) and any(isinstance(v, dict) and _any_node(v, test) for v in value):
            return True
    return False


def _xgrammar_unsupported(schema: dict, minor: int = NEWEST_MINOR) -> bool:
    """vLLM's ``has_xgrammar_unsupported_json_features`` (that of 0.<minor>)."""
    return _any_node(schema, lambda obj: _xgrammar_unsupported_here(obj, minor))


def _guidance_unsupported(schema: dict) -> bool:
    """vLLM's ``has_guidance_unsupported_json_features``."""
    return _any_node(schema, lambda obj: "patternProperties" in obj)
