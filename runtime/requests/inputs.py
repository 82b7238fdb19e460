"""Bounds on what a client may send, and the checks that hold them (docs/limits.md, "Request input").

Rules:
- every client string or structure the servicer keeps, journals, parses or
  matches is bounded by a named ``InputLimits`` field (``ENGINELINK_MAX_*``,
  read once per process; a bad value makes ``serve`` exit 2);
- sizes are checked before anything parses or copies the input, so an
  oversized field costs one length check;
- a refusal is a ``ClientError`` naming the field and the knob, and never
  echoes the offending value (it may be megabytes);
- client ids may not take the servicer's reserved prefixes, whatever the
  link's state.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields

from enginelink.machines.link import KV_RELEASE_REQUEST_PREFIX, WARMUP_REQUEST_PREFIX
from enginelink.runtime.errors import ClientError

# Request-id prefixes the servicer gives its own requests; a client's id may not
# start with one (a client id taking the warm-up's prefix would be admitted
# during warm-up, hidden from the metrics, and collide with the warm-up's ids;
# one taking the PD release prefix could collide with a release's engine id).
RESERVED_ID_PREFIXES = (WARMUP_REQUEST_PREFIX, KV_RELEASE_REQUEST_PREFIX)


@dataclass(frozen=True)
class InputLimits:
    """Bounds on what one client may send (``ENGINELINK_MAX_*``; docs/limits.md, "Request input").

    Stop strings: OpenAI allows 4, TGI 4 by default, vLLM any number; 64
    strings of at most 1 KiB and 4 KiB together cover chat templates' stop
    sets many times over, and bound the per-call automaton (machines/stops.py)
    to ~0.5 MB and ~10 ms to build. Ids: the router sends ~40-byte uuids.
    """

    request_id_bytes: int = 256  # ENGINELINK_MAX_REQUEST_ID_BYTES
    stop_strings: int = 64  # ENGINELINK_MAX_STOP_STRINGS
    stop_string_bytes: int = 1024  # ENGINELINK_MAX_STOP_STRING_BYTES, each
    stop_bytes_total: int = 4096  # ENGINELINK_MAX_STOP_BYTES_TOTAL, all of one call's
    constraint_bytes: int = 65536  # ENGINELINK_MAX_CONSTRAINT_BYTES: json_schema, regex, grammar, structural_tag, choices
    kv_transfer_params_bytes: int = 16384  # ENGINELINK_MAX_KV_TRANSFER_PARAMS_BYTES
    json_depth: int = 64  # ENGINELINK_MAX_JSON_DEPTH: nesting of json_schema and kv_transfer_params_json
    # Lists counted by their items (issue 38): an item may cost far more than its bytes on the wire
    # (an empty choice is 2 bytes there), and each choice of n gets its own copy of a call's lists.
    # ENGINELINK_MAX_STOP_TOKEN_IDS, per call: each choice's engine request has them all, and vLLM's wire
    # sorts them into every one (n = 64 x 256: ~2 ms of encoding; x 1024 was 12 ms).
    stop_token_ids: int = 256
    logit_bias_entries: int = 1024  # ENGINELINK_MAX_LOGIT_BIAS_ENTRIES, per call (likewise)
    choices: int = 1024  # ENGINELINK_MAX_CHOICES: items of a choice constraint
    abort_ids: int = 4096  # ENGINELINK_MAX_ABORT_IDS: ids in one Abort (the in-flight cap's worth)


# The environment variable of each InputLimits field.
INPUT_LIMIT_ENV = {
    "request_id_bytes": "ENGINELINK_MAX_REQUEST_ID_BYTES",
    "stop_strings": "ENGINELINK_MAX_STOP_STRINGS",
    "stop_string_bytes": "ENGINELINK_MAX_STOP_STRING_BYTES",
    "stop_bytes_total": "ENGINELINK_MAX_STOP_BYTES_TOTAL",
    "constraint_bytes": "ENGINELINK_MAX_CONSTRAINT_BYTES",
    "kv_transfer_params_bytes": "ENGINELINK_MAX_KV_TRANSFER_PARAMS_BYTES",
    "json_depth": "ENGINELINK_MAX_JSON_DEPTH",
    "stop_token_ids": "ENGINELINK_MAX_STOP_TOKEN_IDS",
    "logit_bias_entries": "ENGINELINK_MAX_LOGIT_BIAS_ENTRIES",
    "choices": "ENGINELINK_MAX_CHOICES",
    "abort_ids": "ENGINELINK_MAX_ABORT_IDS",
}

# What one choice of a ``choice`` constraint costs beyond its UTF-8 bytes, counted against
# ENGINELINK_MAX_CONSTRAINT_BYTES: its quotes and separator in the grammar vLLM makes of the list
# (``"..." | ``, 6 bytes), rounded up to a list slot (8). An empty choice is not free (issue 38:
# 30,000,000 of them passed as 0 bytes and stalled every client for 37 s).
CHOICE_OVERHEAD_BYTES = 8


class InputKnobError(ValueError):
    """An ``ENGINELINK_MAX_*`` setting that is not a positive whole number (serve exits 2)."""


def input_limits_from(environ: Mapping[str, str]) -> InputLimits:
    values = {}
    for spec in fields(InputLimits):
        name = INPUT_LIMIT_ENV[spec.name]
        text = environ.get(name, "").strip()
        if not text:
            continue
        try:
            value = int(text)
        except ValueError:
            raise InputKnobError(f"{name}={text!r}: expected a whole number") from None
        if value < 1:
            raise InputKnobError(f"{name}={text!r}: must be at least 1")
        values[spec.name] = value
    return InputLimits(**values)


@functools.cache
def input_limits() -> InputLimits:
    """The process's limits, read from the environment once (``serve`` checks them at start-up)."""
    return input_limits_from(os.environ)


_CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def utf8_len(text: str, cap: int) -> int:
    """``len(text.encode())``, without encoding a text that is over ``cap`` by its length alone."""
    return len(text) if len(text) > cap else len(text.encode("utf-8", "surrogatepass"))


def check_request_id(name: str, request_id: str, limits: InputLimits) -> None:
    """Refuse an id the servicer will not take from a client (empty, too long, reserved, control characters)."""
    if not request_id:
        raise ClientError(name, "must not be empty")
    size = utf8_len(request_id, limits.request_id_bytes)
    if size > limits.request_id_bytes:
        raise ClientError(
            name, f"is {size} bytes; at most {limits.request_id_bytes} (ENGINELINK_MAX_REQUEST_ID_BYTES)"
        )
    for prefix in RESERVED_ID_PREFIXES:
        if request_id.startswith(prefix):
            raise ClientError(name, f"must not start with {prefix!r}: reserved for the servicer's own requests")
    control = _CONTROL_CHARACTERS.search(request_id)
    if control is not None:
        raise ClientError(name, f"must not hold control characters (U+{ord(control.group()):04X})")


def check_count(name: str, items, count_max: int, knob: str, what: str) -> int:
    """Refuse a list (or map) of more than ``count_max`` items by its length alone: before anything
    copies or walks it (a protobuf repeated field's ``len`` is free; its items are made one by one)."""
    count = len(items)
    if count > count_max:
        raise ClientError(name, f"{count} {what}; at most {count_max} ({knob})")
    return count


def check_token_ids(name: str, ids, vocab_size: int) -> list[int]:
    """The ids as a list; a ClientError naming the first one outside the vocabulary.

    Callers bound ``ids`` by count first (``check_prompt_room``, ``stop_token_ids``): the copy here
    is the first thing that costs per item.
    """
    ids = list(ids)
    if ids and max(ids) >= vocab_size:  # one pass in C; the position only for the refusal
        position, token = next((p, t) for p, t in enumerate(ids) if t >= vocab_size)
        raise ClientError(
            name, f"token id {token} at position {position} is outside the vocabulary (size {vocab_size})"
        )
    return ids


def stop_strings(stops, limits: InputLimits) -> tuple[str, ...]:
    name = "sampling_params.stop"
    if len(stops) > limits.stop_strings:
        raise ClientError(name, f"{len(stops)} stop strings; at most {limits.stop_strings} (ENGINELINK_MAX_STOP_STRINGS)")
    total = 0
    for position, stop in enumerate(stops):
        if not stop:
            raise ClientError(name, "stop strings must not be empty")
        size = utf8_len(stop, limits.stop_string_bytes)
        if size > limits.stop_string_bytes:
            raise ClientError(
                name, f"stop string {position} is {size} bytes; at most {limits.stop_string_bytes} "
                "(ENGINELINK_MAX_STOP_STRING_BYTES)",
            )
        total += size
    if total > limits.stop_bytes_total:
        raise ClientError(
            name, f"stop strings total {total} bytes; at most {limits.stop_bytes_total} (ENGINELINK_MAX_STOP_BYTES_TOTAL)"
        )
    return tuple(stops)


# What the engines' wires (msgpack) carry of a JSON number: int64 and uint64. A larger
# integer passes ``json.loads`` and then fails only when the request is encoded for the engine.
JSON_INT_MIN, JSON_INT_MAX = -(2**63), 2**64 - 1
_SURROGATE = re.compile("[\ud800-\udfff]")


def _json_depth(value) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), without recursion."""
    deepest = 0
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        depth += 1
        deepest = max(deepest, depth)
        stack.extend((child, depth) for child in node if isinstance(child, (dict, list)))
    return deepest


def _json_value_problem(value) -> str | None:
    """What in a parsed JSON value the engine's wire cannot carry, or None (strict JSON).

    ``json.loads`` takes a lone surrogate escape (``"\\ud800"``: a string that is
    not UTF-8) and integers of any size; msgpack encodes neither, so such a value
    would pass validation and fail while the request is encoded for the engine.
    Non-finite numbers (``NaN``, ``1e999``) are not JSON at all. Iterative: the
    depth is bounded separately, but a wide value must not cost a deep stack.
    """
    stack = [value]
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is str:
            if not node.isascii() and _SURROGATE.search(node):
                return "holds a lone UTF-16 surrogate escape (\\ud800-\\udfff), which is not UTF-8"
        elif kind is int:
            if not JSON_INT_MIN <= node <= JSON_INT_MAX:
                return "holds an integer outside -2^63 .. 2^64-1, which the engine's wire cannot carry"
        elif kind is float:
            if node != node or node in (float("inf"), float("-inf")):
                return "holds a number too large for a double (or NaN/Infinity), which is not JSON"
        elif kind is dict:
            stack.extend(node.keys())
            stack.extend(node.values())
        elif kind is list:
            stack.extend(node)
    return None


def _not_json_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _loads_strict(text: str):
    """``json.loads`` without Python's extensions (``NaN``, ``Infinity``)."""
    return json.loads(text, parse_constant=_not_json_constant)


def parse_json(name: str, text: str, bytes_max: int, knob: str, limits: InputLimits):
    """Parse client JSON, bounded in size (checked first) and nesting depth, strictly (``_json_value_problem``)."""
    size = utf8_len(text, bytes_max)
    if size > bytes_max:
        raise ClientError(name, f"is {size} bytes; at most {bytes_max} ({knob})")
    try:
        value = _loads_strict(text)
    except RecursionError:
        # The C parser nests on the stack: far deeper than the limit, refused all the same.
        raise ClientError(name, f"nests deeper than {limits.json_depth} levels (ENGINELINK_MAX_JSON_DEPTH)") from None
    except ValueError as error:
        raise ClientError(name, f"is not valid JSON: {error}") from None
    if _json_depth(value) > limits.json_depth:
        raise ClientError(name, f"nests deeper than {limits.json_depth} levels (ENGINELINK_MAX_JSON_DEPTH)")
    problem = _json_value_problem(value)
    if problem is not None:
        raise ClientError(name, problem)
    return value


def check_json_nesting(name: str, text: str, limits: InputLimits) -> None:
    """Refuse JSON nested past the limit or holding what no engine wire carries; text that is not
    JSON is left for the engine to judge."""
    try:
        value = _loads_strict(text)
        too_deep = _json_depth(value) > limits.json_depth
    except RecursionError:
        too_deep = True
    except ValueError:
        return
    if too_deep:
        raise ClientError(
            f"sampling_params.{name}", f"nests deeper than {limits.json_depth} levels (ENGINELINK_MAX_JSON_DEPTH)"
        )
    problem = _json_value_problem(value)
    if problem is not None:
        raise ClientError(f"sampling_params.{name}", problem)


def validate_abort_ids(request_ids, limits: InputLimits) -> list[str]:
    """The ids of an Abort call; refuses what no client call can be in flight under (a warm-up's, say).

    An empty id stays what the contract makes any unknown id: a no-op.
    """
    check_count("request_ids", request_ids, limits.abort_ids, "ENGINELINK_MAX_ABORT_IDS", "ids")
    ids = list(request_ids)
    for request_id in ids:
        if request_id:
            check_request_id("request_ids", request_id, limits)
    return ids
