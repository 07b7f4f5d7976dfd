"""The layering rule, checked on the source: every autopar module imports, and imports point one way.

    cli -> profiling -> api (autopar.compile/plan) -> planner -> passes -> cost_models
        -> data (plan, hardware: Plan, Cluster) -> views (report, trace, visualize) -> IR
    runtime (and launch) -> data + IR (never passes, cost_models or the planner)
    baselines -> planner;  datasets (autopar/data: samplers, text) -> IR

Imports are read with ``ast`` from every module the package walk finds, function-level (deferred)
imports included, so a late import cannot hide an edge. Each module belongs to one layer (``LAYERS``);
an edge is allowed when the importer's layer lists the imported module's layer in ``MAY_IMPORT``. Neither
the graph of modules nor the graph of sub-packages (and top-level layers) may have a cycle, deferred
imports counted (networkx finds them); ``EXCEPTIONS`` lists the edges that may point up, each with its why.
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
TOP_LEVEL_MODULES_MAX = 14  # autopar/ itself reads as a table of contents: the public API and the plan's data

# Most specific prefix wins. Top-level modules not listed are the public API ("api").
LAYERS = {
    "autopar.ir": "ir",
    "autopar.errors": "ir",
    "autopar.placement": "ir",
    "autopar.redistribute": "ir",
    "autopar.views": "views",
    "autopar.plan": "data",
    "autopar.plan_schema": "data",
    "autopar.hardware": "data",
    "autopar.cost_models": "cost_models",
    "autopar.passes": "passes",
    "autopar.planner": "planner",
    "autopar.runtime": "runtime",
    "autopar.launch": "runtime",
    "autopar.baselines": "baselines",
    "autopar.profiling": "profiling",
    "autopar.cli": "cli",
    "autopar.data": "datasets",
}
MAY_IMPORT = {
    "ir": {"ir"},
    "datasets": {"ir", "datasets"},
    "views": {"ir", "views"},
    "data": {"ir", "views", "data"},
    "cost_models": {"ir", "data", "cost_models"},
    "passes": {"ir", "data", "cost_models", "passes"},
    "planner": {"ir", "data", "cost_models", "passes", "planner"},
    "runtime": {"ir", "data", "runtime"},
    "api": {"ir", "datasets", "views", "data", "cost_models", "passes", "planner", "runtime", "api"},
    "baselines": {"ir", "data", "cost_models", "passes", "planner", "baselines"},
    "profiling": {"ir", "data", "cost_models", "passes", "runtime", "api", "profiling"},
    "cli": {"ir", "datasets", "views", "data", "cost_models", "passes", "planner", "runtime", "api", "profiling",
            "cli"},
}
# (importer, imported): why the edge may point up. Each is a deferred import inside one function.
EXCEPTIONS = {
    ("autopar.hardware.cluster", "autopar.profiling.profiler"):
        "Cluster.profile() is the public alias of the profiler, which launches processes and compiles probe "
        "models to measure a cluster; imported at call time",
}


def layer_of(module: str) -> str:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    return LAYERS[best] if best else "api"


def unit_of(module: str) -> str:
    """The node of the package graph: a sub-package of autopar (passes.strategies its own), or the layer of
    a top-level module."""
    parts = module.split(".")
    if parts[:3] == ["autopar", "passes", "strategies"]:
        return "autopar.passes.strategies"
    if ".".join(parts[:2]) in subpackages():
        return ".".join(parts[:2])
    return "autopar:" + layer_of(module)


@functools.cache
def installed_packages() -> list[str]:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")  # tomllib is 3.11+ and Python 3.10 is supported
    return re.findall(r'"([\w.]+)"', re.search(r"^packages = \[(.*?)\]", text, re.M | re.S).group(1))


def subpackages() -> set[str]:
    return {p for p in installed_packages() if p.count(".") == 1}


@functools.cache
def all_modules() -> list[str]:
    """Every module of the packages pyproject.toml installs (some live outside autopar/ on disk)."""
    packages = installed_packages()
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


def cycles_in(edges) -> list[list[str]]:
    graph = nx.DiGraph()
    graph.add_edges_from(edges)
    return sorted(sorted(c) for c in nx.simple_cycles(graph))


def package_edges(edges) -> set[tuple[str, str]]:
    return {(unit_of(s), unit_of(d)) for s, d in edges if unit_of(s) != unit_of(d)}


@pytest.fixture(scope="module")
def edges() -> list[tuple[str, str]]:
    """Every import between autopar modules, module-level and deferred, less the documented exceptions."""
    return [(src, dst) for src in all_modules() for dst in imports_of(src) if (src, dst) not in EXCEPTIONS]


def test_every_module_imports():
    for name in all_modules():
        importlib.import_module(name)
    assert len(all_modules()) > 50  # the walk found the package, sub-packages included


def test_every_package_on_disk_is_installed():
    """A folder with an ``__init__.py`` that pyproject.toml does not list is left out of a non-editable install
    (``pip install .``: the import fails there while an editable checkout works) and out of these checks."""
    dirs = {"autopar": "autopar", "passes": "autopar.passes", "cost_models": "autopar.cost_models"}
    on_disk = {dirs[init.parts[len(ROOT.parts)]] + "".join("." + p for p in init.parts[len(ROOT.parts) + 1:-1])
               for top in dirs for init in (ROOT / top).rglob("__init__.py")}
    assert on_disk - set(installed_packages()) == set(), "packages missing from pyproject.toml's packages"
    assert {"autopar.moe", "autopar.passes.strategies"} <= on_disk  # the walk finds nested packages


def test_top_level_reads_as_a_table_of_contents():
    """autopar/ holds the public API and the plan's data; everything else lives in a sub-package by concern."""
    top = [info.name for info in pkgutil.iter_modules([str(ROOT / "autopar")]) if not info.ispkg]
    assert len(top) <= TOP_LEVEL_MODULES_MAX, f"{len(top)} modules directly in autopar/: {sorted(top)}"
    assert {f"autopar.{name}" for name in ("planner", "hardware", "profiling", "views")} <= subpackages()


def test_imports_point_down_the_layers(edges):
    wrong = [f"{src} ({layer_of(src)}) imports {dst} ({layer_of(dst)})" for src, dst in edges
             if layer_of(dst) not in MAY_IMPORT[layer_of(src)]]
    assert not wrong, "imports against the layering rule:\n" + "\n".join(wrong)


def test_no_cycle_between_packages(edges):
    cycles = cycles_in(package_edges(edges))
    assert not cycles, f"import cycles between packages: {cycles}"


def test_no_cycle_between_modules(edges):
    """Deferred imports count: a cycle hidden inside a function is still two modules that need each other."""
    cycles = cycles_in(edges)
    assert not cycles, f"import cycles between modules: {cycles}"


SCRIPT_FOLDERS = ("benchmarks", "examples")  # first-party code outside the package, imported by dotted path


def script_edges() -> list[tuple[str, str]]:
    """Imports between the modules of ``SCRIPT_FOLDERS`` (read with ``ast``, deferred ones included)."""
    names = {".".join(path.relative_to(ROOT).with_suffix("").parts): path
             for folder in SCRIPT_FOLDERS for path in (ROOT / folder).rglob("*.py")}
    out = []
    for name, path in names.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = {f"{node.module}.{a.name}" for a in node.names} | {node.module}
            else:
                continue
            out.extend((name, target) for target in targets & set(names) if target != name)
    return out


def test_no_cycle_between_benchmark_and_example_modules():
    edges = script_edges()
    assert ("benchmarks.vs_hand.vs_megatron", "benchmarks.vs_hand.vs_megatron_report") in edges  # the walk works
    assert not cycles_in(edges), f"import cycles between script modules: {cycles_in(edges)}"


# (lower, higher): the lower package never reaches the higher one, directly or through others.
DIRECTIONS = [
    ("autopar.views", "autopar:data"), ("autopar.hardware", "autopar.cost_models"),
    ("autopar.hardware", "autopar.planner"), ("autopar.hardware", "autopar.profiling"),
    ("autopar.views", "autopar.hardware"), ("autopar.cost_models", "autopar.passes"),
    ("autopar.passes", "autopar.planner"), ("autopar.planner", "autopar:api"),
    ("autopar.runtime", "autopar.planner"), ("autopar.runtime", "autopar.hardware"),
    ("autopar:api", "autopar.profiling"), ("autopar.planner", "autopar.baselines"),
    ("autopar.profiling", "autopar:cli"),
]


def test_packages_point_one_way(edges):
    graph = nx.DiGraph(package_edges(edges))
    graph.add_nodes_from(n for pair in DIRECTIONS for n in pair)
    up = [f"{low} reaches {high}: {nx.shortest_path(graph, low, high)}" for low, high in DIRECTIONS
          if nx.has_path(graph, low, high)]
    assert not up, "\n".join(up)
    used = [(low, high) for low, high in DIRECTIONS if nx.has_path(graph, high, low)]
    assert len(used) >= len(DIRECTIONS) - 3, "most listed pairs are real dependencies, not empty claims"


def test_exceptions_are_still_needed():
    real = {(src, dst) for src in all_modules() for dst in imports_of(src)}
    assert set(EXCEPTIONS) <= real, "remove EXCEPTIONS entries whose import is gone"


def test_the_check_catches_a_forbidden_edge():
    """Negative control: the runtime importing a pass, or the IR importing the runtime, is flagged."""
    assert layer_of("autopar.passes.stage_dp") not in MAY_IMPORT[layer_of("autopar.runtime.pipeline")]
    assert layer_of("autopar.runtime.collectives") not in MAY_IMPORT[layer_of("autopar.ir.ops")]
    assert layer_of("autopar.planner.driver") not in MAY_IMPORT[layer_of("autopar.hardware.cluster")]
    assert layer_of("autopar.profiling.profiler") not in MAY_IMPORT[layer_of("autopar.api")]
    assert unit_of("autopar.passes.strategies.matmul") == "autopar.passes.strategies"
    assert unit_of("autopar.planner.driver") == "autopar.planner" and unit_of("autopar.cli") == "autopar:cli"
    assert layer_of("autopar.planner.driver") == "planner" and layer_of("autopar.api") == "api"


def test_the_check_catches_a_cycle():
    """Negative control: a deferred import back (hardware's cluster importing the planner) is a cycle both
    between modules and between packages."""
    real = [("autopar.planner.driver", "autopar.hardware.cluster")]
    back = [("autopar.hardware.cluster", "autopar.planner.driver")]
    assert cycles_in(real + back) == [["autopar.hardware.cluster", "autopar.planner.driver"]]
    assert cycles_in(package_edges(real + back)) == [["autopar.hardware", "autopar.planner"]]
    assert not cycles_in(real) and not cycles_in(package_edges(real))
