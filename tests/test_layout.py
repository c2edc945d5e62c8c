"""The layout shows the architecture: the import graph, walked from the source (AST, function-level imports
included, since a lazy import is still a dependency), keeps the seams docs/layout.md describes."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "parallel_runtime"
MAX_FUNCTION_LINES = 80  # about a screen; longer needs its reason in the docstring


def _modules() -> dict[str, str]:
    """Module name -> file, for every module of the package."""
    out = {}
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(folder, f)
    return out


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The package's modules `name` imports anywhere in its file ("from X import y" counts X.y where that is a
    module, else X)."""
    path = MODULES[name]
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in MODULES and t != name)
    return out


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles(names: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module among `names` (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v] & names:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(names):
        if v not in index:
            visit(v)
    return found


def _under(*folders: str) -> set[str]:
    return {m for m in MODULES if any(m == f"{PACKAGE}.{f}" or m.startswith(f"{PACKAGE}.{f}.") for f in folders)}


def test_the_walk_sees_the_package():
    # A walk that finds nothing would pass everything below: the seams it checks must be there.
    assert {f"{PACKAGE}.models.family", f"{PACKAGE}.models.registry", f"{PACKAGE}.weights.mapping",
            f"{PACKAGE}.distributed.stages", f"{PACKAGE}.bench.cli"} <= set(MODULES)
    assert f"{PACKAGE}.models.families.flux_adapter" in GRAPH[f"{PACKAGE}.models.registry"]
    assert f"{PACKAGE}.weights.storage" in GRAPH[f"{PACKAGE}.weights.mapping"]


@pytest.mark.parametrize("folders", [("models", "weights"), ("models",), ("weights",), ("bench",)])
def test_no_import_circle(folders):
    assert _cycles(_under(*folders)) == []


def test_no_import_circle_in_the_whole_package():
    assert _cycles(set(MODULES)) == []


@pytest.mark.parametrize("folder", ["strategies", "runtime"])
def test_strategies_and_runtime_never_import_a_family(folder):
    families = _under("models.families")
    offenders = {m: sorted(GRAPH[m] & families) for m in _under(folder) if GRAPH[m] & families}
    assert offenders == {}


def test_only_the_registry_imports_the_families_from_outside_their_folder():
    """A new family is a module under models/families plus one line in the registry: nothing else names it
    (the bench's models and the demo model's config, which name a family's config class on purpose, aside)."""
    families = _under("models.families")
    allowed = {f"{PACKAGE}.models.registry", f"{PACKAGE}.models.tiny", f"{PACKAGE}.bench.models",
               f"{PACKAGE}.bench.projection", f"{PACKAGE}.bench.cli", f"{PACKAGE}.toy", f"{PACKAGE}.toy.train",
               f"{PACKAGE}.toy.export"}
    offenders = {m: sorted(GRAPH[m] & families) for m in set(MODULES) - families - allowed if GRAPH[m] & families}
    assert offenders == {}


def test_the_seam_and_weights_import_no_family_and_no_strategy():
    seam = {f"{PACKAGE}.models.family"} | _under("weights") | {f"{PACKAGE}.distributed.stages"}
    forbidden = _under("models.families", "strategies", "runtime")
    offenders = {m: sorted(GRAPH[m] & forbidden) for m in seam if GRAPH[m] & forbidden}
    assert offenders == {}


def test_no_function_longer_than_a_screen_without_its_reason():
    long = []
    for folder in (PACKAGE, "nodes", "scripts"):
        for base, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in (f for f in files if f.endswith(".py")):
                path = os.path.join(base, f)
                for node in ast.walk(ast.parse(open(path).read())):
                    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        continue
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES and "Long because" not in (ast.get_docstring(node) or ""):
                        long.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []
