"""Pass 3, cluster_layers: find repeated blocks (identical transformer layers) in the captured graph.

Input:  a ``ModelGraph`` whose call_function nodes carry ``meta["nn_module_stack"]`` (torch.export sets it).
Output: ``RepeatedBlocks``: for each node inside a repeated block, (class id, instance index, position);
        ``Layers`` (``cluster_layers``): the graph cut into L contiguous layers for the pipeline DP.

An *instance* is the set of nodes whose outermost indexed module path is ``<prefix>.<i>`` (an element of
a ModuleList/Sequential, e.g. ``blocks.3`` or ``transformer.h.3``). Two instances belong to one *class*
when their node sequences match exactly: same ops, same shapes and dtypes, same wiring (a reference inside
the instance is written as its position; one leaving it as its kind and shape). Invariant: nodes of one
class at the same position have identical strategy lists, so the ILP may give them one shared variable.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

_INDEXED = re.compile(r"^(.*)\.(\d+)$")


@dataclasses.dataclass
class RepeatedBlocks:
    """where[node name] = (class id, instance index within the class, position within the instance);
    instances[class id] = the instances' node-name lists, in graph order."""

    where: dict[str, tuple[str, int, int]]
    instances: dict[str, list[list[str]]]

    def class_of(self, name: str) -> str | None:
        hit = self.where.get(name)
        return hit[0] if hit else None

    def summary(self) -> str:
        return ", ".join(f"{cid}: {len(inst)}×{len(inst[0])} ops" for cid, inst in self.instances.items()) or "none"


def instance_key(node: fx.Node) -> str | None:
    """The outermost ``<prefix>.<int>`` module path in the node's module stack, if any."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _type in stack.values():
        if _INDEXED.match(path or ""):
            return path
    return None


def find_repeated_blocks(graph) -> RepeatedBlocks:
    """Group nodes into module instances, then instances with equal signatures into classes. Kept on the
    graph for its module (``graph.gm``): a pure function of it, read by every plan of the graph."""
    owner, blocks = getattr(graph, "_repeated_blocks", (None, None))
    if owner is not graph.gm:
        blocks = _find_repeated_blocks(graph)
        graph._repeated_blocks = (graph.gm, blocks)
    return blocks


def _find_repeated_blocks(graph) -> RepeatedBlocks:
    members: dict[str, list[fx.Node]] = {}
    for node in graph.gm.graph.nodes:
        if node.op == "call_function":
            key = instance_key(node)
            if key is not None:
                members.setdefault(key, []).append(node)
    by_signature: dict[tuple, list[str]] = {}
    for key, nodes in members.items():
        prefix = _INDEXED.match(key).group(1)
        by_signature.setdefault((prefix, _signature(nodes)), []).append(key)
    where, instances = {}, {}
    for n_class, ((prefix, _sig), keys) in enumerate(by_signature.items()):
        if len(keys) < 2:
            continue
        cid = f"{prefix or 'root'}#{n_class}"
        instances[cid] = [[n.name for n in members[k]] for k in keys]
        for i, k in enumerate(keys):
            for pos, n in enumerate(members[k]):
                where[n.name] = (cid, i, pos)
    return RepeatedBlocks(where, instances)


def _signature(nodes: list[fx.Node]) -> tuple:
    position = {n: i for i, n in enumerate(nodes)}

    def ref(a):
        if not isinstance(a, fx.Node):
            return a
        if a in position:
            return ("in", position[a])
        val = a.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        return ("ext", shape)  # what feeds a block from outside may differ (first block: an input)

    sig = []
    for n in nodes:
        val = n.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else [val]
        meta = tuple((tuple(v.shape), str(v.dtype)) for v in vals if isinstance(v, torch.Tensor))
        sig.append((str(n.target), str(pytree.tree_map(ref, (n.args, n.kwargs))), meta))
    return tuple(sig)


# ---- layers for the pipeline DP ---------------------------------------------------------------------

@dataclasses.dataclass
class Layers:
    """A partition of the graph into L contiguous layers (pipeline stages own whole layers).

    nodes[l]: call_function node names of layer l, in graph order; of_node[name]: the layer of every
    call_function and parameter/buffer node and of the output (a parameter read by several layers belongs
    to the first; stages that read it hold a copy). Invariant: layers are contiguous in graph order, and
    a cut never falls just before a light op (views, elementwise) or a getitem, so a matmul stays with the
    ops that follow it and a tuple with its getitems.
    """

    nodes: list[list[str]]
    of_node: dict[str, int]

    @property
    def count(self) -> int:
        return len(self.nodes)


MAX_DEFAULT_LAYERS = 16
FLOP_SLACK = 0.5  # Alpa: a layer may hold up to (1 + slack) × the average FLOPs


def cluster_layers(graph, blocks: RepeatedBlocks, n_layers: int | None = None, is_light=None) -> Layers:
    """Group ops into layers: repeated blocks evenly when the model has them, else Alpa's clustering
    (balanced FLOPs, smallest largest cut tensor) over the cut points before heavy ops."""
    seq = [n for n in graph.gm.graph.nodes if n.op == "call_function"]
    starts = _block_starts(seq, blocks)
    if len(starts) > 1 and (n_layers is None or n_layers <= len(starts)):
        count = min(len(starts), n_layers or MAX_DEFAULT_LAYERS)  # layer l holds blocks [l·n/L, (l+1)·n/L)
        cuts = [starts[(i * len(starts)) // count] for i in range(1, count)]
    else:
        cuts = _balanced_cuts(seq, graph, n_layers, is_light)
    return _assign(graph, seq, cuts)


def even_block_stages(layers: Layers, blocks: RepeatedBlocks, parts: int) -> list[tuple[int, int]] | None:
    """The layer ranges of ``parts`` pipeline stages that hold the repeated blocks evenly (stage s from block
    s·n/parts, what the model's blocks sit in stage s of Megatron's --pipeline-model-parallel-size split:
    the first also runs what comes before block 0, the last what comes after block n−1), or None where
    ``parts`` does not divide the n blocks, is below 2, or a boundary falls inside a layer of ``layers``."""
    order = {name: i for i, name in enumerate(name for names in layers.nodes for name in names)}
    firsts = sorted(((layers.of_node[inst[0]], inst[0]) for insts in blocks.instances.values() for inst in insts),
                    key=lambda hit: order[hit[1]])
    n = len(firsts)
    if parts < 2 or n < parts or n % parts:
        return None
    bounds = [0]
    for s in range(1, parts):
        layer, name = firsts[s * n // parts]
        if layers.nodes[layer][0] != name:  # the block starts inside a layer: no cut before it
            return None
        bounds.append(layer)
    bounds.append(layers.count)
    return [(a, b - 1) for a, b in zip(bounds, bounds[1:])]


def _block_starts(seq: list[fx.Node], blocks: RepeatedBlocks) -> list[int]:
    """Indices in ``seq`` where each repeated-block instance begins, in order (one per block)."""
    index = {n.name: i for i, n in enumerate(seq)}
    return sorted(index[inst[0]] for insts in blocks.instances.values() for inst in insts)


def _cut_ok(node: fx.Node, is_light) -> bool:
    import operator

    return node.target is not operator.getitem and not (is_light is not None and is_light(node))


def _balanced_cuts(seq: list[fx.Node], graph, n_layers: int | None, is_light) -> list[int]:
    from autopar.cost_models.compute import node_flops

    candidates = [i for i in range(1, len(seq)) if _cut_ok(seq[i], is_light)]
    count = min(n_layers or 8, len(candidates) + 1)
    flops = np.cumsum([0.0] + [sum(node_flops(n)) for n in seq])
    live = _live_bytes(seq)
    points = [0] + candidates + [len(seq)]
    cap = (1 + FLOP_SLACK) * flops[-1] / count
    for _ in range(8):  # relax the FLOP cap until some partition exists
        cuts = _min_max_cut(points, flops, live, count, cap)
        if cuts is not None:
            return cuts
        cap *= 1.5
    return [points[round(i * (len(points) - 1) / count)] for i in range(1, count)]


def _live_bytes(seq: list[fx.Node]) -> np.ndarray:
    """live[p]: bytes of op outputs made before position p and read at or after it."""
    index = {n: i for i, n in enumerate(seq)}
    diff = np.zeros(len(seq) + 2)
    for i, n in enumerate(seq):
        val = n.meta.get("val")
        size = sum(v.numel() * v.element_size() for v in (val if isinstance(val, (tuple, list)) else [val])
                   if isinstance(v, torch.Tensor))
        last = max((index.get(u, len(seq)) for u in n.users), default=i)
        diff[i + 1] += size
        diff[last + 1] -= size
    return np.cumsum(diff)[: len(seq) + 1]


def _min_max_cut(points: list[int], flops: np.ndarray, live: np.ndarray, count: int, cap: float):
    """DP: split ``points[0]..points[-1]`` into ``count`` layers of at most ``cap`` FLOPs, minimizing the
    largest live size at a cut. best[l][j]: that minimum for the first l layers ending at points[j]."""
    n = len(points)
    inf = float("inf")
    best = np.full((count + 1, n), inf)
    arg = np.zeros((count + 1, n), dtype=int)
    best[0][0] = 0.0
    for layer in range(1, count + 1):
        for j in range(1, n):
            for i in range(j):
                if best[layer - 1][i] == inf or flops[points[j]] - flops[points[i]] > cap:
                    continue
                cut = live[points[j]] if j < n - 1 else 0.0
                value = max(best[layer - 1][i], cut)
                if value < best[layer][j]:
                    best[layer][j], arg[layer][j] = value, i
    if best[count][n - 1] == inf:
        return None
    cuts, j = [], n - 1
    for layer in range(count, 0, -1):
        j = arg[layer][j]
        cuts.append(points[j])
    return sorted(cuts)[1:]


def _assign(graph, seq: list[fx.Node], cuts: list[int]) -> Layers:
    bounds = [0] + sorted(set(cuts)) + [len(seq)]
    nodes = [[n.name for n in seq[a:b]] for a, b in zip(bounds, bounds[1:]) if b > a]
    of_node = {name: layer for layer, names in enumerate(nodes) for name in names}
    for node in graph.gm.graph.nodes:
        if node.op == "placeholder" and node.users:
            of_node[node.name] = min(of_node[u.name] for u in node.users if u.name in of_node)
        elif node.op == "output":
            of_node[node.name] = len(nodes) - 1
    return Layers(nodes, of_node)
