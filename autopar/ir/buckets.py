"""Gradient-sync buckets of a stage: which parameters the runtime syncs once per step, in which buckets, in
which order. The planner's memory and overlap prediction (``plan_builder``) and the runtime
(``runtime.gradsync``) both build them here, so they agree by construction.
"""
from __future__ import annotations

import math

import torch.fx as fx

from autopar.ir.ops import OpView
from autopar.placement import parse_spec
from autopar.redistribute import grad_partial_axes, redistribute_steps


def deferrable_syncs(graph, stage, requires_grad: set[str]) -> dict[str, tuple[int, ...]]:
    """Parameters whose every read in ``stage`` only all-reduces the gradient, on the same mesh axes:
    {parameter: axes}. The runtime reduces those once per step, after all microbatches, instead of once
    per read (codegen then emits no collective for them)."""
    out = {}
    for node in graph.gm.graph.nodes:
        info = graph.placeholder(node.name) if node.op == "placeholder" else None
        if info is None or info.kind != "parameter" or node.name not in stage.shardings:
            continue
        chains = set()
        for user in node.users:
            if user.name in stage.shardings and user.op == "call_function":
                chains |= _sync_chains(node, user, stage, requires_grad)
        if len(chains) == 1 and None not in chains and next(iter(chains)):
            out[node.name] = next(iter(chains))
    return out


def _sync_chains(node: fx.Node, user: fx.Node, stage, requires_grad: set[str]) -> set:
    """Per read of parameter ``node`` by ``user``: the mesh axes of its gradient all-reduces, or None when
    the move does anything else."""
    sharding = stage.shardings[user.name]
    chains = set()
    for idx, arg in enumerate(OpView(user).tensor_args):
        if arg is node:
            dst, out_spec = parse_spec(sharding.ins[idx]), parse_spec(sharding.out)
            axes = grad_partial_axes(dst, out_spec) if user.name in requires_grad else ()
            steps = redistribute_steps(parse_spec(stage.shardings[node.name].out), dst, axes)
            chains.add(tuple(s.axis for s in steps) if all(s.kind == "sync_grad" for s in steps) else None)
    return chains


def bucket_layout(params: list[tuple[str, int, tuple, int]], cap_bytes: float, itemsize: int) -> list[list[str]]:
    """Buckets of gradient sync, in launch order: ``params`` are (name, numel, axes, level) in the order their
    gradients become ready (reverse order of first use); consecutive parameters with the same (axes, level)
    share a bucket until it holds ``cap_bytes`` (as DDP's ``bucket_cap_mb``)."""
    buckets, keys, sizes = [], [], []
    for name, numel, axes, level in params:
        key = (tuple(axes), level)
        if buckets and keys[-1] == key and sizes[-1] < cap_bytes:
            buckets[-1].append(name)
            sizes[-1] += numel * itemsize
        else:
            buckets.append([name])
            keys.append(key)
            sizes.append(numel * itemsize)
    return buckets


def sync_buckets(gm: fx.GraphModule, deferred: dict[str, tuple], levels: dict[str, int], mesh_shape,
                 local_numel: dict[str, int], cap_bytes: float, itemsize: int = 4) -> list[dict]:
    """The gradient-sync buckets of one stage, shared by the planner's prediction and the runtime:
    ``deferred`` {parameter: mesh axes its gradient is all-reduced over}, in reverse order of first use
    (the order backward produces gradients). Each: {names, numel, ways, level, axes, count}."""
    position = {}
    for i, node in enumerate(gm.graph.nodes):
        for arg in node.all_input_nodes:
            position.setdefault(arg.name, i)
    order = sorted(deferred, key=lambda n: (-position.get(n, 0), n))
    rows = [(n, local_numel[n], tuple(deferred[n]), levels.get(n, 0)) for n in order]
    out = []
    for names in bucket_layout(rows, cap_bytes, itemsize):
        axes, level = tuple(deferred[names[0]]), levels.get(names[0], 0)
        ways = int(math.prod(mesh_shape[a] for a in axes))
        out.append({"names": names, "numel": sum(local_numel[n] for n in names), "ways": ways,
                    "level": level if ways > 1 else 0, "axes": axes, "count": len(names)})
    return out


def padded_numel(numel: int, ways: int, level: int) -> int:
    """Elements of a bucket's flat buffer: ``numel``, padded for ZeRO (level ≥ 1) to ``ways`` equal shards."""
    return numel if level == 0 else -(-numel // ways) * ways


def parameter_sources(graph: fx.Graph, unit_of: dict[str, int], param_op: str) -> dict[fx.Node, set[int]]:
    """ZeRO-3: {node holding unit parameters: their units}: the parameter nodes (``unit_of``: {node name of
    op ``param_op``, "get_attr" in a generated module or "placeholder" in the captured graph: its unit})
    and the nodes computed from them only (a view or a cast of a weight, which may alias its storage)."""
    sources: dict[fx.Node, set[int]] = {}
    for node in graph.nodes:
        if node.op == param_op and node.name in unit_of:
            sources[node] = {unit_of[node.name]}
        elif node.op in ("call_function", "call_method") and node.all_input_nodes and all(
                a in sources for a in node.all_input_nodes):
            sources[node] = set().union(*(sources[a] for a in node.all_input_nodes))
    return sources


def unit_spans(graph: fx.Graph, unit_of: dict[str, int], param_op: str) -> dict[int, tuple[fx.Node, fx.Node]]:
    """ZeRO-3: {unit: (first, last) node reading its parameters}, in graph order: the users of its
    ``parameter_sources`` (the output node among them). The runtime gathers a unit before ``first`` and
    frees it after ``last``; the planner sums the units gathered at once over the same spans."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    spans: dict[int, tuple[fx.Node, fx.Node]] = {}
    for node, units in parameter_sources(graph, unit_of, param_op).items():
        for user in node.users:
            for unit in units:
                first, last = spans.get(unit, (user, user))
                spans[unit] = (min(first, user, key=order.get), max(last, user, key=order.get))
    return spans


def prefetch_spans(spans: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """ZeRO-3's forward prefetch: {unit: (issue, last)} for ``spans`` {unit: (first, last) reader position}.

    Units in order of first read u_1, u_2, ...: u_1's all-gather is issued at its first read (nothing runs
    before it to hide it behind); u_{j+1}'s at u_j's first read, or later, just after the last position
    where two earlier units are still gathered, so that from its issue to its first read at most one other
    unit is gathered or in flight; at the latest at its own first read (then it is not prefetched). A unit
    is held from its issue to its last read. The runtime issues the all-gather before the node at ``issue``
    and waits for it before the node at ``first``; the planner sums the units held over these spans
    (``peak_gathered``), so both see the same peak."""
    order = sorted(spans, key=lambda u: (spans[u][0], u))
    out: dict[int, tuple[int, int]] = {}
    held: list[tuple[int, int]] = []
    for j, unit in enumerate(order):
        first, last = spans[unit]
        issue = first
        if j > 0:
            start = spans[order[j - 1]][0]
            held = [(a, b) for a, b in held if b >= start]
            issue = _earliest_issue(held, start, first)
        out[unit] = (issue, last)
        held.append((issue, last))
    return out


def _earliest_issue(held: list[tuple[int, int]], start: int, first: int) -> int:
    """The earliest t in [start, first] such that at most one interval of ``held`` covers any position of
    [t, first − 1]: one past the last position before ``first`` that two of them cover, else ``start``."""
    if start >= first:
        return first
    candidates = [first - 1] + [b for _, b in held if start <= b < first - 1]
    blocked = [t for t in candidates if sum(a <= t <= b for a, b in held) >= 2]
    return max(blocked) + 1 if blocked else start


def peak_gathered(spans: dict[int, tuple[int, int]], nbytes: dict[int, float]) -> float:
    """The most bytes of ZeRO-3 units gathered at once: ``spans`` {unit: (first, last) position it is held}."""
    events = sorted([(a, 0, nbytes[u]) for u, (a, _) in spans.items()]
                    + [(b, 1, -nbytes[u]) for u, (_, b) in spans.items()])
    peak = held = 0.0
    for _, _, delta in events:
        held += delta
        peak = max(peak, held)
    return peak
