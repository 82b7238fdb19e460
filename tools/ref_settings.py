"""The reference's settings, resolved at start-up: each value, where it came from, and what is refused.

``enginelink serve`` (and every launcher that hands over to it) takes the
reference servicer's flags (``tools/ref_flags.py``) and reads its variables
(``tools/knobs.py``). :func:`resolve` turns a parsed namespace and the
environment into:

- each setting's value and its source, the flag, the variable that decided,
  or the default (flag > ``ENGINELINK_*`` > the served contract's ``SMG_*`` >
  ``SMG_VLLM_*`` > default, ``knobs.names``), for the start-up line that says
  which decided;
- ``refusals``: what asks for a feature enginelink does not have (smg's Rust
  media pipeline), one line each, which ``serve`` turns into exit 2 before
  anything starts;
- ``warnings``: the variables set that cannot apply here (``knobs.environment_warnings``)
  and the flags that only the reference's Rust pipeline reads;
- ``exports``: the media values a flag decided, for the environment the
  media settings are read from (``runtime/contracts/shared/media.py``).

Pure: it reads only what it is given, so tests call it with a namespace and a dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from enginelink.tools import knobs
from enginelink.tools.ref_flags import MM_FLAGS

DEFAULT = "default"
# The media settings enginelink's own fetcher, processor and Redis sidecar client read (runtime/contracts/shared/media.py),
# and the one it only validates (turbojpeg: a bad value exits 2 there too).
SERVED_MM = ("processor", "max_inflight", "max_item_bytes", "max_items", "fetch_timeout_ms", "video_fetch_timeout_ms",
             "redis_url", "sidecar_timeout_ms", "sidecar_max_queue", "sidecar_namespace", "turbojpeg")


@dataclass(frozen=True)
class Value:
    value: Any
    source: str  # "flag" (the flag's name in ``flag``), a variable's name, or "default"
    flag: str = ""

    @property
    def label(self) -> str:
        return self.flag if self.source == "flag" else self.source


@dataclass
class Resolved:
    values: dict[str, Value] = field(default_factory=dict)  # setting -> value (knobs' setting names, mm_*)
    refusals: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    exports: dict[str, str] = field(default_factory=dict)

    def get(self, setting: str) -> Any:
        found = self.values.get(setting)
        return None if found is None else found.value

    def source(self, setting: str) -> str:
        found = self.values.get(setting)
        return DEFAULT if found is None else found.source

    def line(self) -> str:
        """The start-up line: every setting a flag or a variable decided, and which did."""
        decided = [f"{name}={value.value} ({value.label})" for name, value in self.values.items()
                   if value.source != DEFAULT]
        head = "settings (flag > ENGINELINK_* > SMG_* > default): "
        return head + (", ".join(decided) + "; the rest at their defaults" if decided else "all at their defaults")

    def media_line(self) -> str:
        """The reference's own start-up line for worker-side media processing, with its source."""
        source = self.source("mm_processor")
        word = "flag" if source == "flag" else "env" if source != DEFAULT else DEFAULT
        return f"worker-side media processing: {self.get('mm_processor') or 'off'} (source={word})"


def from_environment(names: tuple[str, ...], environ: Mapping[str, str]) -> tuple[str, str] | None:
    """The first of ``names`` set to a non-blank value, as (name, value)."""
    for name in names:
        value = environ.get(name)
        if value is not None and value.strip():
            return name, value.strip()
    return None


def env_value(setting: str, contract: str, environ: Mapping[str, str], default: Any = None) -> Value:
    """A setting with no flag: its variables in ``knobs.names`` order, else the default (text values)."""
    found = from_environment(knobs.names(setting, contract), environ)
    return Value(found[1], found[0]) if found else Value(default, DEFAULT)


def resolve(args: Any, environ: Mapping[str, str], contract: str, engine: str) -> Resolved:
    """The reference's settings for one start (see the module's docstring)."""
    out = Resolved()
    _media(args, environ, out)
    for part in ("port", "host"):
        flag = getattr(args, f"metrics_{part}", None)
        setting = f"metrics_{part}"
        out.values[setting] = (Value(flag, "flag", f"--metrics-{part}") if flag is not None
                               else env_value(setting, contract, environ))
    for setting in ("drain_s", "startup_timeout_s", "startup_ceiling_s", "silence_timeout_s",
                    "prefill_tokens_per_s", "warmup", "kv_events", "handshake_port"):
        found = env_value(setting, contract, environ)
        if found.source != DEFAULT:
            out.values[setting] = found
    out.warnings += knobs.environment_warnings(environ, contract, engine)
    return out


def _media(args: Any, environ: Mapping[str, str], out: Resolved) -> None:
    for spec in MM_FLAGS:
        flag = getattr(args, spec.dest, None)
        if flag is not None:
            value = Value(flag, "flag", spec.flag)
        else:
            raw = environ.get(spec.env)
            value = Value(raw.strip(), spec.env) if raw is not None and raw.strip() else Value(spec.default, DEFAULT)
        out.values[f"mm_{spec.setting}"] = value
        if spec.setting in SERVED_MM and value.source == "flag":
            out.exports[spec.env] = str(value.value)
        if spec.setting == "turbojpeg" and value.source == "flag":
            out.warnings.append(f"{spec.flag} is read only by smg's own Rust media pipeline (--mm-processor smg), "
                                "which enginelink does not run: ignored")
    mode = str(out.get("mm_processor") or "off").strip().lower()
    label = out.values["mm_processor"].label
    if mode == "smg":
        out.refusals.append(f"{label}=smg: smg's own media pipeline runs only inside the reference's Rust "
                            "servicer; enginelink serves --mm-processor inprocess or off")
    local = getattr(args, "allowed_local_media_path", None)
    if local is not None:
        out.values["allowed_local_media_path"] = Value(local, "flag", "--allowed-local-media-path")
        out.exports["ENGINELINK_ALLOWED_LOCAL_MEDIA_PATH"] = str(local)
    domains = getattr(args, "allowed_media_domains", None)
    if domains:
        # Enforced by the servicer's own fetcher at every redirect (machines/media_policy.py; serve's
        # _allowed_media_domains hands the list over).
        out.values["allowed_media_domains"] = Value(",".join(domains), "flag", "--allowed-media-domains")
    io_kwargs = getattr(args, "media_io_kwargs", None)
    if io_kwargs:
        # Honoured: serve hands it to the vLLM engine's arguments, from which the media processor helper builds
        # its loaders (runtime/requests/media_processor_child.py), as vLLM's own front end does.
        out.values["media_io_kwargs"] = Value(io_kwargs, "flag", "--media-io-kwargs")
