"""The package's structure holds: every subpackage ships, the kernels never import the cache, no import circles, and
every console script resolves."""

from __future__ import annotations

import ast
import importlib
import os

import pytest
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# source folder -> the module name it installs as
ROOTS = {"oscar_hf": "oscar_hf", "calibrate": "oscar_hf.calibrate"}
CACHE_SIDE = ("oscar_hf.cache", "oscar_hf.layer", "oscar_hf.history", "oscar_hf.handoff", "oscar_hf.attention",
              "oscar_hf.graph_decode", "oscar_hf.eval", "oscar_hf.calibrate")


def _pyproject() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _modules() -> dict[str, str]:
    """Installed module name -> source path, for every .py file of the package."""
    found = {}
    for folder, name in ROOTS.items():
        for directory, _, files in os.walk(os.path.join(REPO, folder)):
            for file in files:
                if not file.endswith(".py"):
                    continue
                parts = os.path.relpath(os.path.join(directory, file), os.path.join(REPO, folder))[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join([name, *parts])] = os.path.join(directory, file)
    return found


def _imports(path: str, module: str) -> set[str]:
    """The package modules `module` (at `path`) imports, relative imports resolved."""
    with open(path) as f:
        tree = ast.parse(f.read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return {n for n in names if n.split(".")[0] == "oscar_hf"}


def _resolve(name: str, modules: dict[str, str]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        targets = {_resolve(n, modules) for n in _imports(path, module)}
        graph[module] = {t for t in targets if t and t != module}
    return graph


def test_every_subpackage_is_listed_for_installation():
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    packages = {m for m, p in _modules().items() if p.endswith("__init__.py")}
    assert packages == listed


def test_kernels_import_nothing_of_the_cache():
    for module, targets in _graph().items():
        if module.startswith("oscar_hf.kernels"):
            offending = sorted(t for t in targets if t.startswith(CACHE_SIDE))
            assert not offending, f"{module} imports {offending}"


def test_the_core_does_not_import_the_evaluation_or_calibration():
    for module, targets in _graph().items():
        if not module.startswith(("oscar_hf.eval", "oscar_hf.calibrate")):
            offending = sorted(t for t in targets if t.startswith(("oscar_hf.eval", "oscar_hf.calibrate")))
            assert not offending, f"{module} imports {offending}"


def test_no_import_circles():
    graph = _graph()
    # a package's __init__ that re-exports its own modules is not a circle: drop the edges parent -> child
    edges = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    index, low, on_stack, stack, circles, counter = {}, {}, set(), [], [], [0]

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    assert not circles


@pytest.mark.parametrize("script", sorted(_pyproject()["project"]["scripts"]))
def test_console_scripts_resolve(script):
    module, _, function = _pyproject()["project"]["scripts"][script].partition(":")
    assert callable(getattr(importlib.import_module(module), function))
