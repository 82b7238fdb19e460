"""enginelink's SGLang general plugin: ``sglang serve --model-path M --smg-grpc-mode`` with enginelink selected.

SGLang calls every ``sglang.srt.plugins`` entry point (``SGLANG_PLUGINS``
filters them by name: this one is ``enginelink``) from ``load_plugins()``, in
its launcher before it parses the server arguments and again in every
process it spawns. :func:`register` is inert unless this process is the
launcher of a gRPC server with enginelink selected: ``--smg-grpc-mode`` (or
the deprecated ``--grpc-mode``) on its command line, and
``--servicer-impl enginelink`` there too, else ``SMG_SGLANG_SERVICER_IMPL=enginelink``
(the reference's precedence: the flag, then the variable). Then:

- the reference's flags join SGLang's server parser, as the reference's own
  plugin adds them (a hook after ``ServerArgs.add_cli_args``; ``tools/ref_flags.py``):
  ``--servicer-impl`` (``enginelink`` added to the reference's choices when
  its plugin came first), ``--metrics-port`` and ``--metrics-host``. Their
  store actions also export the values under ``SMG_SGLANG_SERVICER_*``, since
  ``ServerArgs`` keeps only its own fields (the reference's way too);
- the import of SGLang's gRPC entry point (``sglang.srt.entrypoints.grpc_server``,
  which ``run_server`` does after the parse, and which imports the reference
  package inside its ``serve_grpc``) is answered with
  :mod:`enginelink.tools.sglang_grpc_launcher` by a meta-path finder, so
  neither the reference package nor that module's own imports (aiohttp) are
  needed.

Under ``SMG_SGLANG_ATTRIBUTE_GRAMMAR_ABORTS`` (set for the scheduler ranks by
enginelink's launch) it also registers the ranks' grammar-attribution hooks
(``tools/sglang_grammar_attribution.py``), in every SGLang process.

Standard library only until selected. A selection only a ``--config`` file
carries is not seen here: the command line or the variable selects.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.util
import os
import sys

from enginelink.tools import ref_flags

SERVICER_IMPL_ENV = "SMG_SGLANG_SERVICER_IMPL"
METRICS_PORT_ENV = "SMG_SGLANG_SERVICER_METRICS_PORT"
METRICS_HOST_ENV = "SMG_SGLANG_SERVICER_METRICS_HOST"
IMPL = ref_flags.IMPL
GRPC_FLAGS = ("--smg-grpc-mode", "--grpc-mode")
LAUNCHER_MODULE = "sglang.srt.entrypoints.grpc_server"
SUBSTITUTE_MODULE = "enginelink.tools.sglang_grpc_launcher"
# SGLang's parser builder; the reference's flags join each parser after it ran.
ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"


def selection(argv: list[str], environ=os.environ) -> tuple[str | None, str]:
    """The implementation asked for and what decided: ``--servicer-impl`` on the command line (the last one,
    as argparse takes it: ``flag``), else ``SMG_SGLANG_SERVICER_IMPL`` (``env``), else none (``default``)."""
    flag = None
    for index, word in enumerate(argv):
        if word == ref_flags.SERVICER_IMPL_FLAG and index + 1 < len(argv):
            flag = argv[index + 1]
        elif word.startswith(ref_flags.SERVICER_IMPL_FLAG + "="):
            flag = word.split("=", 1)[1]
    if flag is not None:
        return flag.strip().lower(), "flag"
    value = environ.get(SERVICER_IMPL_ENV, "").strip().lower()
    return (value, "env") if value else (None, "default")


def selected(argv: list[str], environ=os.environ) -> bool:
    """This process launches SGLang's gRPC server and enginelink is the implementation asked for."""
    grpc = any(arg in GRPC_FLAGS or arg.split("=", 1)[0] in GRPC_FLAGS for arg in argv[1:])
    return grpc and selection(argv[1:], environ)[0] == IMPL


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The reference's flags on SGLang's server parser, where missing; their values exported as its do."""
    ref_flags.add_servicer_impl_argument(
        parser, env=SERVICER_IMPL_ENV, export=True,
        help=f"which servicer serves the gRPC contract under --grpc-mode; {IMPL}: enginelink's runtime in this "
             "process, the scheduler headless beside it")
    ref_flags.add_metrics_arguments(parser, port_env=METRICS_PORT_ENV, host_env=METRICS_HOST_ENV, export=True)


def after_add_cli_args(result, *args, **kwargs):
    """AFTER ``ServerArgs.add_cli_args``: the flags join the parser SGLang just filled (for ``--help`` and the
    parse); the hooked method's result is left alone."""
    for candidate in (*args, *kwargs.values()):
        if isinstance(candidate, argparse.ArgumentParser):
            add_flags(candidate)
            break
    return None


def hook_parser() -> bool:
    """The hook on SGLang's parser builder (its plugin hook registry); False on a release without one."""
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError:
        return False
    HookRegistry.register(ADD_CLI_ARGS, after_add_cli_args, HookType.AFTER)
    return True


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
    """The entry point: in every SGLang process under ``SMG_SGLANG_ATTRIBUTE_GRAMMAR_ABORTS`` (enginelink's
    launch sets it for the scheduler ranks), the grammar-attribution hooks; when selected, the reference's
    flags on SGLang's parser and the hand-over; else nothing."""
    from enginelink.tools import sglang_grammar_attribution

    if sglang_grammar_attribution.enabled(os.environ):
        sglang_grammar_attribution.register()
    if selected(sys.argv):
        hook_parser()
        take_over_launcher()
