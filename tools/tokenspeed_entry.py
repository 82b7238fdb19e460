"""``ts serve``'s engine module: ``TS_SERVE_ENGINE_MODULE=enginelink.tools.tokenspeed_entry ts serve MODEL ...``.

``ts serve`` (TokenSpeed 0.1.1, ``tokenspeed/cli/_proc.py``) starts its gRPC
engine servicer as ``<its python> -m $TS_SERVE_ENGINE_MODULE --host H --port P
[engine arguments]`` (the reference's ``smg_grpc_servicer.tokenspeed`` by
default), then waits for ``grpc.health.v1`` ``""`` to say SERVING and puts its
smg gateway in front. This module takes exactly that command line and becomes
``enginelink serve --engine tokenspeed --host H --port P --model M -- [the rest]``:
the model comes out of ``--model-path`` / ``--model``; the reference
servicer's own flags (``python -m smg_grpc_servicer.tokenspeed`` takes them
ahead of TokenSpeed's) are the servicer's, never the engine's:
``--metrics-port`` / ``--metrics-host`` become ``enginelink serve``'s (else
``SMG_TOKENSPEED_SERVICER_METRICS_*``, which ts passes on in the environment),
and ``--servicer-impl`` may only say ``enginelink`` (this module is the
selection: ``python`` or ``rust`` asks for the reference's servicer, exit 2);
every other engine argument (``--tp-size``, the ``--rl-control-port`` ts
adds, ...) goes to TokenSpeed's headless engine as given.

Two interpreters are involved, on purpose: ts runs this module with the
TokenSpeed venv's python, and TokenSpeed's PyPI metadata pins forks of
``smg-grpc-proto``/``smg-grpc-servicer`` that cannot share a venv with
enginelink's own (``reference/tokenspeed.md``). So this module is the
standard library only (enginelink installed there with ``pip install --no-deps``,
or this file on its path) and ``exec``s enginelink from ``ENGINELINK_PYTHON``
(an interpreter that has enginelink and its dependencies), telling it the
TokenSpeed interpreter it was started by (``ENGINELINK_TOKENSPEED_PYTHON``,
unless already set), so the engine runs from the venv ts runs from. Without
``ENGINELINK_PYTHON`` it runs enginelink with this interpreter, for a venv
that has both. Exit status: enginelink's (2 for a refused configuration);
2 here for a command line it cannot read.
"""

from __future__ import annotations

import os
import sys

USAGE = ("usage: python -m enginelink.tools.tokenspeed_entry --host HOST --port PORT --model-path MODEL "
         "[--metrics-port P] [--metrics-host H] [ENGINE ARGS]")
# Flags this module reads off ts's command line: (flag, where enginelink takes it).
_OWN = {"--host": "--host", "--port": "--port", "--model-path": "--model", "--model": "--model",
        "--metrics-port": "--metrics-port", "--metrics-host": "--metrics-host", "--servicer-impl": "--servicer-impl"}
IMPL = "enginelink"


def translate(argv: list[str]) -> list[str]:
    """ts's engine command line → ``enginelink serve``'s arguments; ValueError when it cannot be read."""
    taken: dict[str, str] = {}
    rest: list[str] = []
    index = 0
    while index < len(argv):
        flag, has_value, value = argv[index].partition("=")
        if flag in _OWN:
            if not has_value:
                if index + 1 >= len(argv):
                    raise ValueError(f"{flag} needs a value")
                index += 1
                value = argv[index]
            taken[_OWN[flag]] = value
        else:
            rest.append(argv[index])
        index += 1
    for needed in ("--host", "--port", "--model"):
        if needed not in taken:
            raise ValueError(f"{'--model-path' if needed == '--model' else needed} is missing")
    if not taken["--port"].isdigit():
        raise ValueError(f"--port {taken['--port']!r} is not a port number")
    impl = taken.pop("--servicer-impl", IMPL).strip().lower()
    if impl != IMPL:
        raise ValueError(f"--servicer-impl {impl} asks for the reference servicer's {impl} implementation; this "
                         f"engine module is enginelink's (TS_SERVE_ENGINE_MODULE), which takes --servicer-impl {IMPL} "
                         "or none")
    serve = ["serve", "--engine", "tokenspeed", "--host", taken["--host"], "--port", taken["--port"],
             "--model", taken["--model"]]
    for flag in ("--metrics-port", "--metrics-host"):
        if flag in taken:
            serve += [flag, taken[flag]]
    # What selected enginelink, for its start-up line: this module, named by ts's TS_SERVE_ENGINE_MODULE.
    serve += ["--servicer-impl-source", "TS_SERVE_ENGINE_MODULE"]
    return serve + (["--", *rest] if rest else [])


def main(argv: list[str] | None = None) -> int:
    try:
        args = translate(list(sys.argv[1:] if argv is None else argv))
    except ValueError as error:
        print(f"enginelink (ts serve engine module): {error}\n{USAGE}", file=sys.stderr)
        return 2
    python = os.environ.get("ENGINELINK_PYTHON") or sys.executable
    env = dict(os.environ)
    env.setdefault("ENGINELINK_TOKENSPEED_PYTHON", sys.executable)  # the TokenSpeed venv ts runs from
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(python, [python, "-m", "enginelink.tools.cli", *args], env)
    return 1  # pragma: no cover - execve does not return


if __name__ == "__main__":
    sys.exit(main())
