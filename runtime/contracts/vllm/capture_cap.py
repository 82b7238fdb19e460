"""The CUDA-graph capture cap a launch derives from the engine's admission step.

vLLM captures one CUDA graph per size of a token-count list and replays the
smallest that holds a step; a larger step runs eagerly, kernel by kernel.
Its default largest size is twice ``--max-num-seqs``, at most 512 (1024 on
one newer GPU platform): a step that admits a prefill chunk beside a dozen
decodes is above it and runs eagerly every time. The reference servicer
(``smg_grpc_servicer.vllm.capture_cap``) derives the cap from
``--max-num-batched-tokens`` instead, under a ceiling of 512 (the engine's
own default ceiling, so the capture cost stays what the engine would choose
at a large window), where the operator set none; this module is the same
rule, for enginelink's launches: ``serve --engine vllm``, the vLLM plugin's
``vllm serve --grpc`` and the ``vllm serve --headless`` workers of a
multi-node engine (reference request-features.md §11).

Rules:
- pure: :func:`derive_capture_cap` takes the settings and returns a
  :class:`CaptureCap`; the readers take an argv or a parsed namespace and an
  environment mapping; only :func:`log_capture_cap` has an effect (one log
  line per distinct decision and process);
- the engine's default is kept where it is the better one: the operator set
  the cap or the size list, eager mode (no graphs), speculative decoding
  (the engine's default adds sizes an explicit cap drops), or the engine's
  default already covers the step on every platform;
- the grid is the engine's (vLLM 0.32 ``VllmConfig._set_cudagraph_sizes``):
  ``[1, 2, 4] + range(8, 256, 8) + range(256, cap + 1, 16)``.

On CPU there are no CUDA graphs: the decision is visible only as the
engine's effective arguments (``--max-cudagraph-capture-size N``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("enginelink.capture_cap")

CAPTURE_CAP_ENV = "SMG_VLLM_CUDAGRAPH_CAPTURE_CAP"
AUTO = "auto"
ENGINE = "engine"
# The derivation's default ceiling: the engine's own default ceiling.
DEFAULT_CEILING = 512
ENGINE_DEFAULT_CEILING = 512
# The engine's default ceiling on one newer GPU platform, which a launch cannot
# tell apart: a derived cap must raise the 512 default and never lower this one.
ENGINE_PLATFORM_CEILING = 1024
CAP_FLAG = "--max-cudagraph-capture-size"
SIZES_FLAG = "--cudagraph-capture-sizes"


def grid_floor(size: int) -> int:
    """The largest value of the engine's capture grid at or below ``size``; 0 below 1."""
    if size < 1:
        return 0
    if size < 8:
        return 4 if size >= 4 else 2 if size >= 2 else 1
    if size < 256:
        return size - size % 8
    return size - (size - 256) % 16


def capture_sizes(cap: int) -> list[int]:
    """The engine's capture list for a cap on its grid: what a cap costs, in graphs."""
    return ([i for i in (1, 2, 4) if i <= cap] + list(range(8, min(cap + 1, 256), 8))
            + list(range(256, cap + 1, 16)))


@dataclass(frozen=True)
class CaptureCap:
    """A launch's decision: the cap it sets (None: the engine's default stays) and why."""

    cap: int | None
    # "derived", or why the engine's default stays: "engine" (the opt-out),
    # "operator", "eager", "speculative", "window" (no --max-num-seqs), "default".
    source: str
    detail: str  # the sentence logged


def ceiling_from_setting(setting: str | None) -> int | None:
    """The ceiling a knob value means: None for ``engine``, 512 for ``auto``/unset,
    an integer rounded down to the grid; ValueError (naming the knob) otherwise."""
    text = (setting or "").strip().lower()
    if text in ("", AUTO):
        return DEFAULT_CEILING
    if text == ENGINE:
        return None
    if text.isdigit() and int(text) >= 1:
        return grid_floor(int(text))
    raise ValueError(f"{CAPTURE_CAP_ENV}={setting!r}: expected {AUTO} (the default), {ENGINE} (the engine's "
                     f"own capture cap) or a positive integer (the derived cap's ceiling, {DEFAULT_CEILING} "
                     "by default)")


def _engine_default(raw: int, step: int | None) -> int:
    """Where the engine's own default ends up: the step where it fits under ``raw``
    (the engine appends it to its list), else the grid value under ``raw``."""
    if step is not None and step <= raw:
        return step
    return grid_floor(raw)


def _is_none_mode(mode: Any) -> bool:
    if mode is None:
        return False
    name = getattr(mode, "name", None)
    if name is not None:
        return str(name).upper() == "NONE"
    if isinstance(mode, int):
        return mode == 0
    return str(mode).strip().upper() == "NONE"


def derive_capture_cap(*, max_num_seqs: int | None, max_num_batched_tokens: int | None,
                       explicit_cap: int | None = None, explicit_sizes: list[int] | None = None,
                       enforce_eager: bool = False, cudagraph_mode: Any = None, speculative: bool = False,
                       setting: str | None = None) -> CaptureCap:
    """The capture cap for a launch (ValueError for a knob value it does not take)."""
    ceiling = ceiling_from_setting(setting)
    if ceiling is None:
        return CaptureCap(None, ENGINE, f"the engine's own default ({CAPTURE_CAP_ENV}={ENGINE})")
    if explicit_cap is not None or explicit_sizes:
        given = (f"max_cudagraph_capture_size={explicit_cap}" if explicit_cap is not None
                 else f"cudagraph_capture_sizes={sorted(set(explicit_sizes or []))}")
        return CaptureCap(None, "operator", f"the operator's {given} is kept")
    if enforce_eager:
        return CaptureCap(None, "eager", "no CUDA graphs (--enforce-eager)")
    if _is_none_mode(cudagraph_mode):
        return CaptureCap(None, "eager", "no CUDA graphs (cudagraph_mode NONE)")
    if speculative:
        return CaptureCap(None, "speculative", "the engine's own default under speculative decoding "
                                               "(it adds the uniform-decode sizes an explicit cap drops)")
    cap = ceiling if max_num_batched_tokens is None else min(max_num_batched_tokens, ceiling)
    step = "unset" if max_num_batched_tokens is None else str(max_num_batched_tokens)
    if max_num_seqs is None:
        # The engine's window defaults reach both default ceilings.
        low_raw, high_raw, source = ENGINE_DEFAULT_CEILING, ENGINE_PLATFORM_CEILING, "window"
    else:
        low_raw = min(2 * max_num_seqs, ENGINE_DEFAULT_CEILING)
        high_raw = min(2 * max_num_seqs, ENGINE_PLATFORM_CEILING)
        source = "default"
    low = _engine_default(low_raw, max_num_batched_tokens)
    high = _engine_default(high_raw, max_num_batched_tokens)
    default = f"{low}" if low == high else f"{low} or {high} by platform"
    why = f"--max-num-batched-tokens {step}, ceiling {ceiling}"
    if cap <= low:
        return CaptureCap(None, source, f"the engine's own default {default} covers the admission step ({why})")
    if cap < high:
        return CaptureCap(None, source, f"the engine's own default {default} is kept: a cap of {cap} ({why}) "
                                        f"could lower it where the default ceiling is {ENGINE_PLATFORM_CEILING}")
    return CaptureCap(cap, "derived", f"{cap}, derived from the admission step ({why}); the engine's own "
                                      f"default was {default}. {CAPTURE_CAP_ENV}={ENGINE} keeps the engine's "
                                      f"default, a number is another ceiling, {CAP_FLAG} sets the cap outright")


# --- readers: an engine argv (enginelink serve, the plugin) or a parsed namespace (vllm serve --headless) ---

def _positive(value: Any) -> int | None:
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None


def _normal_flag(arg: str) -> str:
    """``--max_num_seqs`` and ``--max-num-seqs`` alike (vLLM takes both); the part after a dot is a JSON key."""
    head, dot, key = arg.partition(".")
    return head.replace("_", "-") + dot + key


def _argv_values(argv: list[str]) -> dict[str, Any]:
    """The flags the derivation reads, from an engine argv: the last value of each
    (vLLM's own rule), ``--compilation-config`` as a dict (JSON or dotted keys)."""
    found: dict[str, Any] = {}
    compilation: dict[str, Any] = {}
    index = 0
    while index < len(argv):
        arg = argv[index]
        index += 1
        if not arg.startswith("-"):
            continue
        flag, has_value, value = arg.partition("=")
        flag = _normal_flag(flag)
        if flag == "-cc":
            flag = "--compilation-config"
        elif flag == "-sc":
            flag = "--speculative-config"
        if flag in ("--enforce-eager", "--no-enforce-eager"):
            found["enforce_eager"] = flag == "--enforce-eager"
            continue
        values: list[str] = [value] if has_value else []
        if not has_value:
            while index < len(argv) and not (argv[index].startswith("-") and not _is_number(argv[index])):
                values.append(argv[index])
                index += 1
                if flag != SIZES_FLAG:
                    break
        if flag.startswith("--compilation-config."):
            key = flag.split(".", 1)[1].replace("-", "_")
            compilation[key] = _json_or_text(values[0]) if values else True
        elif flag == "--compilation-config" and values:
            parsed = _json_or_text(values[0])
            if isinstance(parsed, dict):
                compilation.update(parsed)
        elif flag in ("--max-num-seqs", "--max-num-batched-tokens", CAP_FLAG, "--speculative-config") and values:
            found[flag] = values[0]
        elif flag == SIZES_FLAG and values:
            found[flag] = [size for item in values for size in item.replace(",", " ").split()]
    found["compilation"] = compilation
    return found


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def settings_from_argv(argv: list[str], environ: Mapping[str, str]) -> dict[str, Any]:
    """:func:`derive_capture_cap`'s keyword arguments, read off an engine argv."""
    found = _argv_values(argv)
    compilation = found["compilation"]
    explicit = found.get(CAP_FLAG, compilation.get("max_cudagraph_capture_size"))
    sizes = found.get(SIZES_FLAG) or compilation.get("cudagraph_capture_sizes")
    speculative = found.get("--speculative-config")
    return {
        "max_num_seqs": _positive(found.get("--max-num-seqs")),
        "max_num_batched_tokens": _positive(found.get("--max-num-batched-tokens")),
        "explicit_cap": _positive(explicit),
        "explicit_sizes": [int(s) for s in sizes] if sizes else None,
        "enforce_eager": bool(found.get("enforce_eager", False)),
        "cudagraph_mode": compilation.get("cudagraph_mode"),
        "speculative": bool(speculative) and speculative not in ("null", "{}", "None"),
        "setting": environ.get(CAPTURE_CAP_ENV),
    }


def apply_to_argv(argv: list[str], environ: Mapping[str, str]) -> tuple[list[str], CaptureCap]:
    """The engine argv with a derived cap added (``--max-cudagraph-capture-size N``), and the decision."""
    cap = derive_capture_cap(**settings_from_argv(argv, environ))
    if cap.cap is None:
        return list(argv), cap
    return [*argv, CAP_FLAG, str(cap.cap)], cap


def settings_from_namespace(parsed: Any, environ: Mapping[str, str]) -> dict[str, Any]:
    """:func:`derive_capture_cap`'s keyword arguments, read off vLLM's parsed namespace."""
    config = getattr(parsed, "compilation_config", None)
    if isinstance(config, str):
        config = _json_or_text(config)

    def field(name: str) -> Any:
        if isinstance(config, Mapping):
            return config.get(name)
        return getattr(config, name, None) if config is not None else None

    explicit = getattr(parsed, "max_cudagraph_capture_size", None)
    sizes = getattr(parsed, "cudagraph_capture_sizes", None) or field("cudagraph_capture_sizes")
    return {
        "max_num_seqs": _positive(getattr(parsed, "max_num_seqs", None)),
        "max_num_batched_tokens": _positive(getattr(parsed, "max_num_batched_tokens", None)),
        "explicit_cap": _positive(explicit if explicit is not None else field("max_cudagraph_capture_size")),
        "explicit_sizes": list(sizes) if sizes else None,
        "enforce_eager": bool(getattr(parsed, "enforce_eager", False)),
        "cudagraph_mode": field("cudagraph_mode"),
        "speculative": bool(getattr(parsed, "speculative_config", None)),
        "setting": environ.get(CAPTURE_CAP_ENV),
    }


def apply_to_namespace(parsed: Any, environ: Mapping[str, str]) -> CaptureCap:
    """Set a derived cap on vLLM's parsed namespace, where its own flag puts it."""
    cap = derive_capture_cap(**settings_from_namespace(parsed, environ))
    if cap.cap is not None:
        parsed.max_cudagraph_capture_size = cap.cap
    return cap


_logged: set[str] = set()


def log_capture_cap(cap: CaptureCap, to: logging.Logger | None = None) -> bool:
    """One INFO line per distinct decision in this process (``to``: another logger, e.g. under
    ``vllm.`` inside a vLLM process, where only vLLM's loggers have handlers); whether it was new."""
    if cap.detail in _logged:
        return False
    _logged.add(cap.detail)
    (to or logger).info("CUDA-graph capture cap: %s", cap.detail)
    return True
