"""The layering rule, checked on the source: every autopar module imports, and imports point one way.

    api (autopar/*.py tools) -> driver -> passes -> cost_models -> data (Plan, Cluster) -> IR
    runtime -> data + IR (never passes, cost_models or the driver)

Imports are read with ``ast`` from every module the package walk finds, function-level (deferred)
imports included, so a late import cannot hide an edge. Each module belongs to one layer (``LAYERS``);
an edge is allowed when the importer's layer lists the imported module's layer in ``MAY_IMPORT``. The
graph of layers and sub-packages must have no cycle (networkx finds them).
"""
from __future__ import annotations

import ast
import functools
import importlib
import pathlib
import pkgutil
import re

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Most specific prefix wins. Top-level modules not listed are tools on top of everything ("api").
LAYERS = {
    "autopar.ir": "ir",
    "autopar.errors": "ir",
    "autopar.placement": "ir",
    "autopar.redistribute": "ir",
    "autopar.plan": "data",
    "autopar.plan_schema": "data",
    "autopar.cluster": "data",
    "autopar.presets": "data",
    "autopar.report": "data",
    "autopar.trace": "data",
    "autopar.cost_models": "cost_models",
    "autopar.passes": "passes",
    "autopar.driver": "driver",
    "autopar.options": "driver",
    "autopar.manual_stages": "driver",
    "autopar.exact_checks": "driver",
    "autopar.plan_builder": "driver",
    "autopar.invariants": "driver",
    "autopar.runtime": "runtime",
}
MAY_IMPORT = {
    "ir": {"ir"},
    "data": {"ir", "data"},
    "cost_models": {"ir", "data", "cost_models"},
    "passes": {"ir", "data", "cost_models", "passes"},
    "driver": {"ir", "data", "cost_models", "passes", "driver"},
    "runtime": {"ir", "data", "runtime"},
    "api": {"ir", "data", "cost_models", "passes", "driver", "runtime", "api"},
}
# (importer, imported): why the edge may point up. Each is a deferred import inside one function.
EXCEPTIONS = {
    ("autopar.cluster", "autopar.profiler"): "Cluster.profile() is the public entry to the profiler, which "
                                             "launches processes to measure a cluster; imported at call time",
}


def layer_of(module: str) -> str:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    return LAYERS[best] if best else "api"


def unit_of(module: str) -> str:
    """The node of the cycle graph: a sub-package of autopar, or the layer of a top-level module."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in ("ir", "passes", "cost_models", "runtime"):
        return ".".join(parts[:3]) if parts[1] == "passes" and parts[2] == "strategies" else ".".join(parts[:2])
    return "autopar:" + layer_of(module)


@functools.cache
def all_modules() -> list[str]:
    """Every module of the packages pyproject.toml installs (some live outside autopar/ on disk)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")  # tomllib is 3.11+ and Python 3.10 is supported
    packages = re.findall(r'"([\w.]+)"', re.search(r"^packages = \[(.*?)\]", text, re.M | re.S).group(1))
    names = set(packages)
    for package in packages:
        path = importlib.import_module(package).__path__
        names.update(info.name for info in pkgutil.iter_modules(path, prefix=package + "."))
    return sorted(names)


def imports_of(module: str) -> set[str]:
    """autopar modules that ``module``'s source imports (any depth in the file)."""
    mod = importlib.import_module(module)
    tree = ast.parse(open(mod.__file__, encoding="utf-8").read())
    package = module if mod.__file__.endswith("__init__.py") else module.rpartition(".")[0]
    known = set(all_modules())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: drop (level - 1) trailing parts of the package
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            submodules = {f"{base}.{a.name}" for a in node.names} & known  # `from pkg import module`
            out.update(submodules)
            if len(submodules) < len(node.names):  # some names are the package's own attributes
                out.add(base)
    return {m for m in out if m in known and m != module}


@pytest.fixture(scope="module")
def edges() -> list[tuple[str, str]]:
    return [(src, dst) for src in all_modules() for dst in imports_of(src)]


def test_every_module_imports():
    for name in all_modules():
        importlib.import_module(name)
    assert len(all_modules()) > 50  # the walk found the package, sub-packages included


def test_imports_point_down_the_layers(edges):
    wrong = [f"{src} ({layer_of(src)}) imports {dst} ({layer_of(dst)})" for src, dst in edges
             if layer_of(dst) not in MAY_IMPORT[layer_of(src)] and (src, dst) not in EXCEPTIONS]
    assert not wrong, "imports against the layering rule:\n" + "\n".join(wrong)


def test_no_cycle_between_packages(edges):
    graph = nx.DiGraph()
    graph.add_edges_from((unit_of(s), unit_of(d)) for s, d in edges
                         if unit_of(s) != unit_of(d) and (s, d) not in EXCEPTIONS)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, f"import cycles between packages: {cycles}"


def test_exceptions_are_still_needed(edges):
    assert set(EXCEPTIONS) <= set(edges), "remove EXCEPTIONS entries whose import is gone"


def test_the_check_catches_a_forbidden_edge():
    """Negative control: the runtime importing a pass, or the IR importing the runtime, is flagged."""
    assert layer_of("autopar.passes.stage_dp") not in MAY_IMPORT[layer_of("autopar.runtime.pipeline")]
    assert layer_of("autopar.runtime.collectives") not in MAY_IMPORT[layer_of("autopar.ir.ops")]
    assert unit_of("autopar.passes.strategies.matmul") == "autopar.passes.strategies"
    assert layer_of("autopar.driver") == "driver" and layer_of("autopar.cli") == "api"
