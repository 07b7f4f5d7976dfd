"""Activation recompute on a generated per-rank module: outline each tagged region, run it under checkpoint.

Input:  an ``fx.GraphModule`` whose nodes carry ``meta["recompute"]`` = a region key (a layer index, or
        ``(layer, "selective", n)`` for one attention core) on the nodes to recompute; untagged nodes stay.
Output: the same module where each maximal run of consecutive nodes with one key is replaced by one
        ``call_module`` to a ``Recomputed`` wrapper, which calls the outlined body through
        ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.

Why checkpoint on outlined fx regions (not an fx-level recompute that copies forward nodes into backward):
autopar never builds a backward graph; autograd differentiates the generated code. Non-reentrant checkpoint
drops every tensor the region's autograd nodes would save, keeps only the region's inputs, and re-runs the
body when backward first needs one of them. The body is plain generated code, so its collectives (the
all-reduces and all-gathers of tensor parallelism, with their group keys and the fault guard's timeout)
run again in backward, and every rank of the stage replays them at the same point of its backward, because
all ranks run the same graph and autograd visits it in the same order.

Invariants: a region's inputs are the values defined outside it that its nodes read (parameters arrive as
inputs, so they stay registered once, on the root); its outputs are the values read after it. Region
bodies hold no placeholders, get_attr or output nodes. The RNG state is saved at the first run and restored
for the replay (``preserve_rng_state=True``, CPU and the device's generator), so dropout draws the same mask.
"""
from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint


class Recomputed(torch.nn.Module):
    """Runs ``body`` so that its activations are recomputed in backward instead of kept. ``plain_inputs``
    (set by ZeRO-3, ``runtime.zero3_graph``): the inputs checkpoint keeps for the replay are kept by
    reference, outside the saved-tensor hooks the module runs under; the body's own ``ensure`` nodes
    gather the units they belong to when backward replays it."""

    plain_inputs = False

    def __init__(self, body: fx.GraphModule):
        super().__init__()
        self.body = body

    def forward(self, *args):
        with torch.autograd.graph.saved_tensors_hooks(_same, _same) if self.plain_inputs else contextlib.nullcontext():
            return checkpoint(self.body, *args, use_reentrant=False, preserve_rng_state=True)


def _same(t):
    return t


def _runs(graph: fx.Graph) -> list[tuple[object, list[fx.Node]]]:
    """Maximal runs of consecutive call_function nodes sharing one ``meta["recompute"]`` key."""
    runs: list[tuple[object, list[fx.Node]]] = []
    for node in graph.nodes:
        key = node.meta.get("recompute") if node.op == "call_function" else None
        if key is None:
            continue
        if runs and runs[-1][0] == key and runs[-1][1][-1].next is node:
            runs[-1][1].append(node)
        else:
            runs.append((key, [node]))
    return runs


def outline_recompute(gm: fx.GraphModule) -> list[str]:
    """Replace every tagged run by a checkpointed submodule (see module docstring); returns their names."""
    names = []
    for key, nodes in _runs(gm.graph):
        name = _module_name(gm, key)
        _outline(gm, nodes, name)
        names.append(name)
    gm.graph.lint()
    gm.recompile()
    return names


def _module_name(gm: fx.GraphModule, key) -> str:
    stem = "recompute_" + "_".join(str(part) for part in (key if isinstance(key, tuple) else (key,)))
    name, n = stem, 1
    while hasattr(gm, name):
        name, n = f"{stem}_{n}", n + 1
    return name


def _outline(gm: fx.GraphModule, nodes: list[fx.Node], name: str) -> None:
    inside = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    if not outputs:
        return
    body = fx.Graph()
    env = {a: body.placeholder(f"in_{i}") for i, a in enumerate(inputs)}
    for node in nodes:
        env[node] = body.node_copy(node, lambda a: env[a])
    body.output(tuple(env[n] for n in outputs))
    gm.add_module(name, Recomputed(fx.GraphModule(torch.nn.Module(), body, class_name="RecomputedRegion")))
    with gm.graph.inserting_before(nodes[0]):
        call = gm.graph.call_module(name, tuple(inputs))
        results = [gm.graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    for old, new in zip(outputs, results):
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in inside)
    for node in reversed(nodes):
        gm.graph.erase_node(node)
