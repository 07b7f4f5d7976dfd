"""Price vectors of groups and resharding matrices between them (see ``intra_op_groups`` for the terms).

``price_groups``: each group's cost/comm/sync/memory/peak per leader strategy, including the edges inside
the group and from single-strategy groups. ``edge_matrices``: [source strategy, reader strategy] seconds
for every pair of groups with variables. ``shared_sync_rebates``: refunds for all-reduces that codegen
shares between readers of one value. Matrices depend only on the two groups' structure, so edges of
identical layers are priced once.
"""
from __future__ import annotations

import numpy as np

from autopar.cost_models.compute import local_bytes
from autopar.cost_models.offload import activation_swap_seconds
from autopar.ir.shard_boxes import send_spec
from autopar.redistribute import grad_partial_axes

PRICE_FIELDS = ("cost", "comm", "sync", "mem_param", "mem_act", "peak")


def price_groups(b) -> None:
    """Fill every group's price vectors; structurally identical groups (identical layers) are priced once."""
    done: dict[tuple, object] = {}
    for g, group in enumerate(b.groups):
        key = _structure(b, g, group)
        twin = done.get(key)
        if twin is not None:
            for field in PRICE_FIELDS:
                setattr(group, field, getattr(twin, field).copy())
            continue
        n = len(group.pick)
        for field in PRICE_FIELDS:
            setattr(group, field, np.zeros(n))
        for i, pick in enumerate(group.pick):
            for name in group.members:
                _price_member(b, group, i, pick, name)
        done[key] = group


def _structure(b, g: int, group) -> tuple:
    """What a group's prices depend on: its members' signatures and roles, its picks, and for every input
    whether it comes from this group, from a fixed group (and which spec), or from another group."""
    members = []
    for name in group.members:
        view = b.views.get(name)
        inputs = ()
        if view is not None:
            inputs = tuple(_input_role(b, g, arg) for arg in view.tensor_args)
        members.append((b.sig[name], b.send_scale.get(name, 0.0), name in b.boundary, name in b.params,
                        name in b.requires_grad, b.saved.get(name, 0.0), b.casts.get(name, ()), inputs))
    return tuple(members), tuple(tuple(p[m] for m in group.members) for p in group.pick)


def _input_role(b, g: int, arg) -> tuple:
    h = b.group_of[arg.name]
    if h == g:
        return ("same", group_position(b.groups[g], arg.name), arg.name in b.requires_grad)
    if len(b.groups[h].pick) == 1:
        return ("fixed", b.sig[arg.name], b._spec_id_in_pick(arg.name, b.groups[h].pick[0]),
                arg.name in b.requires_grad)
    return ("other",)


def group_position(group, name: str) -> int:
    return group.members.index(name)


def _price_member(b, group, i: int, pick: dict, name: str) -> None:
    strat = b.strategies[name][pick[name]]
    t, c = b.node_time_k(name, pick[name])
    group.cost[i] += t
    group.comm[i] += c
    param, act = b.node_memory(name, strat)
    if act and b.env.training.host_activations:  # swapped to host memory and back (cost_models.offload)
        mb = b.env.microbatches
        group.cost[i] += mb * activation_swap_seconds(act / b.env.inflight, t / mb, b.env.cluster)
        act = 0.0
    group.mem_param[i] += param
    group.mem_act[i] += act
    if name in b.sends:
        send = _send_preparation(b, name, strat) * b.send_scale.get(name, 1.0)
        group.cost[i] += send
        group.comm[i] += send
    view = b.views.get(name)
    if view is None:
        return
    out_bytes = sum(local_bytes(v, strat.out_spec, b.env.mesh_shape) for v in view.out_vals)
    widened = max((ratio * local_bytes(view.in_vals[idx], strat.in_specs[idx], b.env.mesh_shape)
                   for idx, ratio in b.casts.get(name, ()) if idx < len(view.in_vals)), default=0.0)
    group.peak[i] = max(group.peak[i], 2.0 * out_bytes, 2.0 * widened)  # cost_models.memory: transient
    node = b.nodes[name]
    for idx, arg in enumerate(view.tensor_args):
        g_arg = b.group_of[arg.name]
        if g_arg == b.group_of[name] or len(b.groups[g_arg].pick) == 1:
            mb, st = b.edge_time_id(arg, node, idx, b._spec_in_pick(arg.name, pick), b._spec_id_in_pick(arg.name, pick),
                                    pick[name])
            group.cost[i] += mb + st
            group.comm[i] += mb + st
            group.sync[i] += st


def _send_preparation(b, name: str, strat) -> float:
    """A value read by a later stage has its Partial axes reduced and its Replicate axes split before it is
    sent shard to shard; the split's backward all-gathers the gradient (``autopar.ir.shard_boxes.send_spec``)."""
    val = b.nodes[name].meta["val"]
    whole = send_spec(tuple(val.shape), strat.out_spec, b.env.mesh_shape, val.dtype.is_floating_point)
    needs_grad = name in b.requires_grad
    fwd, bwd = b.env.reshard(val, strat.out_spec, whole, (), needs_grad)
    return b.env.microbatches * (fwd + bwd)


def edge_matrices(b) -> dict[tuple[int, int], np.ndarray]:
    """Resharding matrices between groups with variables: [source strategy, reader strategy]."""
    edges: dict[tuple[int, int], np.ndarray] = {}
    cache: dict[tuple, np.ndarray] = {}
    for node in b.order:
        if node.op == "placeholder" or node.name in b.boundary:
            continue
        gv = b.group_of[node.name]
        view = b.views[node.name]
        for idx, arg in enumerate(view.tensor_args):
            gu = b.group_of[arg.name]
            if gu == gv or len(b.groups[gu].pick) == 1:
                continue
            src_picks = tuple(p[arg.name] for p in b.groups[gu].pick)
            dst_picks = tuple(p[node.name] for p in b.groups[gv].pick)
            key = (b.sig[arg.name], b.sig[node.name], idx, src_picks, dst_picks, b._grad_flags(node, view))
            m = cache.get(key)
            if m is None:
                m = cache[key] = _edge_matrix(b, arg, node, idx, src_picks, dst_picks)
            edges[(gu, gv)] = edges.get((gu, gv), 0) + m
    return edges


def _edge_matrix(b, arg, node, idx, src_picks, dst_picks) -> np.ndarray:
    """Price each distinct (source layout, read layout + gradient axes) pair once, then broadcast. Layouts
    are compared by ``spec_id`` (equal numbers, equal specs), never hashed here."""
    src_ids = [b.strategy_spec_ids(arg.name)[ku][1] for ku in src_picks]
    src_spec = {sid: b.strategies[arg.name][ku].out_spec for sid, ku in zip(src_ids, src_picks)}
    strategies, read_ids = b.strategies[node.name], b.strategy_spec_ids(node.name)
    reads = [(read_ids[kv][0][idx], grad_partial_axes(strategies[kv].in_specs[idx], strategies[kv].out_spec))
             for kv in dst_picks]
    first_k: dict = {}
    for kv, read in zip(dst_picks, reads):
        first_k.setdefault(read, kv)
    rows = {}
    for sid in dict.fromkeys(src_ids):
        price = {read: sum(b.edge_time_id(arg, node, idx, src_spec[sid], sid, kv)) for read, kv in first_k.items()}
        rows[sid] = np.array([price[read] for read in reads])
    return np.stack([rows[sid] for sid in src_ids])


def shared_sync_rebates(b) -> dict[tuple[int, int], np.ndarray]:
    """Refunds for gradient all-reduces that codegen shares between readers of one value.

    Readers of u that read it in the same spec with the same Partial-gradient axes share one
    redistribution (``runtime.codegen._Emitter._input``): one backward all-reduce of their summed gradients.
    Each edge was priced with its own all-reduce, so consecutive readers (c_m, c_m+1) get an edge whose
    entry is minus one all-reduce when both strategies agree on (spec, axes).
    """
    rebates: dict[tuple[int, int], np.ndarray] = {}
    for u in b.order:
        readers = [c for c in b.users_in_scope(u) if c.op == "call_function" and c.name in b.requires_grad]
        if u.name not in b.requires_grad or len(readers) < 2 or u.name in b.absorbed:
            continue
        for c1, c2 in zip(readers, readers[1:]):
            g1, g2 = b.group_of[c1.name], b.group_of[c2.name]
            if g1 == g2 or len(b.groups[g1].pick) == 1 or len(b.groups[g2].pick) == 1:
                continue
            m = _rebate_matrix(b, u, c1, c2, g1, g2)
            if m is not None:
                rebates[(g1, g2)] = rebates.get((g1, g2), 0) + m
    return rebates


def _rebate_matrix(b, u, c1, c2, g1, g2) -> np.ndarray | None:
    """[i, j] = minus one all-reduce where c1's i-th and c2's j-th strategy read u alike (same spec, same
    Partial-gradient axes, not none). Read keys are numbered once, so the pairs compare as integers."""
    keys, spec_of = [], {}  # reads keyed by ``spec_id``; spec_of: the spec of each number
    for c, g in ((c1, g1), (c2, g2)):
        idx = b.views[c.name].tensor_args.index(u)
        strategies, ids = b.strategies[c.name], b.strategy_spec_ids(c.name)
        row = []
        for k in (p[c.name] for p in b.groups[g].pick):
            spec_of.setdefault(ids[k][0][idx], strategies[k].in_specs[idx])
            row.append((ids[k][0][idx], grad_partial_axes(strategies[k].in_specs[idx], strategies[k].out_spec)))
        keys.append(row)
    val = b.views[c1.name].in_vals[b.views[c1.name].tensor_args.index(u)]
    number: dict = {}
    first = np.array([number.setdefault(key, len(number)) for key in keys[0]])
    second = np.array([number.get(key, -1) for key in keys[1]])
    refund = np.zeros(len(number))
    for (dst1, axes1), n in number.items():
        if not axes1:
            continue
        nbytes = local_bytes(val, spec_of[dst1], b.env.mesh_shape)
        if u.name in b.params:  # a parameter's sync: once per step, bucketed (GroupBuilder.edge_time)
            refund[n] = sum(b.env.links[a].bandwidth_time("all_reduce", nbytes) for a in axes1)
        else:
            refund[n] = b.env.microbatches * sum(b.env.links[a].time("all_reduce", nbytes) for a in axes1)
    m = np.where(first[:, None] == second[None, :], -refund[first][:, None], 0.0)
    return m if m.any() else None
