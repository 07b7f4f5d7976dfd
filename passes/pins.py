"""Pass: the user's pins applied to the candidate strategies (``PlanOptions.pin``).

Input: strategies per node (``passes.strategies.generate_strategies``) and {node-name glob: spec text}.
Output: the same dict with each pinned node's list cut to the strategies whose output spec is the pin; a
pinned placeholder read by one node also cuts that reader to the strategies reading it in the pinned spec
(a single-reader placeholder is stored as it is read). Invariant: every node keeps at least one strategy,
else ``PlanError`` names the pin and the valid specs.
"""
from __future__ import annotations

import fnmatch

from autopar.errors import PlanError
from autopar.ir.graph import ModelGraph
from autopar.ir.ops import OpView
from autopar.passes.strategies import generate_strategies
from autopar.placement import R, parse_spec, spec_str


def apply_pins(graph: ModelGraph, strategies: dict, pin: dict[str, str]) -> dict:
    """Keep only strategies whose output spec is the pinned one; a placeholder read by one node also
    restricts that node to strategies reading it in the pinned spec (it is stored as it is read)."""
    out = dict(strategies)
    for node in graph.gm.graph.nodes:
        specs = [parse_spec(v) for k, v in pin.items() if fnmatch.fnmatchcase(node.name, k)]
        if not specs:
            continue
        want = specs[-1]
        kept = [s for s in out[node.name] if s.out_spec == want]
        if not kept:
            shape = tuple(getattr(node.meta.get("val"), "shape", ()))
            raise PlanError(f"pin {spec_str(want)} for {node.name} is not a valid sharding of it (valid: "
                            f"{sorted({spec_str(s.out_spec) for s in out[node.name]})} for its shape {shape}); fix "
                            f"the pin. If it is valid for the full batch, the pipeline planner priced a microbatch "
                            f"or submesh it does not divide: pin with stages=1 (one stage on the whole mesh)")
        out[node.name] = kept
        users = list(node.users)
        if node.op == "placeholder" and len(users) == 1 and users[0].op == "call_function":
            user = users[0]
            idx = OpView(user).tensor_args.index(node)
            stored = lambda spec: tuple(R if p.is_partial() else p for p in spec)  # noqa: E731
            fits = [s for s in out[user.name] if stored(s.in_specs[idx]) == want]
            if not fits:
                raise PlanError(f"pin {spec_str(want)} for {node.name} leaves its reader {user.name} no strategy")
            out[user.name] = fits
    return out


def pinned_strategies(graph: ModelGraph, mesh, pin: dict[str, str], check=None) -> dict:
    """``apply_pins(graph, generate_strategies(graph, mesh), pin)``, kept on the graph per (mesh, pins): both are
    pure functions of them, and their consumers copy what they change (``GroupBuilder``), so plans that share
    a graph (a grid of configurations) share them too. ``check(generated)`` runs on each new generation (the
    driver's debug invariants). The cache is tied to ``graph.gm``: a copy of the graph (``rescale``) has its
    own module and starts afresh."""
    owner, cache = getattr(graph, "_strategy_cache", (None, None))
    if owner is not graph.gm:
        cache = {}
        graph._strategy_cache = (graph.gm, cache)
    key = (mesh, tuple(pin.items()))
    if key not in cache:
        if mesh not in cache:
            cache[mesh] = generate_strategies(graph, mesh)
        if check is not None:
            check(cache[mesh])
        cache[key] = apply_pins(graph, cache[mesh], pin)
    return cache[key]
