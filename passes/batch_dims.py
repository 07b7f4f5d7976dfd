"""Pass: which dim of each tensor carries the batch, and the graph's shapes at a microbatch.

Input:  ``ModelGraph`` captured at the global batch.
Output: ``batch_dims(graph)`` -> {node name: dim or None}; ``rescale(graph, B)`` -> a ModelGraph whose
        ``meta["val"]`` shapes are those of one of B microbatches (the batch dim divided by B).

A user input's batch dim is dim 0. An op's output carries the batch on dim d when its sharding rule maps
"every batch-carrying input split on its batch dim" to an output Shard(d) (other inputs replicated when
the rule allows, else split as the rule says): the propagation that makes data parallelism valid. A
Partial output (a reduction over the batch, like a mean loss) carries none. Tensors the inputs do not
reach (parameters, constants, positions) carry none.

The rescaled graph is for pricing only: its op arguments still hold the global batch (a hard-coded
``expand(x, [8, -1])`` stays 8), so code is generated from a graph re-captured at the microbatch size.
"""
from __future__ import annotations

import copy

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from autopar.ir.ops import SIGNATURE_KEY, OpView
from autopar.passes.strategies import rule_for
from autopar.passes.strategies.base import all_replicated_rule
from autopar.placement import R


def batch_dims(graph) -> dict[str, int | None]:
    """{node name: its batch dim, or None} by propagating the inputs' dim 0 through the rules."""
    return _analysis(graph)[0]


def rescale_is_exact(graph) -> bool:
    """False when some op meets the batch on one input but not on another that has it too (HF GPT-2
    builds its attention mask from ``arange(batch)``): a rescaled graph then mixes the microbatch with the
    whole batch, and only a capture at the microbatch gives exact shapes."""
    return _analysis(graph)[1]


def _analysis(graph) -> tuple[dict[str, int | None], bool]:
    cached = getattr(graph, "_batch_analysis", None)
    if cached is not None:
        return cached
    out: dict[str, int | None] = {}
    exact = True
    for node in graph.gm.graph.nodes:
        if node.op == "placeholder":
            info = graph.placeholder(node.name)
            out[node.name] = 0 if info.kind == "input" and len(info.shape) > 0 else None
        elif node.op == "call_function":
            out[node.name], matched = _propagate(node, out)
            exact = exact and matched
    graph._batch_analysis = (out, exact)
    return graph._batch_analysis


def _propagate(node: fx.Node, dims: dict[str, int | None]) -> tuple[int | None, bool]:
    """(output batch dim, whether the rule matched exactly) for one op."""
    view = OpView(node)
    wanted = tuple(Shard(dims[a.name]) if dims.get(a.name) is not None else R for a in view.tensor_args)
    if all(p.is_replicate() for p in wanted):
        return None, True
    fn = rule_for(node.target)
    rules = (fn(view) if fn is not None else []) + [all_replicated_rule(view)]
    # Inputs the batch does not reach may be split too (HF GPT-2 builds its attention mask from aranges
    # of the batch size, not from the inputs); exact matches win.
    ranked = sorted(rules, key=lambda r: r.inputs != wanted)
    for rule in ranked:
        if all(w.is_replicate() or got == w for w, got in zip(wanted, rule.inputs)):
            return (rule.output.dim if rule.output.is_shard() else None), rule.inputs == wanted
    return None, True


def rescale(graph, microbatches: int):
    """A copy of ``graph`` whose values have the shapes of one microbatch (pricing only, see docstring).

    Raises ValueError when a batch dim does not divide by ``microbatches``.
    """
    if microbatches == 1:
        return graph
    dims = batch_dims(graph)
    new_graph = fx.Graph()
    remap: dict[fx.Node, fx.Node] = {}
    new_graph.graph_copy(graph.gm.graph, remap)
    for old, new in remap.items():
        new.meta = dict(old.meta)
        new.meta["val"] = _scaled(old.meta.get("val"), dims.get(old.name), microbatches, old.name)
        new.meta.pop(SIGNATURE_KEY, None)
    output = next(n for n in graph.gm.graph.nodes if n.op == "output")
    new_output = [n for n in new_graph.nodes if n.op == "output"]
    if not new_output:
        new_graph.output(fx.map_arg(output.args[0], lambda n: remap[n]))
    scaled = copy.copy(graph)
    scaled.gm = fx.GraphModule(graph.gm, new_graph)
    scaled.__post_init__()
    return scaled


def _scaled(val, dim: int | None, parts: int, name: str):
    if isinstance(val, (tuple, list)):
        return type(val)(_scaled(v, dim, parts, name) for v in val)
    if not isinstance(val, torch.Tensor):
        return val
    shape = list(val.shape)
    if dim is not None:
        if shape[dim] % parts:
            raise ValueError(f"{name}: batch dim {dim} of size {shape[dim]} does not split into {parts} microbatches; "
                             f"choose a microbatch count that divides the batch")
        shape[dim] //= parts
    return torch.empty(shape, dtype=val.dtype, device="meta")
