"""The ``enginelink`` command: one subcommand per tool module.

Each tool module exposes ``add_arguments(parser)`` and ``run(args) -> int``
(the exit status). Imports are lazy so ``enginelink journal`` does not pay for
the gRPC stack, and ``enginelink --help`` stays instant.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys

# subcommand -> (module under enginelink.tools, one-line help)
SUBCOMMANDS = {
    "serve": ("serve", "run the servicer in front of an engine (default: the sim engine)"),
    "headless": ("headless", "run the servicer as an engine on the SMG router's direct ZMQ lane (--engine sglang)"),
    "sim-engine": ("sim_engine", "run the deterministic sim engine (the vLLM headless wire; --wire tokenspeed|sglang)"),
    "make-test-model": ("make_test_model", "build the tiny test model directory, offline and deterministically"),
    "bench": ("bench", "measure the servicer's overhead per token"),
    "bench-journal": ("bench_journal", "measure the hot-path cost of one journal append"),
    "inspect": ("inspect", "a servicer's state (links, requests in flight, journal), read from its journal"),
    "journal": ("journal_cmd", "post-mortem on a journal file: show, replay, verify, export, timeline"),
    "worker-probe": ("worker_probe", "liveness of a multi-node engine's worker: attached to its leader's store?"),
    "media-sidecar": ("media_sidecar", "the GPU-free media sidecar for workers under --mm-processor redis (Redis jobs)"),
}


DESCRIPTION = """\
enginelink: an SMG gRPC servicer (the smg VllmEngine contract) in front of an LLM engine
(a real vLLM, or the embedded sim engine), and its tools.

  enginelink serve [FLAGS] [-- ENGINE ARGS]   only what follows `--` goes to the engine"""
KNOBS_POINTER = "Every setting (flags and ENGINELINK_* / SMG_* environment variables) is in docs/running.md, \"Settings\"."


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="enginelink", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"`enginelink COMMAND --help` explains a command's flags.\n{KNOBS_POINTER}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = argv[0] if argv and not argv[0].startswith("-") else None
    chosen = None
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == wanted:
            module = importlib.import_module(f"enginelink.tools.{module_name}")
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
            chosen = p
    # Only what follows `--` goes to an engine (serve, bench): an unknown flag before
    # it is a typo to refuse, never an engine argument (`serve --prot 5`).
    head, engine_args = argv, None
    if "--" in argv:
        cut = argv.index("--")
        head, engine_args = argv[:cut], argv[cut + 1:]
    args, extra = parser.parse_known_args(head)
    if extra:
        refuse_unknown(chosen or parser, extra)
    if engine_args is not None:
        if getattr(args, "engine_args", None) is None:
            (chosen or parser).error(f"`--` passes arguments to an engine; {args.command} runs none: "
                                     f"{' '.join(engine_args)}")
        args.engine_args = engine_args
    return int(args._run(args) or 0)


def refuse_unknown(parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """argparse's error (usage, exit 2) for unknown arguments, with the nearest known flag.

    Python 3.11's argparse has no ``suggest_on_error``; difflib does the same.
    """
    known = [option for action in parser._actions for option in action.option_strings]
    hints = []
    for arg in extra:
        if arg.startswith("-"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], known, n=1, cutoff=0.6)
            if close:
                hints.append(f"{arg}: did you mean {close[0]}?")
    message = f"unrecognized arguments: {' '.join(extra)}"
    if hints:
        message += " (" + "; ".join(hints) + ")"
    if isinstance(parser.get_default("engine_args"), list):  # serve, bench: they launch an engine
        message += "; arguments for the engine go after `--`"
    parser.error(message)


if __name__ == "__main__":
    sys.exit(main())
