"""Start-up hook: ``python -m vllm.entrypoints.launchers.grpc_server`` reaches enginelink when it is selected.

vLLM's stock gRPC launcher module imports the reference servicer
(``smg_grpc_servicer``) and ``grpc_reflection`` at its top, before vLLM loads
any plugin, so without the reference installed it fails before enginelink's
plugin (``tools/vllm_plugin.py``) could act. Python runs ``.pth`` lines of
site-packages at interpreter start, before ``-m`` looks its module up; the
line this module installs there calls :func:`install`, which does nothing
unless this process is ``python -m`` on one of vLLM's gRPC launcher modules
with enginelink selected (``--servicer-impl enginelink`` on its command line,
else ``SMG_VLLM_SERVICER_IMPL=enginelink``) and not left out by
``VLLM_PLUGINS``. Then a meta-path finder answers the launcher module with
enginelink's (``tools/vllm_grpc_launcher.py``, whose ``main`` parses the
stock launcher's flags and hands over); the older
``vllm.entrypoints.grpc_server`` is a shim that imports it, and gets ours.

Every interpreter of the venv reads the line, engine processes included: it
imports this module (standard library only) and compares two strings. An
uninstalled enginelink leaves a line that finds nothing and does nothing.

``tools/setup-vllm-plugin`` writes the line; by hand: ``python -m
enginelink.tools.vllm_launch_hook --install`` with the venv's interpreter
(``--uninstall`` removes it).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import sysconfig
from pathlib import Path

LAUNCHER_MODULES = ("vllm.entrypoints.launchers.grpc_server", "vllm.entrypoints.grpc_server")
TARGET = "vllm.entrypoints.launchers.grpc_server"
SERVICER_IMPL_ENV = "SMG_VLLM_SERVICER_IMPL"
IMPL = "enginelink"
PLUGIN_NAME = "enginelink"  # the vllm.general_plugins entry point's name, which VLLM_PLUGINS filters by
SUBSTITUTE = Path(__file__).resolve().with_name("vllm_grpc_launcher.py")
PTH_NAME = "enginelink-vllm-launcher.pth"
# One line, as site runs it: a missing enginelink finds no spec and does nothing.
PTH_LINE = ("import importlib.util as _u; _s = _u.find_spec('enginelink.tools.vllm_launch_hook') "
            "if _u.find_spec('enginelink') else None; _s and __import__('enginelink.tools.vllm_launch_hook', "
            "fromlist=['install']).install()\n")


def launched_module(argv: list[str]) -> str | None:
    """The module of ``python [options] -m MODULE ...``, from the interpreter's original command line."""
    words = iter(argv[1:])
    for word in words:
        if word == "-m":
            return next(words, None)
        if word.startswith("-m") and len(word) > 2:
            return word[2:]
        if word in ("-X", "-W"):  # the interpreter's options that take a value
            next(words, None)
        elif word == "-c" or not word.startswith("-"):
            return None
    return None


def selected(argv: list[str], environ=os.environ) -> bool:
    """enginelink asked for: the flag on the command line (last one wins, as argparse), else the variable."""
    flag = None
    for index, word in enumerate(argv):
        if word == "--servicer-impl" and index + 1 < len(argv):
            flag = argv[index + 1]
        elif word.startswith("--servicer-impl="):
            flag = word.split("=", 1)[1]
    value = flag if flag is not None else environ.get(SERVICER_IMPL_ENV, "")
    return value.strip().lower() == IMPL


def plugin_allowed(environ=os.environ) -> bool:
    """vLLM's ``VLLM_PLUGINS`` (a comma list; unset: all) lets enginelink's plugin load."""
    allowed = environ.get("VLLM_PLUGINS")
    return allowed is None or PLUGIN_NAME in {name.strip() for name in allowed.split(",")}


class _Finder(importlib.abc.MetaPathFinder):
    """Answers vLLM's gRPC launcher module with enginelink's, run from its file (so ``-m`` can run it)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
        return importlib.util.spec_from_file_location(fullname, SUBSTITUTE)


def install(argv: list[str] | None = None, environ=os.environ) -> bool:
    """The ``.pth`` line's call: the finder in place when this process is a selected ``python -m`` launch."""
    argv = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    if launched_module(argv) not in LAUNCHER_MODULES or not selected(argv, environ) or not plugin_allowed(environ):
        return False
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return True


def pth_path() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--install"]:
        pth_path().write_text(PTH_LINE)
        print(f"wrote {pth_path()}")
        return 0
    if args == ["--uninstall"]:
        pth_path().unlink(missing_ok=True)
        print(f"removed {pth_path()}")
        return 0
    print("usage: python -m enginelink.tools.vllm_launch_hook --install | --uninstall", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
