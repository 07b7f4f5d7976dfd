"""Pass helper: give every node of the graph being split into stages an owning stage.

The layer clustering names the nodes of the graph captured at the full batch. The stages are solved on the
graph at one microbatch, which is re-captured when rescaling is not exact (``batch_dims.rescale_is_exact``:
a size derived from the batch that the walk cannot follow); a re-capture names its nodes afresh and can hold
nodes the clustering never saw (a constant built from the microbatch size). A name-for-name reading would
then put nodes in the wrong stage, or leave a value read by a stage with no stage producing it.

``subsets_on`` carries the layer subsets over: the two graphs' call_function sequences are aligned on
(op, module path) with ``difflib`` (they come from the same code, so they differ in a few nodes), matched
nodes keep their stage, and each remaining node goes to the earliest stage that reads it (a creation op or
constant is recomputed next to its use; anything else is sent there like any cross-stage value). A last
forward sweep moves a node no earlier than its inputs' stages. Invariant afterwards: every call_function
node is in exactly one subset, and no node's stage precedes an input's stage.
"""
from __future__ import annotations

import difflib

import torch.fx as fx


def _key(node: fx.Node) -> tuple[str, str]:
    stack = node.meta.get("nn_module_stack") or {}
    path = next(reversed(stack.values()))[0] if stack else ""
    return str(node.target), path


def _calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def subsets_on(source: fx.GraphModule, target: fx.GraphModule, subsets: list[set[str]]) -> list[set[str]]:
    """``subsets[s]``: names in ``source`` of stage s's nodes; returns the subsets naming ``target``'s nodes,
    every call_function node placed (see module docstring). ``"output"`` stays with the last stage."""
    src, dst = _calls(source), _calls(target)
    stage_of = {name: s for s, names in enumerate(subsets) for name in names}
    if [(n.name, _key(n)) for n in src] == [(n.name, _key(n)) for n in dst]:
        placed = dict(stage_of)
    else:
        placed = {"output": len(subsets) - 1}
        matcher = difflib.SequenceMatcher(None, [_key(n) for n in src], [_key(n) for n in dst], autojunk=False)
        for block in matcher.get_matching_blocks():
            for j in range(block.size):
                s = stage_of.get(src[block.a + j].name)
                if s is not None:
                    placed[dst[block.b + j].name] = s
    _place_by_readers(dst, placed, len(subsets) - 1)
    _no_earlier_than_inputs(dst, placed)
    out = [set() for _ in subsets]
    for name, s in placed.items():
        out[s].add(name)
    return out


def _place_by_readers(nodes: list[fx.Node], placed: dict[str, int], last: int) -> None:
    for node in reversed(nodes):
        if node.name not in placed:
            placed[node.name] = min((placed[u.name] for u in node.users if u.name in placed), default=last)


def _no_earlier_than_inputs(nodes: list[fx.Node], placed: dict[str, int]) -> None:
    for node in nodes:
        sources = [placed[a.name] for a in node.all_input_nodes if a.name in placed]
        placed[node.name] = max([placed[node.name], *sources])
