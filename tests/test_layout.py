"""The code's shape: layers import one way, pipeline/ has no import circles, --help loads no heavy library."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("buffer", "workers", "pipeline")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: str) -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted((ROOT / package).rglob("*.py"))}


def _imports(node: ast.AST) -> list[tuple[str, list[str]]]:
    """(module, names) of every import statement under `node`."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Import):
            out += [(a.name, []) for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            out.append((n.module, [a.name for a in n.names]))
    return out


def _project(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def import_graph(package: str) -> dict[str, set[str]]:
    """Module-level imports between the modules of `package` (`from p import m` counts as p.m when m is one)."""
    mods = _modules(package)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, tree in mods.items():
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        for stmt in top:
            for module, names in _imports(stmt):
                if module.split(".")[0] != package:
                    continue
                subs = [f"{module}.{x}" for x in names if f"{module}.{x}" in mods]
                graph[name].update(subs or [module])
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_pipeline_has_no_import_circles():
    graph = import_graph("pipeline")
    assert "pipeline.ablate.report" in graph and "pipeline.cli" in graph
    assert _cycle(graph) is None
    # the report reads a cell's files; it does not import the driver
    assert not graph["pipeline.ablate.report"] & {"pipeline.ablate.sweep", "pipeline.ablate.cell"}


def test_layers_import_one_way():
    for package, forbidden in (("buffer", ("workers", "pipeline")), ("workers", ("pipeline",))):
        for name, tree in _modules(package).items():
            bad = [m for m, _ in _imports(tree) if m.split(".")[0] in forbidden]
            assert not bad, f"{name} imports {bad}"


def test_no_private_names_of_other_modules():
    for package in PACKAGES:
        for name, tree in _modules(package).items():
            for module, names in _imports(tree):
                private = [x for x in names if x.startswith("_") and x != "__version__"]
                assert not (_project(module) and module != name and private), f"{name}: from {module} import {private}"


def test_pipeline_imports_project_modules_at_the_top():
    for name, tree in _modules("pipeline").items():
        for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            inner = [m for m, _ in _imports(fn) if _project(m)]
            assert not inner, f"{name}.{fn.name} imports {inner} inside the function"


def test_help_loads_no_heavy_library():
    code = ("import sys, pipeline.cli; print(sorted(m for m in ('torch', 'transformers', 'pyarrow', 'duckdb', "
            "'matplotlib', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
