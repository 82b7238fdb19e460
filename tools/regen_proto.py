"""Regenerate (or check) the grpclib bindings of the smg contract in ``proto/``.

Run it as ``python -m enginelink.tools.regen_proto [--check]``.

The .proto files come from the installed ``smg-grpc-proto`` package (its
``proto/`` folder), never from a copy of ours, so the bindings always match the
messages the package ships. ``grpc_tools.protoc`` runs with grpclib's plugin
and writes ``<name>_grpc.py`` for every .proto file, in sorted order.

Rules:

- The plugin writes ``import common_pb2``; we rewrite each such import of a
  contract module to ``from smg_grpc_proto.generated import common_pb2``, so the
  message classes are the package's own: one descriptor-pool registration per
  process, and grpcio clients in tests exchange the very same classes.
  ``google.protobuf`` imports stay as they are.
- Every file starts with one header line naming the smg-grpc-proto version.
- A plain run also removes ``*_grpc.py`` files whose .proto is gone.
- ``--check`` regenerates into a temporary folder and exits 1, naming each
  stale, missing or extra file, when ``proto/`` differs. Nothing is written.
- grpcio-tools is a test-only dependency: a missing one is a clear error here,
  and the base install never imports this module.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PLUGIN_NAME = "protoc-gen-grpclib_python"
PROTO_DIST = "smg-grpc-proto"
GENERATED_PACKAGE = "smg_grpc_proto.generated"
GENERATED_SUFFIX = "_grpc.py"

# `import common_pb2` (a contract module, bare); google.protobuf imports are
# dotted and never match.
_BARE_PB2_IMPORT = re.compile(r"^import (\w+_pb2)$", re.MULTILINE)


class RegenError(Exception):
    """The bindings could not be generated (tooling or package missing)."""


def proto_sources() -> list[Path]:
    """The smg-grpc-proto package's .proto files, sorted by name."""
    spec = importlib.util.find_spec("smg_grpc_proto")
    if spec is None or not spec.submodule_search_locations:
        raise RegenError(f"{PROTO_DIST} is not installed")
    proto_dir = Path(next(iter(spec.submodule_search_locations))) / "proto"
    files = sorted(proto_dir.glob("*.proto"))
    if not files:
        raise RegenError(f"no .proto files in {proto_dir}")
    return files


def bindings_dir() -> Path:
    """The folder of ``enginelink.proto`` (the repository's ``proto/``)."""
    spec = importlib.util.find_spec("enginelink.proto")
    if spec is None or not spec.submodule_search_locations:
        raise RegenError("enginelink.proto is not importable")
    return Path(next(iter(spec.submodule_search_locations)))


def _plugin_path() -> Path:
    # The console script lands next to the interpreter of the environment
    # grpclib was installed into; PATH may point at another environment.
    plugin = Path(sys.executable).parent / PLUGIN_NAME
    if not plugin.is_file():
        raise RegenError(f"{PLUGIN_NAME} not found next to {sys.executable}; install grpclib there")
    return plugin


def proto_version() -> str:
    return importlib.metadata.version(PROTO_DIST)


def header_line() -> str:
    return (
        f"# Generated from {PROTO_DIST} {proto_version()} by "
        f"enginelink.tools.regen_proto; do not edit.\n"
    )


def rewrite_imports(text: str) -> str:
    """Point bare ``import x_pb2`` lines at the package's generated modules."""
    return _BARE_PB2_IMPORT.sub(rf"from {GENERATED_PACKAGE} import \1", text)


def generate(out_dir: Path) -> list[Path]:
    """Write every ``<name>_grpc.py`` into ``out_dir``; return them, sorted."""
    if importlib.util.find_spec("grpc_tools") is None:
        raise RegenError("grpcio-tools is not installed (it is in the [test] extra)")
    sources = proto_sources()
    include = sources[0].parent
    with tempfile.TemporaryDirectory(prefix="enginelink-protoc-") as raw:
        cmd = [
            sys.executable, "-m", "grpc_tools.protoc",
            f"-I{include}",
            f"--plugin={PLUGIN_NAME}={_plugin_path()}",
            f"--grpclib_python_out={raw}",
            *(str(p) for p in sources),
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RegenError(f"protoc failed ({done.returncode}): {done.stderr.strip()}")
        header = header_line()
        written = []
        for raw_file in sorted(Path(raw).glob(f"*{GENERATED_SUFFIX}")):
            target = out_dir / raw_file.name
            text = raw_file.read_text(encoding="utf-8")
            # The plugin leaves a service-less file without a final newline.
            text = text if text.endswith("\n") else text + "\n"
            target.write_text(header + rewrite_imports(text), encoding="utf-8")
            written.append(target)
    if len(written) != len(sources):
        raise RegenError(f"protoc wrote {len(written)} bindings for {len(sources)} .proto files")
    return written


def stale_files(current_dir: Path) -> list[str]:
    """Names of bindings in ``current_dir`` that differ from a fresh build."""
    with tempfile.TemporaryDirectory(prefix="enginelink-regen-check-") as tmp:
        fresh = {p.name: p.read_bytes() for p in generate(Path(tmp))}
    have = {p.name: p.read_bytes() for p in current_dir.glob(f"*{GENERATED_SUFFIX}")}
    problems = []
    for name in sorted(fresh.keys() | have.keys()):
        if name not in have:
            problems.append(f"{name} (missing)")
        elif name not in fresh:
            problems.append(f"{name} (extra: no such .proto in {PROTO_DIST})")
        elif have[name] != fresh[name]:
            problems.append(f"{name} (out of date)")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m enginelink.tools.regen_proto",
        description="Regenerate the grpclib bindings of the smg contract in proto/.",
    )
    parser.add_argument(
        "--check", action="store_true", help="only check that proto/ is current; exit 1 if not"
    )
    args = parser.parse_args(argv)
    try:
        target = bindings_dir()
        if args.check:
            problems = stale_files(target)
            if problems:
                print(
                    f"stale gRPC bindings in {target}: {', '.join(problems)}\n"
                    f"run `python -m enginelink.tools.regen_proto` and commit the result",
                    file=sys.stderr,
                )
                return 1
            print(f"gRPC bindings in {target} are current ({PROTO_DIST} {proto_version()})")
            return 0
        written = generate(target)
        for path in written:
            print(f"wrote {path}")
        # A .proto the package no longer ships leaves no binding behind.
        for extra in sorted(set(target.glob(f"*{GENERATED_SUFFIX}")) - set(written)):
            extra.unlink()
            print(f"removed {extra}")
    except RegenError as exc:
        print(f"regen_proto: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
