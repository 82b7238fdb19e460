"""The release check for SGLang and TokenSpeed: enginelink's codec against the installed engine.

Both engines send msgspec structs as tagged positional arrays, so a release
that moves a field silently changes what every position means. Before an
engine is launched, ``check_installed`` asks the engine's own interpreter for
the layouts of the structs the codec speaks (``wire/struct_layout.py`` run by
path: field names, order, required-ness, defaults, tags) and compares them
with the codec's ``LAYOUT``; any drift is an ``Incompatible`` (the same error
the vLLM check raises, so ``enginelink serve`` exits 2 on it) naming the
release, the struct and the field. This is the vLLM check's twin
(``runtime/contracts/vllm/compat.py``), table-driven over the two engines.

Rules:
- ``compare`` (``wire/struct_layout.py``) is pure and is what the tests drive;
  this module only finds the interpreter and the installed layout;
- the installed layout is cached per interpreter and per install (importing
  the struct modules costs seconds to a minute: they import torch), keyed on
  the files that define the structs, never on time;
- test hook: ``ENGINELINK_SGLANG_LAYOUT_FILE`` / ``ENGINELINK_TOKENSPEED_LAYOUT_FILE``
  read the installed layout from a JSON file instead of asking the engine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from enginelink.runtime.engine.side_venv import Incompatible, ask, interpreter
from enginelink.wire import sglang, struct_layout, tokenspeed

log = logging.getLogger("enginelink")

LAYOUT_SCRIPT = Path(struct_layout.__file__)
LAYOUT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Engine:
    name: str  # as struct_layout.ENGINES names it
    title: str  # as people write it
    layout: dict  # the codec's
    supported: tuple[str, ...]
    setup: str  # the project script that builds its venv
    venv_dir: str  # that venv's default folder in the checkout

    @property
    def struct_files(self) -> tuple[str, ...]:
        """The site-packages files whose contents define the structs the codec speaks: every module
        ``struct_layout.ENGINES`` reads one from (a struct added there keys the cache on its file too)."""
        modules = {where.partition(":")[0] for where in struct_layout.ENGINES[self.name]["structs"].values()}
        return tuple(sorted(module.replace(".", "/") + ".py" for module in modules))

    @property
    def env(self) -> str:
        return f"ENGINELINK_{self.name.upper()}"


ENGINES = {
    "sglang": Engine("sglang", "SGLang", sglang.LAYOUT, (sglang.SGLANG_VERSION,), "tools/setup-sglang",
                     ".venv-sglang"),
    "tokenspeed": Engine("tokenspeed", "TokenSpeed", tokenspeed.LAYOUT, (tokenspeed.TOKENSPEED_VERSION,),
                         "tools/setup-tokenspeed", ".venv-tokenspeed"),
}


def default_python(engine: str) -> str:
    """The interpreter that has the engine: ``ENGINELINK_<ENGINE>_PYTHON``, then the venv
    ``ENGINELINK_<ENGINE>_VENV``, then the checkout's ``.venv-<engine>`` (its setup script)."""
    spec = ENGINES[engine]
    return interpreter(spec.env, spec.venv_dir, must_exist=False)


def check(engine: str, theirs: dict, python: str) -> str | None:
    """Raise ``Incompatible`` on drift; return a warning for an untested but matching release."""
    spec = ENGINES[engine]
    problems = struct_layout.compare(spec.layout, theirs, spec.title)
    version = theirs.get("version", "?")
    supported = ", ".join(spec.supported)
    if problems:
        raise Incompatible(
            f"the {spec.title} at {python} is {spec.title} {version}, whose wire does not match enginelink's "
            f"codec ({spec.title} {spec.layout['version']}): " + "; ".join(problems)
            + f". Supported {spec.title} releases: {supported}."
        )
    if version not in spec.supported:
        return (f"{spec.title} {version} at {python} is not a release enginelink was tested with ({supported}); "
                "its wire layout matches, so it is used")
    return None


def installed_layout(engine: str, python: str) -> dict:
    """The installed release's layouts, from the test hook, the cache or the engine itself."""
    spec = ENGINES[engine]
    fake = os.environ.get(f"{spec.env}_LAYOUT_FILE")
    if fake:
        return json.loads(Path(fake).read_text())
    cache = Path(platformdirs.user_cache_dir("enginelink")) / f"{engine}-layouts" / f"{_cache_key(spec, python)}.json"
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        pass
    log.info("checking the %s release at %s against enginelink's wire codec (imports its structs once; "
             "cached for this installation)", spec.title, python)
    out = _run(spec, [python, str(LAYOUT_SCRIPT), engine])
    try:
        layout = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise Incompatible(f"{python} printed no {spec.title} layout: {out[-300:]!r}") from None
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(layout))
    os.replace(tmp, cache)
    return layout


def check_installed(engine: str, python: str | None = None) -> tuple[str, str | None]:
    """(the installed version, a warning or None); raises ``Incompatible``."""
    python = python or default_python(engine)
    theirs = installed_layout(engine, python)
    return str(theirs.get("version", "")), check(engine, theirs, python)


def _run(spec: Engine, argv: list[str]) -> str:
    return ask(argv, timeout_s=LAYOUT_TIMEOUT_S, setup=spec.setup, env_prefix=spec.env, what=f"{spec.title}'s structs")


_FIND = "import importlib.util as u, sys; s = u.find_spec(sys.argv[1]); print(s.origin if s else '')"


def _cache_key(spec: Engine, python: str) -> str:
    origin = _run(spec, [python, "-c", _FIND, spec.name]).strip()
    if not origin:
        raise Incompatible(f"{spec.title} is not installed for {python} (run {spec.setup})")
    site = Path(origin).parent.parent
    digest = hashlib.sha256(os.path.realpath(python).encode())
    digest.update(origin.encode())
    # The script decides which structs a layout holds: a cached layout from an older script lacks the new ones.
    digest.update(hashlib.sha256(LAYOUT_SCRIPT.read_bytes()).digest())
    for name in spec.struct_files:
        try:
            digest.update(hashlib.sha256((site / name).read_bytes()).digest())
        except OSError:
            digest.update(b"-")
    return digest.hexdigest()[:24]
