"""enginelink's SGLang general plugin: ``sglang serve --model-path M --smg-grpc-mode`` with enginelink selected.

SGLang calls every ``sglang.srt.plugins`` entry point (``SGLANG_PLUGINS``
filters them by name: this one is ``enginelink``) from ``load_plugins()``, in
its launcher before it parses the server arguments and again in every
process it spawns. :func:`register` is inert unless this process is the
launcher of a gRPC server with enginelink selected: ``--smg-grpc-mode`` (or
the deprecated ``--grpc-mode``) on its command line and
``SMG_SGLANG_SERVICER_IMPL=enginelink``. Then the import of SGLang's gRPC
entry point (``sglang.srt.entrypoints.grpc_server``, which ``run_server``
does after the parse, and which imports the reference package inside its
``serve_grpc``) is answered with :mod:`enginelink.tools.sglang_grpc_launcher`
by a meta-path finder, so neither the reference package nor that module's
own imports (aiohttp) are needed. Standard library only until selected.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys

SERVICER_IMPL_ENV = "SMG_SGLANG_SERVICER_IMPL"
IMPL = "enginelink"
GRPC_FLAGS = ("--smg-grpc-mode", "--grpc-mode")
LAUNCHER_MODULE = "sglang.srt.entrypoints.grpc_server"
SUBSTITUTE_MODULE = "enginelink.tools.sglang_grpc_launcher"


def selected(argv: list[str], environ=os.environ) -> bool:
    """This process launches SGLang's gRPC server and enginelink is the implementation asked for."""
    grpc = any(arg in GRPC_FLAGS or arg.split("=", 1)[0] in GRPC_FLAGS for arg in argv[1:])
    return grpc and environ.get(SERVICER_IMPL_ENV, "").strip().lower() == IMPL


class _LauncherLoader(importlib.abc.Loader):
    """Executes enginelink's launcher under SGLang's gRPC entry point's name."""

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        ours = importlib.import_module(SUBSTITUTE_MODULE)
        module.__dict__.update({name: getattr(ours, name) for name in ours.__all__})
        module.__doc__ = ours.__doc__


class _LauncherFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != LAUNCHER_MODULE:
            return None
        return importlib.util.spec_from_loader(fullname, _LauncherLoader())


def take_over_launcher() -> None:
    """SGLang's gRPC entry point is enginelink's from now on (an already imported one is rebound)."""
    if not any(isinstance(finder, _LauncherFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LauncherFinder())
    module = sys.modules.get(LAUNCHER_MODULE)
    if module is not None:
        ours = importlib.import_module(SUBSTITUTE_MODULE)
        for name in ours.__all__:
            setattr(module, name, getattr(ours, name))


def register() -> None:
    """The entry point: hand over when selected, else nothing."""
    if selected(sys.argv):
        take_over_launcher()
