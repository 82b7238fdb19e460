"""Version coupling made safe: which vLLM release is installed, and how enginelink speaks it.

enginelink supports every vLLM release of ``wire.vllm_layout.WINDOW``
(0.28.0 to 0.34.0; docs/vllm-releases.md), each described by its committed
layout file. Before an engine is launched, ``check_installed``:

1. reads the installed release from its package (``vllm/_version.py``, no
   vLLM import): a release outside the window is refused at once, one line
   naming the release and the window (``serve`` exits 2), unless the
   operator allowed untested releases (``--allow-untested-vllm``,
   ``ENGINELINK_ALLOW_UNTESTED_VLLM``);
2. asks the engine's interpreter for the installed layout
   (``wire/vllm_layout.py`` run by path: it imports vLLM, ~5-30 s, cached per
   installation) and compares it: a release of the window with its layout
   file (a patched or relabelled build that moved a field is refused,
   naming it), a release outside with what the codec can speak
   (``wire.vllm_release.speakable``);
3. returns the release and the codec's view of it (a ``ReleaseWire``),
   which the link's codec speaks.

After the handshake, ``check_ready`` compares the ready response's
``vllm_version`` with the release that was checked.

Rules:
- the comparisons are pure (``wire/vllm_layout.py``, ``wire/vllm_release.py``)
  and are what the tests drive; this module finds the installed release;
- the installed layout is cached per interpreter and per vLLM install, keyed
  on the files that define the structs, never on time;
- test hook: ``ENGINELINK_VLLM_LAYOUT_FILE=PATH`` reads the installed layout
  from a JSON file instead of asking vLLM (a fake release, in tests).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from enginelink.machines.handshake import version_refusal
from enginelink.runtime.engine.side_venv import Incompatible, ask  # noqa: F401 - Incompatible: this module's error
from enginelink.wire import vllm_layout, vllm_release
from enginelink.wire.vllm_layout import WINDOW

log = logging.getLogger("enginelink")

LAYOUT_SCRIPT = Path(vllm_layout.__file__)
LAYOUT_FILE_ENV = "ENGINELINK_VLLM_LAYOUT_FILE"
ALLOW_UNTESTED_ENV = "ENGINELINK_ALLOW_UNTESTED_VLLM"
ALLOW_UNTESTED_FLAG = "--allow-untested-vllm"
# The releases enginelink was built and tested against: the window of layout files.
SUPPORTED_RELEASES = WINDOW
LAYOUT_TIMEOUT_S = 180.0
# Files whose contents define the structs; a change to any of them refreshes the cache.
_STRUCT_FILES = ("vllm/_version.py", "vllm/v1/engine/__init__.py", "vllm/v1/engine/core.py", "vllm/v1/engine/utils.py",
                 "vllm/sampling_params.py", "vllm/pooling_params.py", "vllm/v1/outputs.py", "vllm/v1/metrics/stats.py",
                 "vllm/distributed/kv_events.py", "vllm/engine/arg_utils.py")

# Where vLLM is and which release it says it is, without importing it (find_spec runs no package code).
_FIND_VLLM = (
    "import importlib.util as u, json, re, pathlib; s = u.find_spec('vllm'); o = s.origin if s else ''; "
    "t = pathlib.Path(o).with_name('_version.py').read_text() if o else ''; "
    "m = re.search(r'''__version__\\s*=\\s*(?:version\\s*=\\s*)?['\"]([^'\"]+)''', t); "
    "print(json.dumps({'origin': o, 'version': m.group(1) if m else ''}))"
)


def window() -> str:
    return f"{WINDOW[0]} to {WINDOW[-1]}"


def allow_untested_from_env(environ=os.environ) -> bool:
    """``ENGINELINK_ALLOW_UNTESTED_VLLM``: 1/true/yes allow, 0/false/no/empty do not."""
    value = (environ.get(ALLOW_UNTESTED_ENV) or "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise Incompatible(f"{ALLOW_UNTESTED_ENV}={environ.get(ALLOW_UNTESTED_ENV)!r}: expected 1 or 0")


def release_of(version: str) -> str:
    """``0.32.0+cpu`` -> ``0.32.0``: a local build label says nothing about the wire."""
    return version.split("+", 1)[0].strip()


def outside_window(version: str, python: str) -> str:
    return (f"vLLM {version or '(unknown)'} at {python} is outside the vLLM releases enginelink supports "
            f"({window()}); run a release of the window, or allow an untested one with {ALLOW_UNTESTED_FLAG} "
            f"({ALLOW_UNTESTED_ENV}=1), which then checks its wire layout first")


@dataclass(frozen=True)
class Checked:
    """The installed release, the codec's view of it, and a warning for an untested one."""

    version: str
    release: vllm_release.ReleaseWire
    warning: str | None = None


def check(theirs: dict, python: str, *, allow_untested: bool = False) -> Checked:
    """``theirs`` (an installed layout) against the window; raises ``Incompatible``."""
    version = release_of(str(theirs.get("release") or theirs.get("version") or ""))
    if version in WINDOW:
        problems = vllm_layout.compare(vllm_layout.load(version), theirs)
        if problems:
            raise Incompatible(
                f"the vLLM at {python} says it is vLLM {version}, but its engine structs are not vLLM {version}'s "
                f"(a patched build?): " + "; ".join(problems)
                + f". enginelink speaks each release as its layout file says (wire/vllm_releases/{version}.json)."
            )
        return Checked(version, vllm_release.for_release(version))
    if not allow_untested:
        raise Incompatible(outside_window(version, python))
    try:
        release = vllm_release.for_layout({**theirs, "release": version})
    except vllm_release.Unspeakable as problems:
        raise Incompatible(
            f"vLLM {version} at {python} is outside the releases enginelink supports ({window()}) and its engine "
            f"wire does not match enginelink's codec: {problems}"
        ) from None
    newest = vllm_layout.load(WINDOW[-1]).get("functions", {})
    changed = sorted(name for name, code in theirs.get("functions", {}).items() if newest.get(name) not in (None, code))
    return Checked(version, release, (
        f"vLLM {version} at {python} is not a release enginelink was tested with ({window()}); "
        f"{ALLOW_UNTESTED_FLAG}: its wire layout matches enginelink's codec, so it is used"
        + (f" (its front end's {', '.join(changed)} changed since {WINDOW[-1]}; enginelink does what "
           f"{WINDOW[-1]}'s does)" if changed else "")))


def check_ready(ready: dict, checked_version: str) -> str | None:
    """The cheap run-time guard: the engine that answered is the release that was checked.

    The link runs it inside the handshake machine (``machines/handshake.py``,
    from the launcher's ``checked_version``); this is the same check on a map."""
    return version_refusal("vLLM", release_of(str(ready.get("vllm_version") or "")), checked_version)


def installed_release(python: str) -> tuple[str, str]:
    """(the installed vLLM's version as its package says it, where its package is), without importing it."""
    out = _run([python, "-c", _FIND_VLLM]).strip()
    try:
        found = json.loads(out.splitlines()[-1])
    except (ValueError, IndexError):
        raise Incompatible(f"{python} could not say where vLLM is: {out[-300:]!r}") from None
    if not found.get("origin"):
        raise Incompatible(f"vLLM is not installed for {python} (run tools/setup-vllm)")
    return str(found.get("version") or ""), str(found["origin"])


def installed_layout(python: str, origin: str | None = None) -> dict:
    """The installed release's layout, from the test hook, the cache or vLLM itself."""
    fake = os.environ.get(LAYOUT_FILE_ENV)
    if fake:
        return json.loads(Path(fake).read_text())
    origin = origin or installed_release(python)[1]
    cache = (Path(platformdirs.user_cache_dir("enginelink")) / f"vllm-layouts-v{vllm_layout.SCHEMA}"
             / f"{_cache_key(python, origin)}.json")
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


def check_installed(python: str, *, allow_untested: bool = False) -> Checked:
    """The installed release, checked (``check``); raises ``Incompatible``."""
    if os.environ.get(LAYOUT_FILE_ENV):
        return check(installed_layout(python), python, allow_untested=allow_untested)
    version, origin = installed_release(python)
    if release_of(version) not in WINDOW and not allow_untested:
        raise Incompatible(outside_window(release_of(version), python))  # before any vLLM import
    return check(installed_layout(python, origin), python, allow_untested=allow_untested)


def _run(argv: list[str]) -> str:
    return ask(argv, timeout_s=LAYOUT_TIMEOUT_S, setup="tools/setup-vllm", env_prefix="ENGINELINK_VLLM",
               what="vLLM's engine structs")


def _ask_vllm(python: str) -> dict:
    out = _run([python, str(LAYOUT_SCRIPT)])
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise Incompatible(f"{python} printed no layout: {out[-300:]!r}") from None


def _cache_key(python: str, origin: str) -> str:
    site = Path(origin).parent.parent
    digest = hashlib.sha256(os.path.realpath(python).encode())
    digest.update(origin.encode())
    # What the script reads is part of the layout: a cache from an older script may lack what this one reads.
    digest.update(hashlib.sha256(LAYOUT_SCRIPT.read_bytes()).digest())
    for name in _STRUCT_FILES:
        try:
            digest.update(hashlib.sha256((site / name).read_bytes()).digest())
        except OSError:
            digest.update(b"-")
    return digest.hexdigest()[:24]
