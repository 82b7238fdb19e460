"""enginelink's vLLM general plugin: ``vllm serve MODEL --grpc --servicer-impl enginelink``.

vLLM loads every ``vllm.general_plugins`` entry point (``VLLM_PLUGINS``
filters them by name: this one is ``enginelink``) while it builds a command's
argument parser, in every vLLM process. :func:`register` wraps the parser
class's parse step, and that is all it does until a parse selects enginelink:

- on a parser that serves gRPC (``vllm serve``'s, which defines ``--grpc``,
  or the stock gRPC launcher's own when it runs as ``__main__``, which has
  ``--port`` and no ``--grpc``) it adds the reference servicer's flags where
  they are missing (``tools/ref_flags.py``): ``--servicer-impl``
  (``enginelink`` joins the choices of the reference's own flag when both
  packages are installed), ``--metrics-port``, ``--metrics-host`` and the
  ``--mm-*`` media flags; vLLM's own ``--allowed-media-domains``,
  ``--allowed-local-media-path`` and ``--media-io-kwargs`` are there already;
- a gRPC parse (``--grpc`` given, or the stock launcher's) whose
  implementation is ``enginelink`` (the flag, else ``SMG_VLLM_SERVICER_IMPL``)
  is handed over: the import of vLLM's gRPC launcher
  (``vllm.entrypoints.launchers.grpc_server``, which the CLI does right after
  the parse) is answered with :mod:`enginelink.tools.vllm_grpc_launcher`
  instead, by a meta-path finder, so the real launcher's module-level
  ``import smg_grpc_servicer`` / ``grpc_reflection`` never runs and the
  reference package need not be installed; a stock launcher already running
  as ``__main__`` (``python -m``, the reference installed) gets its
  ``serve_grpc`` rebound, as the reference's own switch does;
- a ``vllm serve --headless`` parse (the engine-only ranks of a multi-node
  engine, started with the leader's engine flags) gets the CUDA-graph capture
  cap the leader's launch derived (runtime/contracts/vllm/capture_cap.py), so every node
  captures the same sizes.

Anything else (an HTTP ``vllm serve``, ``--grpc`` with another
implementation, other commands, the engine's own processes) is left exactly
as it was. Loaded in every vLLM process: nothing but the standard library is
imported until a parse needs more.

``python -m vllm.entrypoints.launchers.grpc_server`` (and the older
``vllm.entrypoints.grpc_server``) imports the reference package at its top,
before vLLM loads any plugin: with the reference installed the parse step
above rebinds it; without it, only the start-up hook reaches it
(``tools/vllm_launch_hook.py``, a ``.pth`` line ``tools/setup-vllm-plugin``
installs), which answers the module itself before it runs.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import importlib.util
import os
import sys
from typing import Any

from enginelink.tools import ref_flags

SERVICER_IMPL_ENV = "SMG_VLLM_SERVICER_IMPL"
METRICS_PORT_ENV = "SMG_VLLM_SERVICER_METRICS_PORT"
METRICS_HOST_ENV = "SMG_VLLM_SERVICER_METRICS_HOST"
IMPL = ref_flags.IMPL
# The reference package's own values, kept as choices so the flag means the same with or without it.
REFERENCE_IMPLS = ref_flags.REFERENCE_IMPLS
# vLLM's gRPC launcher, under its 0.30+ name and the older one (a shim from 0.30 on).
LAUNCHER_MODULES = ("vllm.entrypoints.launchers.grpc_server", "vllm.entrypoints.grpc_server")
SUBSTITUTE_MODULE = "enginelink.tools.vllm_grpc_launcher"
SUBSTITUTE_FILE = os.path.join(os.path.dirname(os.path.realpath(__file__)), "vllm_grpc_launcher.py")
_MARK = "_enginelink_plugin"
# Inside a vLLM process only vLLM's logger tree has handlers (its format, its level): ours hangs there.
VLLM_LOG = "vllm.enginelink"


class Handover:
    """What the selecting parse saw: the arguments (as vLLM's parser preprocessed them), the parser, and
    what selected enginelink (``flag`` or ``env``, for the start-up line)."""

    def __init__(self, parser: Any, args: list[str], source: str = "flag") -> None:
        self.parser = parser
        self.args = args
        self.source = source


_handover: Handover | None = None


def handover() -> Handover | None:
    """The parse that selected enginelink in this process, if any."""
    return _handover


def selection(parsed: Any, environ=os.environ) -> tuple[str | None, str]:
    """The implementation a parse selects and what decided: ``--servicer-impl`` (``flag``), else
    ``SMG_VLLM_SERVICER_IMPL`` (``env``), else none (``default``: vLLM's own launcher)."""
    flag = getattr(parsed, "servicer_impl", None)
    if flag:
        return str(flag).strip().lower(), "flag"
    value = environ.get(SERVICER_IMPL_ENV, "").strip().lower()
    return (value, "env") if value else (None, "default")


def selected_impl(parsed: Any, environ=os.environ) -> str | None:
    """The implementation a parse selects: ``--servicer-impl``, else ``SMG_VLLM_SERVICER_IMPL``."""
    return selection(parsed, environ)[0]


def main_module() -> str | None:
    """The module this process runs as ``__main__`` (``python -m X``), by its spec's name."""
    return getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None)


def serves_grpc(parser: Any) -> bool:
    """A gRPC launcher's parser: ``vllm serve``'s (it defines ``--grpc``), or the stock launcher's own while
    it runs as ``__main__`` (gRPC is all it serves; its parser has the listener's ``--port``)."""
    actions = parser._option_string_actions  # argparse's registry of option strings
    return "--grpc" in actions or (main_module() in LAUNCHER_MODULES and "--port" in actions)


def add_flags(parser: Any) -> None:
    """The reference servicer's flags on a gRPC launcher's parser, where missing; ``enginelink`` a choice."""
    ref_flags.add_servicer_impl_argument(
        parser, env=SERVICER_IMPL_ENV,
        help=f"which servicer serves the gRPC contract; {IMPL}: enginelink's runtime in this process, the engine "
             "core headless beside it (unset: vLLM's own launcher with the reference servicer)")
    ref_flags.add_metrics_arguments(parser, port_env=METRICS_PORT_ENV, host_env=METRICS_HOST_ENV)
    ref_flags.add_mm_arguments(parser)


class _LauncherLoader(importlib.abc.Loader):
    """Executes enginelink's launcher under vLLM's launcher's name."""

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        ours = importlib.import_module(SUBSTITUTE_MODULE)
        module.__dict__.update({name: getattr(ours, name) for name in ours.__all__})
        module.__doc__ = ours.__doc__


class _LauncherFinder(importlib.abc.MetaPathFinder):
    """Answers the import of vLLM's gRPC launcher with enginelink's, once a parse selected it."""

    def find_spec(self, fullname, path=None, target=None):
        if _handover is None or fullname not in LAUNCHER_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, _LauncherLoader())


def take_over_launcher() -> None:
    """From now on vLLM's gRPC launcher is enginelink's: future imports through the finder, a launcher
    already imported (something imported it before the parse, or it runs as ``__main__``: the stock
    launcher with the reference installed) by rebinding its ``serve_grpc``."""
    if not any(isinstance(finder, _LauncherFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LauncherFinder())
    modules = [sys.modules.get(name) for name in LAUNCHER_MODULES]
    if main_module() in LAUNCHER_MODULES:
        modules.append(sys.modules["__main__"])
    for module in modules:
        if module is not None and os.path.realpath(getattr(module, "__file__", None) or "") != SUBSTITUTE_FILE:
            ours = importlib.import_module(SUBSTITUTE_MODULE)
            for attribute in ours.__all__:
                setattr(module, attribute, getattr(ours, attribute))


def grpc_parse(parser: Any, parsed: Any) -> bool:
    """A parse that launches gRPC: ``vllm serve --grpc``, or the stock launcher's parse."""
    return bool(getattr(parsed, "grpc", False)) or ("--grpc" not in parser._option_string_actions
                                                    and serves_grpc(parser))


def after_parse(parser: Any, args: list[str] | None, parsed: Any) -> None:
    """The plugin's work on one parse of a gRPC launcher's parser."""
    global _handover
    impl, source = selection(parsed)
    if grpc_parse(parser, parsed) and impl == IMPL:
        _handover = Handover(parser, list(sys.argv[1:] if args is None else args), source)
        take_over_launcher()
    elif getattr(parsed, "headless", False):
        from enginelink.runtime.contracts.vllm.capture_cap import apply_to_namespace, log_capture_cap

        try:
            decision = apply_to_namespace(parsed, os.environ)
        except ValueError as error:
            parser.error(str(error))
        log_in_vllm(decision)


_pending: list = []


def log_in_vllm(decision) -> None:
    """The capture-cap line through vLLM's logging. vLLM configures it after the parse
    (``configure_logging_from_args``): a line from the parse waits for that, then goes out once."""
    from enginelink.runtime.contracts.vllm.capture_cap import log_capture_cap

    if logging.getLogger("vllm").handlers:
        log_capture_cap(decision, logging.getLogger(VLLM_LOG))
        return
    try:
        import vllm.logger
    except ImportError:  # not inside vLLM (this module's own tests): our logger as it is
        log_capture_cap(decision)
        return
    _pending.append(decision)

    original = vllm.logger.configure_logging_if_needed
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def configure_logging_if_needed(*args, **kwargs):
        result = original(*args, **kwargs)
        while _pending:
            log_capture_cap(_pending.pop(0), logging.getLogger(VLLM_LOG))
        return result

    setattr(configure_logging_if_needed, _MARK, True)
    vllm.logger.configure_logging_if_needed = configure_logging_if_needed


def register() -> None:
    """The ``vllm.general_plugins`` entry point; idempotent (vLLM may load plugins more than once)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if getattr(FlexibleArgumentParser, _MARK, False):
        return
    original = FlexibleArgumentParser.parse_known_args

    @functools.wraps(original)
    def parse_known_args(self, args=None, namespace=None):
        serve = serves_grpc(self)
        if serve:
            add_flags(self)  # right before parsing: the parser is complete, --help shows them
        parsed, extras = original(self, args, namespace)
        if serve:
            after_parse(self, args, parsed)
        return parsed, extras

    FlexibleArgumentParser.parse_known_args = parse_known_args
    setattr(FlexibleArgumentParser, _MARK, True)
