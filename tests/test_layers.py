"""The layers of DESIGN.md, checked by ``lint-imports`` (import-linter).

The contracts live in ``pyproject.toml`` (``[tool.importlinter]``): imports
point down tools -> runtime -> machines -> journal -> wire, proto beside wire;
only runtime and tools import proto; machines and wire stay sans-io; inside
runtime, lifetime -> contracts -> rpc -> kv -> context -> requests -> engine;
only the contract wings import a contract's messages, and no wing another;
the bench's modules form a chain. These tests run the tool from the venv exactly as a
developer would, and check that it really looks at our code: a contract
that lists every folder, and a reversed one that must break. No module of
the product imports itself back down a chain, and each wing imports its own
contract's messages only: checked on the graph import-linter builds
(grimp's), with the same roots.
"""

from __future__ import annotations

import ast
import re
import subprocess
import tomllib
from pathlib import Path

import grimp
import pytest

from tests.harness import VENV_BIN

ROOT = Path(__file__).resolve().parent.parent
# DESIGN.md's list, top to bottom.
DESIGN_LAYERS = ["tools", "runtime", "machines", "journal", "wire | proto"]
# DESIGN.md's "Inside runtime/", top to bottom (the three shared leaf modules under them all).
RUNTIME_LAYERS = ["lifetime", "contracts", "rpc", "kv", "context", "requests", "engine", "errors | env_flags | peers"]
# Each wing's own contract's messages (smg-grpc-proto's module); common.proto's (common_pb2) any wing may use.
WING_MESSAGES = {"vllm": "vllm_engine_pb2", "sglang": "sglang_scheduler_pb2", "tokenspeed": "tokenspeed_scheduler_pb2",
                 "mlx": "mlx_engine_pb2", "shared": None}


def _lint_imports(*args: str) -> subprocess.CompletedProcess:
    tool = VENV_BIN / "lint-imports"
    assert tool.exists(), f"{tool} is missing: import-linter is in the test extra (tools/setup-env --test)"
    # --no-cache: never a stale answer, and nothing written into the tree.
    return subprocess.run([str(tool), "--no-cache", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.process
def test_lint_imports_keeps_every_contract():
    result = _lint_imports()
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"lint-imports found imports against the layers:\n{output}"
    contracts = _config()["tool"]["importlinter"]["contracts"]
    assert f"Contracts: {len(contracts)} kept, 0 broken." in output, output
    # It read our modules, not an empty graph: at least every .py file of the six folders.
    ours = sum(1 for folder in ("proto", "wire", "journal", "machines", "runtime", "tools")
               for _ in (ROOT / folder).rglob("*.py"))
    analyzed = int(re.search(r"Analyzed (\d+) files", output).group(1))
    assert analyzed >= ours, output


def test_layers_contract_is_designs_list_and_covers_every_package():
    config = _config()
    roots = config["tool"]["importlinter"]["root_packages"]
    packages = config["tool"]["setuptools"]["packages"]
    # A new folder cannot slip past the layering: every installed top-level
    # package is a root, and every subpackage sits under one.
    assert sorted(roots) == sorted(p for p in packages if p.count(".") == 1)
    assert all(".".join(p.split(".")[:2]) in roots for p in packages if p.count(".") > 1)
    (layers,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["id"] == "layers"]
    assert layers["type"] == "layers"
    assert [layer.replace("enginelink.", "") for layer in layers["layers"]] == DESIGN_LAYERS
    assert not layers.get("ignore_imports"), "an escape from the layers needs its own contract and reason"


def test_runtime_layers_cover_every_subpackage_and_module():
    """A new folder or module in runtime/ cannot sit outside the order: the contract names each one."""
    (layers,) = [c for c in _config()["tool"]["importlinter"]["contracts"] if c["id"] == "runtime-layers"]
    assert layers["layers"] == RUNTIME_LAYERS and layers["containers"] == ["enginelink.runtime"]
    named = {name.strip() for layer in RUNTIME_LAYERS for name in layer.split("|")}
    present = {path.stem if path.is_file() else path.name for path in (ROOT / "runtime").iterdir()
               if (path.suffix == ".py" and path.stem != "__init__") or (path / "__init__.py").is_file()}
    assert present == named
    wings = {path.name for path in (ROOT / "runtime" / "contracts").iterdir() if (path / "__init__.py").is_file()}
    assert wings == set(WING_MESSAGES)


def test_the_docs_count_the_contracts():
    contracts = _config()["tool"]["importlinter"]["contracts"]
    assert f"holds {len(contracts)} import-linter contracts" in (ROOT / "docs" / "architecture.md").read_text()


@pytest.mark.process
def test_an_upward_import_is_reported(tmp_path):
    """The same tool, told the layers the other way round, names a real import that breaks them."""
    config = tmp_path / "reversed.toml"
    config.write_text(
        "[tool.importlinter]\n"
        f"root_packages = {_config()['tool']['importlinter']['root_packages']!r}\n"
        "[[tool.importlinter.contracts]]\n"
        'name = "reversed"\n'
        'type = "layers"\n'
        'layers = ["enginelink.wire", "enginelink.runtime"]\n'
    )
    result = _lint_imports("--config", str(config))
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert re.search(r"enginelink\.runtime\.[\w.]+ -> enginelink\.wire\.\w+", output), output
    assert "Contracts: 0 kept, 1 broken." in output, output


def test_architecture_names_every_contract():
    """docs/architecture.md, "Layers", says what each contract holds: one bold name per contract id, none stale."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    ids = {c["id"] for c in _config()["tool"]["importlinter"]["contracts"]}
    named = set(re.findall(r"\*\*([a-z-]+)\*\*: ", text.split("## The hot path")[0]))
    assert ids == named, f"contracts in pyproject.toml: {sorted(ids)}; named in docs/architecture.md: {sorted(named)}"


def test_the_product_has_no_import_cycle():
    """A cycle makes import order matter and hides a layer inside a folder: none, anywhere in the product."""
    roots = _config()["tool"]["importlinter"]["root_packages"]
    graph = grimp.build_graph(*roots, cache_dir=None)
    ours = [module for module in graph.modules if module.startswith("enginelink.")]
    assert len(ours) >= sum(1 for folder in ("proto", "wire", "journal", "machines", "runtime", "tools")
                            for _ in (ROOT / folder).rglob("*.py")) - 1  # it read our modules (the namespace has no file)
    cycles: dict[frozenset, str] = {}
    for importer in sorted(ours):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back:  # importer -> imported -> ... -> importer
                cycles.setdefault(frozenset(back), " -> ".join((importer, *back)))
    assert not cycles, "import cycles:\n" + "\n".join(sorted(cycles.values()))


def test_each_wing_imports_its_own_contracts_messages_only():
    """import-linter sees smg-grpc-proto as one package; which of its modules a wing imports is read here."""
    roots = _config()["tool"]["importlinter"]["root_packages"]
    graph = grimp.build_graph(*roots, include_external_packages=True, cache_dir=None)
    wrong, used = [], {wing: set() for wing in WING_MESSAGES}
    for wing, own in WING_MESSAGES.items():
        package = f"enginelink.runtime.contracts.{wing}"
        for module in sorted(graph.find_descendants(package)):
            for detail in graph.get_import_details(importer=module, imported="smg_grpc_proto"):
                names = set(re.findall(r"\b\w+_pb2\b", detail["line_contents"]))
                where = f"{module} l.{detail['line_number']}: {detail['line_contents']}"
                if not names:
                    wrong.append(f"{where} (name the _pb2 modules on the import's line)")
                wrong += [f"{where} ({name} is not {wing}'s)" for name in sorted(names - {own, "common_pb2"})]
                used[wing] |= names
    assert not wrong, "\n".join(wrong)
    assert all(own in used[wing] for wing, own in WING_MESSAGES.items() if own), used  # it read the wings


def _module_file(root: Path, module: str) -> Path | None:
    """``enginelink.a.b`` -> ``a/b.py`` or ``a/b/__init__.py`` in the checkout (the package's layout)."""
    parts = module.split(".")[1:]
    if not parts:
        return None
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _top_level_names(path: Path) -> set[str]:
    """What a module defines or imports at its top level (a name ``from module import name`` can take)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try)):  # names bound under a top-level if/try count too
            for inner in ast.walk(node):
                if isinstance(inner, (ast.FunctionDef, ast.ClassDef)):
                    names.add(inner.name)
                elif isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
                    names.add(inner.id)
                elif isinstance(inner, (ast.Import, ast.ImportFrom)):
                    names.update((a.asname or a.name).split(".")[0] for a in inner.names)
    return names


def test_every_enginelink_import_in_the_product_resolves_even_inside_a_function():
    """An import inside a function runs only when its path does: after a module moved, ``enginelink
    media-sidecar`` died at start with ImportError (``default_vllm_python`` had moved to the vLLM wing)
    and nothing but a run of that command said so. Every ``from enginelink... import name`` in the
    product, at any depth, names a module that exists and a name it defines or a submodule (read from
    the source, nothing imported)."""
    root = Path(__file__).parents[1]
    problems = []
    for folder in ("machines", "journal", "wire", "runtime", "tools", "proto"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                        and node.module.split(".")[0] == "enginelink"):
                    continue
                where = f"{path.relative_to(root)}:{node.lineno}"
                target = _module_file(root, node.module)
                if target is None:
                    problems.append(f"{where}: no module {node.module}")
                    continue
                defined = _top_level_names(target)
                for alias in node.names:
                    if alias.name != "*" and alias.name not in defined and \
                            _module_file(root, f"{node.module}.{alias.name}") is None:
                        problems.append(f"{where}: {node.module} has no {alias.name}")
    assert not problems, "\n".join(problems)


def test_the_engine_link_stays_a_link():
    """Issue 35: ``EngineLink`` was a 596-line class mixing the transport and the supervision; the
    transports, the supervision, the restarts and the process now live beside it, and the link is what
    ties them. A link that grows past 450 lines again is taking their work back: move it out instead."""
    lines = (Path(__file__).parents[1] / "runtime" / "engine" / "engine_link.py").read_text().count("\n")
    assert lines <= 450, f"runtime/engine/engine_link.py is {lines} lines"
