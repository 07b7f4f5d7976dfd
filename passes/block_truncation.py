"""Truncated repeated blocks: a scope's ILP built from the first two instances of each block class.

Of a repeated-block class with n ≥ 3 instances wholly inside the scope only instances 0 and 1 are built;
instance 1 stands for instances 1..n-1 (it counts n-1 times), readers of later instances read the matching
node of instance 1, and the dropped nodes take instance 1's strategy. Since an edge into instance 1 stands
for each j-1 -> j crossing, edges take their reader's weight (``intra_op_groups.GroupBuilder``). A parameter
read only by dropped nodes is priced as the twin reader's input.
"""
from __future__ import annotations


def truncation(graph, blocks, subset: set[str] | None = None) -> tuple[dict[str, str], dict[str, int]]:
    """(dropped node -> its instance-1 twin, instance-1 node -> how many instances it stands for), over
    the instances that lie wholly inside ``subset`` (all of them when None); cached per graph and subset."""
    key = frozenset(subset) if subset is not None else None
    cache = graph.__dict__.setdefault("_truncations", {})
    if key in cache:
        return cache[key]
    alias, stands_for = {}, {}
    for all_instances in blocks.instances.values():
        instances = [inst for inst in all_instances if subset is None or all(n in subset for n in inst)]
        if len(instances) < 3:
            continue
        for pos, name in enumerate(instances[1]):
            stands_for[name] = len(instances) - 1
        for inst in instances[2:]:
            for pos, name in enumerate(inst):
                alias[name] = instances[1][pos]
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    for node in graph.gm.graph.nodes:  # parameters read only by dropped nodes: the twin reader's input
        if node.op == "placeholder" and node.users and all(u.name in alias for u in node.users):
            reader = next(iter(node.users))
            idx = graph.view(reader).tensor_args.index(node)
            alias[node.name] = graph.view(nodes[alias[reader.name]]).tensor_args[idx].name
    cache[key] = (alias, stands_for)
    return cache[key]
