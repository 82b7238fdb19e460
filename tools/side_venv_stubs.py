"""Import stand-ins for GPU-only packages, for the struct-only engine venvs.

``tools/setup-sglang`` and ``tools/setup-tokenspeed`` build venvs that exist
only to import an engine's message structs (``io_struct``) for the codec
round-trip tests and the launch-time layout check; the engines themselves
need a GPU and never run from them. Some of those modules import GPU-only
packages at module level (``tokenspeed_kernel`` raises without a CUDA, ROCm
or NPU device; PyPI's torchvision is a CUDA build). The setup scripts copy
this file into the venv's site-packages and add a ``.pth`` line that calls
``install(names)``, so those names import as inert stand-ins.

Rules: a stand-in is used only when the real package cannot be found (the
finder sits last on ``sys.meta_path``); it imports only the standard
library; every attribute of a stand-in is another stand-in that can be
called, subclassed, indexed and iterated (empty), which is all that module
level code of the struct modules does with them. It is never imported by
enginelink itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _Stub:
    """Anything: attribute, call, subscript, decorator, base class."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Stub()

    def __call__(self, *args, **kwargs):
        # Used as a decorator: hand the decorated function back unchanged.
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return _Stub()

    def __getitem__(self, key):
        return _Stub()

    def __iter__(self):
        return iter(())

    def __bool__(self) -> bool:
        return False

    def __mro_entries__(self, bases):
        return (_Stub,)

    def __or__(self, other):
        return _Stub()

    __ror__ = __or__


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Stub()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def find_spec(self, fullname, path, target=None):
        if fullname.partition(".")[0] not in self.names:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []  # a package: submodules resolve through this finder too
        return module

    def exec_module(self, module) -> None:
        pass


def install(names: list[str] | tuple[str, ...]) -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder(tuple(names)))
