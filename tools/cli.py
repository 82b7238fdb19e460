"""The ``enginelink`` command: one subcommand per tool module.

Each tool module exposes ``add_arguments(parser)`` and ``run(args) -> int``
(the exit status). Imports are lazy so ``enginelink journal`` does not pay for
the gRPC stack, and ``enginelink --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module under enginelink.tools, one-line help)
SUBCOMMANDS = {
    "serve": ("serve", "run the servicer in front of an engine (default: the sim engine)"),
    "sim-engine": ("sim_engine", "run the deterministic sim engine (speaks the vLLM headless wire)"),
    "make-test-model": ("test_model", "build the tiny test model directory, offline and deterministically"),
    "bench": ("bench", "measure the servicer's overhead per token"),
    "inspect": ("inspect", "a servicer's state (links, requests in flight, journal), read from its journal"),
    "journal": ("journal_cmd", "post-mortem on a journal file: show, replay, verify, export"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="enginelink", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = argv[0] if argv and not argv[0].startswith("-") else None
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            module = importlib.import_module(f"enginelink.tools.{module_name}")
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    args, extra = parser.parse_known_args(argv)
    if extra:
        # Only `serve` takes pass-through engine args, after `--`.
        if getattr(args, "engine_args", None) is not None:
            args.engine_args = [a for a in extra if a != "--"]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
