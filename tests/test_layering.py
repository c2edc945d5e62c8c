"""parallel_runtime is a house of floors and every import points down (or stays on its floor): what the strategies
and the planner build on never reaches back up into what runs them. The walk is the source's AST, so a
function-local import counts like a module-level one (a lazy import is still a dependency), and relative imports
count like absolute ones. docs/layout.md describes the floors."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "parallel_runtime"

# Bottom first. A module's floor is that of the longest entry naming it or a package above it; an entry is a
# module or package under parallel_runtime ("" is the package's own __init__).
FLOORS = (
    ("errors", "spec"),  # the errors every layer raises and the job's data types
    ("sampling", "weights"),  # ComfyUI's sampling arithmetic; model files and what a rank keeps of them
    ("distributed",),  # devices, the rank layout, PipeFusion's stage split, the only torch.distributed calls
    # The attention the families' blocks call: the processor (ParaDiT's one interception point in a model) and
    # the attention it hands q/k/v to (local, Ulysses, Ring). The rest of strategies/ runs a family, so it sits
    # above models/; this sub-package sits below it.
    # Beside it, what a tensor-split block runs: the split layers' forwards and the calls joining a block's
    # collectives (strategies/tensor.py, which plans and loads the split, sits with the rest of strategies/).
    ("strategies.attention", "strategies.tensor_calls"),
    ("models",),  # the family seam, the registry and the families
    ("validate",),  # a whole job checked against the model file and the devices before any work
    ("strategies",),  # the step loop and the stock sampler's model call, under each split
    ("planning", "vae"),  # cost model, memory per rank, auto mode; the parallel VAE decode
    ("runtime",),  # client, workers, their control channel, link checks and watchdog
    ("bench", "demo", "soak", "toy", "__main__", ""),  # the commands and the demo model
)
COMFYUI = {"comfy", "comfy_api", "comfy_extras", "comfy_execution", "nodes", "server", "folder_paths", "execution"}
# The one module that may: `bench-vae` measures the parallel VAE decode against ComfyUI's own VAE modules, so it
# imports them inside its functions and re-runs itself under ComfyUI's Python. It is a command, started by name
# from __main__; no module imports it (checked below), so ComfyUI never reaches the runtime through it.
COMFYUI_BENCHMARK = f"{PACKAGE}.bench.vae_split"


def _modules() -> dict[str, str]:
    """Module name -> file, for every module of the package."""
    out = {}
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for f in (f for f in files if f.endswith(".py")):
            name = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].replace(os.sep, ".")
            out[name.removesuffix(".__init__")] = os.path.join(folder, f)
    return out


MODULES = _modules()


def _imports(name: str) -> list[tuple[int, str]]:
    """(line, imported name) for every import in module `name`, anywhere in its file, once per statement and name.
    Relative imports resolve against the module's package; "from X import y" names X.y where that is a module of
    the package, else X."""
    path = MODULES[name]
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[: len(parts) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out += [(node.lineno, f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module)
                    for a in node.names]
    return sorted(set(out))


def floor(module: str) -> int:
    rel = module.removeprefix(PACKAGE).removeprefix(".")
    best, level = -1, None
    for i, entries in enumerate(FLOORS):
        for entry in entries:
            if (entry == "" or rel == entry or rel.startswith(entry + ".")) and len(entry) > best:
                best, level = len(entry), i
    return level


def _where(module: str, line: int) -> str:
    return f"{os.path.relpath(MODULES[module], ROOT)}:{line}"


def test_the_table_names_what_exists_and_places_every_module():
    # A stale entry would place nothing; a new folder must be given its floor on purpose.
    for entries in FLOORS:
        for entry in entries:
            name = f"{PACKAGE}.{entry}" if entry else PACKAGE
            assert name in MODULES, f"FLOORS names {name}, which is no module of the package"
    assert [m for m in MODULES if floor(m) is None] == []


def test_the_walk_sees_imports_both_ways():
    # A walk that saw nothing would pass everything: module-level relative imports, a function-local one and
    # "from .. import module" must all be seen, and the table must order the floors the docs describe.
    denoise = {t for _, t in _imports(f"{PACKAGE}.strategies.denoise")}
    assert {f"{PACKAGE}.distributed.comm", f"{PACKAGE}.validate"} <= denoise
    assert f"{PACKAGE}.distributed.stages" in {t for _, t in _imports(f"{PACKAGE}.models.family")}  # in a method
    assert f"{PACKAGE}.errors" in {t for _, t in _imports(f"{PACKAGE}.runtime.client")}  # "from .. import errors"
    assert floor(f"{PACKAGE}.strategies.attention.ring") < floor(f"{PACKAGE}.models.families.flux") < floor(
        f"{PACKAGE}.strategies.denoise") < floor(f"{PACKAGE}.runtime.worker")


def test_every_import_points_down():
    upward = []
    for module in sorted(MODULES):
        for line, target in _imports(module):
            if target in MODULES and floor(target) > floor(module):
                upward.append(f"{_where(module, line)} {module} (floor {floor(module)}) imports {target} "
                              f"(floor {floor(target)})")
    assert upward == []


def test_parallel_runtime_never_imports_comfyui():
    found = [f"{_where(m, line)} imports {target}" for m in sorted(MODULES) for line, target in _imports(m)
             if target.partition(".")[0] in COMFYUI and m != COMFYUI_BENCHMARK]
    assert found == []
    assert [m for m in MODULES if COMFYUI_BENCHMARK in {t for _, t in _imports(m)}] == []
    assert any(t.startswith("comfy.") for _, t in _imports(COMFYUI_BENCHMARK))  # the exception is still needed
