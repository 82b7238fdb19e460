"""Version coupling made safe: enginelink's vLLM codec against the installed vLLM.

The data-plane structs of vLLM's engine wire are positional and belong to one
release (reference/vllm-engine-wire.md §10). Before an engine is launched,
``check_installed`` asks the engine's own interpreter for the layouts its
msgspec structs declare (``vllm_headless.py --print-layout``) and compares
them with ``wire.vllm.LAYOUT``; any drift is an ``Incompatible`` naming the
release and the field that moved, and the servicer refuses to start (exit 2).
After the handshake, ``check_ready`` compares the ready response's
``vllm_version`` with the release that was checked.

Rules:
- ``compare`` is pure (two layout dicts in, problems out) and is what the
  tests drive; the rest only finds the installed layout;
- the installed layout is cached per interpreter and per vLLM install
  (importing vLLM costs ~5-15 s), keyed on the files that define the structs,
  never on time;
- test hook: ``ENGINELINK_VLLM_LAYOUT_FILE=PATH`` reads the installed layout
  from a JSON file instead of asking vLLM (a fake release, in tests).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import platformdirs

from enginelink.machines.handshake import version_refusal
from enginelink.runtime.engine.side_venv import Incompatible, ask  # noqa: F401 - Incompatible: this module's error
from enginelink.wire.vllm import LAYOUT

log = logging.getLogger("enginelink")

HEADLESS_SCRIPT = Path(__file__).with_name("vllm_headless.py")
LAYOUT_FILE_ENV = "ENGINELINK_VLLM_LAYOUT_FILE"
# Releases whose layouts this codec was built and tested against.
SUPPORTED_RELEASES = ("0.32.0",)
LAYOUT_TIMEOUT_S = 180.0
# Files whose contents define the structs; a change to any of them refreshes the cache.
_STRUCT_FILES = ("vllm/_version.py", "vllm/v1/engine/__init__.py", "vllm/sampling_params.py",
                 "vllm/pooling_params.py")

_FIND_VLLM = "import importlib.util as u, sys; s = u.find_spec('vllm'); print(s.origin if s else '')"


def compare(ours: dict, theirs: dict) -> list[str]:
    """Every way ``theirs`` (the installed release) breaks ``ours`` (our codec)."""
    problems: list[str] = []
    release = f"vLLM {theirs.get('version', '?')}"
    sent, installed = ours["request"], theirs["request"]
    for index, name in enumerate(sent):
        if index >= len(installed):
            problems.append(
                f"EngineCoreRequest has {len(installed)} fields in {release}; enginelink sends "
                f"{len(sent)} (field {index} {name!r} does not exist there)"
            )
            break
        if installed[index] != name:
            problems.append(
                f"EngineCoreRequest field {index} is {installed[index]!r} in {release}, "
                f"{name!r} in enginelink's codec"
            )
    required = int(theirs.get("request_required", 0))
    if required > len(sent):
        problems.append(
            f"EngineCoreRequest needs {required} fields in {release}; enginelink sends {len(sent)}"
        )
    for struct, key in (("EngineCoreOutputs", "outputs"), ("EngineCoreOutput", "output")):
        for index, (mine, other) in enumerate(zip(ours[key], theirs[key])):
            if mine != other:
                problems.append(
                    f"{struct} field {index} is {other!r} in {release}, {mine!r} in enginelink's codec"
                )
    # PoolingParams is positional (Embed): a moved field would silently change its meaning.
    # Layouts printed before Embed was served lack the key; nothing to compare then.
    for index, (mine, other) in enumerate(zip(ours.get("pooling", ()), theirs.get("pooling", ours.get("pooling", ())))):
        if mine != other:
            problems.append(f"PoolingParams field {index} is {other!r} in {release}, {mine!r} in enginelink's codec")
    known = set(theirs["sampling_keys"])
    for name in ours["sampling_keys"]:
        if name not in known:
            problems.append(f"SamplingParams has no key {name!r} in {release}; enginelink sends it")
    mine_reasons, other_reasons = ours["finish_reasons"], theirs["finish_reasons"]
    for name, value in other_reasons.items():
        if mine_reasons.get(name) != value:
            problems.append(
                f"FinishReason {name} is {value} in {release}, "
                f"{mine_reasons.get(name, 'unknown')} in enginelink's codec"
            )
    return problems


def check(theirs: dict, python: str) -> str | None:
    """Raise ``Incompatible`` on drift; return a warning for an untested but matching release."""
    problems = compare(LAYOUT, theirs)
    version = theirs.get("version", "?")
    if problems:
        raise Incompatible(
            f"the vLLM at {python} is vLLM {version}, whose engine wire does not match enginelink's "
            f"codec (vLLM {LAYOUT['version']}): " + "; ".join(problems)
            + f". Supported vLLM releases: {', '.join(SUPPORTED_RELEASES)}."
        )
    if version not in SUPPORTED_RELEASES:
        return (
            f"vLLM {version} at {python} is not a release enginelink was tested with "
            f"({', '.join(SUPPORTED_RELEASES)}); its wire layout matches, so it is used"
        )
    return None


def check_ready(ready: dict, checked_version: str) -> str | None:
    """The cheap run-time guard: the engine that answered is the release that was checked.

    The link runs it inside the handshake machine (``machines/handshake.py``,
    from the launcher's ``checked_version``); this is the same check on a map."""
    return version_refusal("vLLM", str(ready.get("vllm_version") or ""), checked_version)


def installed_layout(python: str) -> dict:
    """The installed release's layouts, from the test hook, the cache or vLLM itself."""
    fake = os.environ.get(LAYOUT_FILE_ENV)
    if fake:
        return json.loads(Path(fake).read_text())
    key = _cache_key(python)
    cache = Path(platformdirs.user_cache_dir("enginelink")) / "vllm-layouts" / f"{key}.json"
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        pass
    # Importing vLLM takes seconds (~14 s on 2 cores): say so, or the start looks hung.
    log.info("checking the vLLM release at %s against enginelink's wire codec (imports vLLM once; "
             "cached for this installation)", python)
    layout = _ask_vllm(python)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(layout))
    os.replace(tmp, cache)
    return layout


def check_installed(python: str) -> tuple[str, str | None]:
    """(the installed vLLM version, a warning or None); raises ``Incompatible``."""
    theirs = installed_layout(python)
    return str(theirs.get("version", "")), check(theirs, python)


def _run(argv: list[str]) -> str:
    return ask(argv, timeout_s=LAYOUT_TIMEOUT_S, setup="tools/setup-vllm", env_prefix="ENGINELINK_VLLM",
               what="vLLM's engine structs")


def _ask_vllm(python: str) -> dict:
    out = _run([python, str(HEADLESS_SCRIPT), "--print-layout"])
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise Incompatible(f"{python} printed no layout: {out[-300:]!r}") from None


def _cache_key(python: str) -> str:
    origin = _run([python, "-c", _FIND_VLLM]).strip()
    if not origin:
        raise Incompatible(f"vLLM is not installed for {python} (run tools/setup-vllm)")
    site = Path(origin).parent.parent
    digest = hashlib.sha256(os.path.realpath(python).encode())
    digest.update(origin.encode())
    for name in _STRUCT_FILES:
        try:
            digest.update(hashlib.sha256((site / name).read_bytes()).digest())
        except OSError:
            digest.update(b"-")
    return digest.hexdigest()[:24]
