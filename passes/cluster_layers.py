"""Pass 3, cluster_layers: find repeated blocks (identical transformer layers) in the captured graph.

Input:  a ``ModelGraph`` whose call_function nodes carry ``meta["nn_module_stack"]`` (torch.export sets it).
Output: ``RepeatedBlocks``: for each node inside a repeated block, (class id, instance index, position).

An *instance* is the set of nodes whose outermost indexed module path is ``<prefix>.<i>`` (an element of
a ModuleList/Sequential, e.g. ``blocks.3`` or ``transformer.h.3``). Two instances belong to one *class*
when their node sequences match exactly: same ops, same shapes and dtypes, same wiring (a reference inside
the instance is written as its position; one leaving it as its kind and shape). Invariant: nodes of one
class at the same position have identical strategy lists, so the ILP may give them one shared variable.
"""
from __future__ import annotations

import dataclasses
import re

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
    """Group nodes into module instances, then instances with equal signatures into classes."""
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
        return ("ext", a.op, shape)

    sig = []
    for n in nodes:
        val = n.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else [val]
        meta = tuple((tuple(v.shape), str(v.dtype)) for v in vals if isinstance(v, torch.Tensor))
        sig.append((str(n.target), str(pytree.tree_map(ref, (n.args, n.kwargs))), meta))
    return tuple(sig)
