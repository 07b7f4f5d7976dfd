"""ZeRO-3's rewrite of a generated module: where units are gathered, prefetched, freed and read.

Input:  a generated per-rank ``fx.GraphModule`` (parameters read by ``get_attr`` nodes, recomputed regions
        as ``recompute_*`` submodules) and its ``zero3.Units``.
Output: the same module with, per unit k (``ir.buckets.unit_spans`` on the get_attr nodes, the spans the
        planner also uses):
  * ``zero3_gather_k`` before the first node reading the unit (``Units.forward_use``: wait for its
    all-gather, issuing it first if it was not prefetched);
  * ``zero3_prefetch_k`` before the node at the position ``ir.buckets.prefetch_spans`` issues it, when that
    comes before its first read (every unit but the first, unless two others are held there);
  * ``zero3_free_k`` after the last node reading it (none when the output reads it);
  * ``zero3_ensure_k`` at the top of every recomputed region that reads it (a gather on replay; the
    region keeps its inputs by reference, ``Recomputed.plain_inputs``, so only these gather on replay);
  * with a compute-dtype gather, each get_attr of a unit's parameter replaced by a ``ComputeRead`` node
    returning the leaf the ops read instead (``Unit.leaves``).
Calls that land before the same node run in the order frees, gathers, prefetches: a unit freed there
makes room for the one prefetched, and a prefetch never delays the gather the next op waits for.
Returns the backward order of the units (descending last forward read: the order backward unpacks
them) and the most bytes of units held at once in forward (``ir.buckets.peak_gathered`` over the
prefetch spans: the plan's ``zero3_transient``, the cap of the backward prefetch).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.ir.buckets import parameter_sources, peak_gathered, prefetch_spans, unit_spans


class UnitCall(torch.nn.Module):
    """A node of the generated graph: ``gather`` / ``prefetch`` / ``free`` / ``ensure`` of one unit."""

    def __init__(self, unit, action: str):
        super().__init__()
        self._unit, self.action = [unit], action  # a list: the unit is not a submodule

    @torch.compiler.disable  # changes storage and waits on async work: a graph break under torch.compile
    def forward(self) -> None:
        unit = self._unit[0]
        if self.action == "gather":
            unit.registry.forward_use(unit)
        elif self.action == "prefetch":
            unit.prefetch()
        elif self.action == "free":
            unit.free()
        else:
            unit.registry.backward_use(unit, prefetch_next=False)


class ComputeRead(torch.nn.Module):
    """A node of the generated graph: the compute-dtype leaf the ops read for one parameter of a unit."""

    def __init__(self, leaf: torch.Tensor):
        super().__init__()
        self._leaf = [leaf]  # a list: the leaf is not a parameter of the module (its state dict stays)

    def forward(self) -> torch.Tensor:
        return self._leaf[0]


def insert_unit_calls(gm: fx.GraphModule, units) -> tuple[list[int], float]:
    """Rewrite ``gm`` for ``units`` (see module docstring); recompile it. Returns (backward order, cap)."""
    index = {id(u): k for k, u in enumerate(units.units)}
    unit_of = {name: index[id(u)] for name, u in units.of_param.items()}
    spans = unit_spans(gm.graph, unit_of, "get_attr")
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    nodes = list(gm.graph.nodes)
    held = prefetch_spans({k: (position[a], position[b]) for k, (a, b) in spans.items()})
    sources = parameter_sources(gm.graph, unit_of, "get_attr")
    for k, (first, _) in sorted(spans.items()):
        _insert(gm, f"zero3_gather_{k}", UnitCall(units.units[k], "gather"), first, before=True)
    for k, (issue, _) in sorted(held.items()):
        if issue < position[spans[k][0]]:
            _insert(gm, f"zero3_prefetch_{k}", UnitCall(units.units[k], "prefetch"), nodes[issue], before=True)
    for k, (_, last) in sorted(spans.items()):
        if last.op != "output":
            _insert(gm, f"zero3_free_{k}", UnitCall(units.units[k], "free"), last, before=False)
    for node in nodes:
        if node.op == "call_module" and node.target.startswith("recompute_"):
            region = getattr(gm, node.target)
            for k in sorted(set().union(*(sources.get(a, set()) for a in node.all_input_nodes))):
                _ensure_in_region(region.body, units.units[k], k)
                region.plain_inputs = True
    _read_compute_leaves(gm, units)
    gm.graph.lint()
    gm.recompile()
    order = sorted(spans, key=lambda k: (-position[spans[k][1]], -position[spans[k][0]], k))
    return order, peak_gathered(held, {k: units.units[k].flat.nbytes for k in held})


def _insert(gm: fx.GraphModule, name: str, module: torch.nn.Module, at: fx.Node, before: bool) -> None:
    gm.add_module(name, module)
    with (gm.graph.inserting_before(at) if before else gm.graph.inserting_after(at)):
        gm.graph.call_module(name)


def _read_compute_leaves(gm: fx.GraphModule, units) -> None:
    """Replace each get_attr of a compute-dtype unit's parameter by a ``ComputeRead`` of its leaf, and give
    the readers that compute in another dtype the leaf upcast (``_upcast_readers``)."""
    reads, dtypes = [], None
    for node in list(gm.graph.nodes):
        unit = units.of_param.get(node.target) if node.op == "get_attr" else None
        if unit is None or unit.flat is unit.master:
            continue
        leaf = unit.leaves[unit.bucket.names.index(node.target)]
        name = f"zero3_read_{node.target}"
        gm.add_module(name, ComputeRead(leaf))
        with gm.graph.inserting_before(node):
            reads.append(gm.graph.call_module(name))
        node.replace_all_uses_with(reads[-1])
        gm.graph.erase_node(node)
        dtypes = (leaf.dtype, unit.master.tensor.dtype)
    if reads:
        _upcast_readers(gm, reads, *dtypes)


def _upcast_readers(gm: fx.GraphModule, roots: list[fx.Node], low: torch.dtype, high: torch.dtype) -> None:
    """Every op that reads a compute-dtype leaf (or a view of one) and whose output is not in the compute
    dtype under the policy (``meta["dtype"]`` from codegen: layer_norm, embedding, a bias add; ops autocast
    does not run low) reads it upcast to the master dtype instead, so each op computes in the dtype the
    planner priced and autocast gives it. The rest (matmuls: autocast would cast the fp32 weight to the
    same rounded value) read the leaf itself, which backward then re-gathers. A recomputed region's body
    is rewritten the same way from its inputs."""
    sources = _derived(gm.graph, roots)
    for source in list(sources):
        for user in list(source.users):
            if user in sources or user.op == "output":
                continue
            if user.op == "call_module":
                if user.target.startswith("recompute_"):
                    body = getattr(gm, user.target).body
                    inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
                    _upcast_readers(body, [inputs[i] for i, a in enumerate(user.args) if a is source], low, high)
                    body.recompile()
                continue
            if user.meta.get("dtype") != low:
                with gm.graph.inserting_before(user):
                    up = gm.graph.call_function(torch.ops.aten._to_copy.default, (source,), {"dtype": high})
                user.replace_input_with(source, up)


def _derived(graph: fx.Graph, roots: list[fx.Node]) -> set[fx.Node]:
    """``roots`` and the ops computed from them only (views, the scaling of a bias)."""
    out = set(roots)
    for node in graph.nodes:
        if node.op in ("call_function", "call_method") and node.all_input_nodes and all(
                a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _ensure_in_region(body: fx.GraphModule, unit, k: int) -> None:
    name = f"zero3_ensure_{k}"
    if hasattr(body, name):
        return
    body.add_module(name, UnitCall(unit, "ensure"))
    first = next(n for n in body.graph.nodes if n.op != "placeholder")
    with body.graph.inserting_before(first):
        body.graph.call_module(name)
    body.recompile()
