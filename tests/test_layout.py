"""The package's import graph, read from the source: no cycle, the folders in one order (what a kind is made of below
kinds/, the jobs above it), no specdrafter import hidden inside a function, and nothing of benchmarks/ (the benchmark
and conformance scripts, outside the installed package: they import it, never the other way round)."""

import ast
import subprocess
import sys
from pathlib import Path

from conftest import REPO

FOLDERS = ("core", "models", "data", "train", "inference", "kinds", "jobs", "eval", "export", "engines")  # bottom to top


def modules():
    """{module name: path} of every module of the package's folders (a package's __init__ under its own name)."""
    found = {}
    for folder in FOLDERS:
        for path in sorted((REPO / folder).glob("*.py")):
            found[folder if path.name == "__init__.py" else f"{folder}.{path.stem}"] = path
    return found


def imports(path: Path, names):
    """[(imported module, inside a function?)] of one file: `from specdrafter.x.y import z` names x.y.z when that is a
    module, else x.y; relative imports resolved against the file's package."""
    tree = ast.parse(path.read_text())
    inside = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
              for node in ast.walk(fn)}
    package = path.parent.name
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package + (f".{node.module}" if node.module else "")
            elif node.module and node.module.startswith("specdrafter."):
                base = node.module.removeprefix("specdrafter.")
            else:
                continue
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name.removeprefix("specdrafter.") for a in node.names if a.name.startswith("specdrafter.")]
        else:
            continue
        found += [(t, id(node) in inside) for t in targets if t in names]
    return found


def graph():
    names = modules()
    return {m: {t for t, _ in imports(path, names) if t != m} for m, path in names.items()}


def cycles(edges):
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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
    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_planted_cycle():
    edges = graph()
    edges["core.io"] = edges["core.io"] | {"jobs.decode"}  # ground importing a job closes a loop through the layers
    assert any("core.io" in c and "jobs.decode" in c for c in cycles(edges))


def test_the_package_has_no_import_cycle():
    assert cycles(graph()) == []


def test_every_import_points_down_the_folders():
    """A module imports its own folder or the folders below it: kinds/ reads what a kind is made of and nothing that
    consults the table; jobs/, eval/ and export/ consult it."""
    rank = {folder: i for i, folder in enumerate(FOLDERS)}
    upward = [f"{m} → {t}" for m, targets in graph().items() for t in targets
              if rank[t.split(".")[0]] > rank[m.split(".")[0]]]
    assert upward == []


def test_no_package_import_hides_inside_a_function():
    names = modules()
    hidden = [f"{path.relative_to(REPO)}: {t}" for path in names.values() for t, inside in imports(path, names) if inside]
    assert hidden == []


def test_the_package_imports_nothing_of_the_benchmarks():
    """benchmarks/ is not installed: a package module importing one of its scripts (`import bench_plan`,
    `from benchmarks.conformance import ...`) would work in a checkout and fail in the wheel."""
    scripts = {"benchmarks"} | {path.stem for path in (REPO / "benchmarks").glob("*.py")}
    found = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [f"{path.relative_to(REPO)}: {a.name}" for a in node.names if a.name.split(".")[0] in scripts]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] in scripts:
                found.append(f"{path.relative_to(REPO)}: {node.module}")
    assert scripts > {"benchmarks"} and found == []


def test_the_protocol_and_the_recipe_load_no_ml_library():
    """kinds/base.py (the Kind protocol), core/recipe.py, core/recipe_checks.py and core/io.py import no torch,
    transformers or peft: a tool that only reads recipes or the protocol (a linter, a docs build) need not load them.
    The protocol's file is loaded on its own, without the `specdrafter.kinds` package, whose __init__ imports the
    kinds themselves."""
    code = ("import importlib.util, sys\n"
            "import specdrafter.core.io, specdrafter.core.recipe, specdrafter.core.recipe_checks\n"
            f"spec = importlib.util.spec_from_file_location('protocol', {str(REPO / 'kinds' / 'base.py')!r})\n"
            "module = sys.modules['protocol'] = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n"
            "print(sorted(m for m in ('torch', 'transformers', 'peft', 'safetensors') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
