"""Pass 4, intra_op: choose one sharding strategy per node with the ILP of ``passes/ilp.py``.

Input:  ``ModelGraph``, strategies per node (``passes/strategies``), ``RepeatedBlocks``, a ``CostEnv``.
Output: ``IntraOpSolution``: a ``Strategy`` per node, the predicted per-step time split into compute
and communication, and the per-device memory.

How the ILP stays small (invariants):
  * a *group* is one decision: its leader's strategy index fixes every member's strategy. Members are
    light ops (views, elementwise, casts) whose tensor inputs all come from the group, and placeholders
    with a single consumer (they are stored exactly as that consumer reads them, so they add no edge);
  * each light member takes, for every leader strategy, its cheapest strategy given its inputs' specs;
  * groups at the same position in instances of one repeated-block class form one ILP *class*: costs
    and edges add up over instances, and identical layers get one shared solution;
  * nodes with a single strategy (factories, the output) are fixed groups without variables.

Objective (seconds per training step, B = microbatches): B · (compute + activation communication) +
gradient synchronization of parameters (once per step, as the runtime does it after backward).
"""
from __future__ import annotations

import dataclasses
import operator

import numpy as np
import torch
import torch.fx as fx

from autopar.cluster import Cluster
from autopar.passes.ilp import IlpProblem, IlpResult, evaluate, memory_of, solve_ilp
from autopar.passes.strategies.base import OpView, Strategy
from autopar.placement import R, local_shape
from autopar.redistribute import grad_partial_axes
from autopar.cost_models.communication import axis_links, redistribute_cost
from autopar.cost_models.compute import compute_time, is_free_view, local_bytes, node_signature
from autopar.cost_models.memory import TrainingSpec, requires_grad_nodes, saved_nodes

aten = torch.ops.aten


@dataclasses.dataclass
class CostEnv:
    """Everything that prices strategies on one logical mesh.

    microbatches: B, the number of microbatches per step (1 without pipelining);
    inflight: how many microbatches' activations are alive at once (1F1B stage s of S: S - s).
    devices_per_node: width of the physical submesh (defaults to the cluster's node width).
    """

    cluster: Cluster
    mesh_shape: tuple[int, int]
    training: TrainingSpec = dataclasses.field(default_factory=TrainingSpec)
    microbatches: int = 1
    inflight: int = 1
    devices_per_node: int | None = None

    def __post_init__(self):
        self.links = axis_links(self.cluster, self.mesh_shape, self.devices_per_node)
        self._reshard_cache: dict = {}

    def reshard(self, val: torch.Tensor, src, dst, grad_axes, needs_grad: bool) -> tuple[float, float]:
        key = (tuple(val.shape), val.dtype, src, dst, grad_axes, needs_grad)
        hit = self._reshard_cache.get(key)
        if hit is None:
            hit = redistribute_cost(tuple(val.shape), val.element_size(), src, dst, self.mesh_shape, self.links,
                                    grad_axes, needs_grad)
            self._reshard_cache[key] = hit
        return hit


@dataclasses.dataclass
class IntraOpSolution:
    """The chosen strategy per node and what the cost model predicts for it (per training step)."""

    mesh_shape: tuple[int, int]
    strategies: dict[str, Strategy]
    step_time: float
    compute_time: float
    comm_time: float
    memory: float
    ilp: IlpResult


def _light_packets() -> frozenset:
    from autopar.passes.strategies import pointwise

    light = set(pointwise.NONLINEAR) | set(pointwise.SUMS) | set(pointwise.SCALES) | set(pointwise.COPIES)
    return frozenset(light | {aten.reshape, aten.flatten, aten.unflatten, aten.contiguous, aten.clone})


_LIGHT = _light_packets()


def is_light(node: fx.Node) -> bool:
    """Views, elementwise ops and casts: cheap ops that follow their producer's layout."""
    if node.op != "call_function":
        return False
    if is_free_view(node) or node.target is operator.getitem:
        return True
    return getattr(node.target, "overloadpacket", None) in _LIGHT


@dataclasses.dataclass
class Group:
    leader: str
    members: list[str]
    pick: list[dict[str, int]]          # per leader strategy: member name -> its strategy index
    cost: np.ndarray = None             # seconds per step, per leader strategy
    comm: np.ndarray = None             # the communication part of cost
    mem: np.ndarray = None              # bytes that stay allocated, per leader strategy
    peak: np.ndarray = None             # largest transient (an output and its gradient), per strategy


class _Builder:
    """Builds groups, their costs and the inter-group resharding matrices for one graph and mesh."""

    def __init__(self, graph, strategies: dict[str, list[Strategy]], env: CostEnv):
        self.graph, self.strategies, self.env = graph, strategies, env
        self.nodes = {n.name: n for n in graph.gm.graph.nodes}
        trainable = {p.name for p in graph.placeholders if p.kind == "parameter"}
        self.params = trainable
        self.requires_grad = requires_grad_nodes(graph.gm, trainable)
        self.saved = saved_nodes(graph.gm, self.requires_grad)
        self.group_of: dict[str, int] = {}
        self.groups: list[Group] = []
        self.absorbed: dict[str, str] = {}
        self.views = {n.name: OpView(n) for n in graph.gm.graph.nodes if n.op != "placeholder"}
        # Caches keyed by structural signatures, so identical layers are priced once.
        self.sig = {n.name: node_signature(n) if n.op != "output" else "output" for n in graph.gm.graph.nodes}
        self._node_time: dict[tuple, tuple[float, float]] = {}
        self._edge_time: dict[tuple, tuple[float, float]] = {}
        self._follow: dict[tuple, int] = {}

    # ---- grouping --------------------------------------------------------------------------------
    def build_groups(self) -> None:
        absorbed = self.absorbed = self._single_use_placeholders()
        for node in self.graph.gm.graph.nodes:
            if node.op == "placeholder" and node.name in absorbed:
                continue
            owners = self._owner_groups(node, absorbed)
            if is_light(node) and len(owners) == 1 and len(self.strategies[node.name]) > 1:
                self._join(owners.pop(), node, absorbed)
            else:
                self._lead(node, absorbed)

    def _single_use_placeholders(self) -> dict[str, str]:
        """Placeholders read by exactly one node, once: {placeholder: consumer}."""
        out = {}
        for node in self.graph.gm.graph.nodes:
            if node.op != "placeholder" or len(node.users) != 1:
                continue
            user = next(iter(node.users))
            if user.op == "call_function" and OpView(user).tensor_args.count(node) == 1:
                out[node.name] = user.name
        return out

    def _owner_groups(self, node: fx.Node, absorbed) -> set[int]:
        owners = set()
        for arg in self.views[node.name].tensor_args if node.op != "placeholder" else []:
            if arg.name in absorbed:
                continue
            g = self.group_of[arg.name]
            if len(self.groups[g].pick) > 1:
                owners.add(g)
        return owners

    def _lead(self, node: fx.Node, absorbed) -> None:
        n = len(self.strategies[node.name])
        group = Group(node.name, [node.name], [{node.name: i} for i in range(n)])
        self.groups.append(group)
        self.group_of[node.name] = len(self.groups) - 1
        self._absorb_inputs(group, node, absorbed)

    def _join(self, g: int, node: fx.Node, absorbed) -> None:
        group = self.groups[g]
        view = self.views[node.name]
        for i, pick in enumerate(group.pick):
            srcs = tuple(None if self.absorbed.get(a.name) == node.name else self._spec_in_pick(a.name, pick)
                         for a in view.tensor_args)
            key = (self.sig[node.name], srcs, self._grad_flags(node, view))
            if key not in self._follow:
                self._follow[key] = self._cheapest(node, view, srcs)
            pick[node.name] = self._follow[key]
        group.members.append(node.name)
        self.group_of[node.name] = g
        self._absorb_inputs(group, node, absorbed)

    def _absorb_inputs(self, group: Group, node: fx.Node, absorbed) -> None:
        if node.op != "call_function":
            return
        view = self.views[node.name]
        for idx, arg in enumerate(view.tensor_args):
            if absorbed.get(arg.name) != node.name:
                continue
            options = {s.out_spec: k for k, s in enumerate(self.strategies[arg.name])}
            for pick in group.pick:
                wanted = self.strategies[node.name][pick[node.name]].in_specs[idx]
                stored = tuple(R if p.is_partial() else p for p in wanted)  # inputs are never stored Partial
                pick[arg.name] = options[stored]
            group.members.append(arg.name)
            self.group_of[arg.name] = self.group_of[node.name]

    def _spec_in_pick(self, name: str, pick: dict[str, int]):
        if name in pick:
            return self.strategies[name][pick[name]].out_spec
        g = self.groups[self.group_of[name]]
        assert len(g.pick) == 1, f"{name} is outside the group and not fixed"
        return self.strategies[name][g.pick[0][name]].out_spec

    def _cheapest(self, node: fx.Node, view: OpView, srcs: tuple) -> int:
        """argmin_k local cost. Fast path: a strategy reading every input as it comes costs only its own
        op; if that is no more than the cheapest op time of any strategy (a lower bound on every cost),
        it is the argmin and the other strategies need no pricing."""
        strategies = self.strategies[node.name]
        floor = min(self.node_time_k(node.name, k)[0] for k in range(len(strategies)))
        for k, strat in enumerate(strategies):
            if all(src is None or src == dst for src, dst in zip(srcs, strat.in_specs)):
                cost = self._local_cost(node, view, k, srcs)
                if cost <= floor:
                    return k
        return int(np.argmin([self._local_cost(node, view, k, srcs) for k in range(len(strategies))]))

    def _local_cost(self, node, view, k, srcs) -> float:
        """Cost of strategy k given its inputs' specs (None: an absorbed placeholder, stored as read)."""
        total = self.node_time_k(node.name, k)[0]
        for idx, (arg, src) in enumerate(zip(view.tensor_args, srcs)):
            if src is not None:
                total += sum(self.edge_time_k(arg, node, idx, src, k))
        return total

    def _grad_flags(self, node, view) -> tuple:
        return (node.name in self.requires_grad,) + tuple(
            (a.name in self.requires_grad, a.name in self.params) for a in view.tensor_args)

    # ---- prices ----------------------------------------------------------------------------------
    def node_time_k(self, name: str, k: int) -> tuple[float, float]:
        key = (self.sig[name], k, name in self.requires_grad)
        if key not in self._node_time:
            node = self.nodes[name]
            view = self.views.get(name)
            self._node_time[key] = self.node_time(node, view, self.strategies[name][k]) if view else (0.0, 0.0)
        return self._node_time[key]

    def node_time(self, node: fx.Node, view: OpView, strat: Strategy) -> tuple[float, float]:
        """(seconds per step, of which communication) of the op itself under ``strat``."""
        if node.op != "call_function":
            return 0.0, 0.0
        env = self.env
        t = compute_time(node, strat, view.in_vals, view.out_vals, env.mesh_shape, env.cluster,
                         node.name in self.requires_grad)
        comm = sum(self._kernel_comm(view, axis, tag) for axis, tag in strat.kernels)
        return env.microbatches * (t + comm), env.microbatches * comm

    def _kernel_comm(self, view: OpView, axis: int, tag: str) -> float:
        link = self.env.links[axis]
        if tag == "ce_class":  # max, sum-exp and target logit of the local rows
            rows = view.in_shapes[0][0]
            return 3 * link.time("all_reduce", rows * 4)
        if tag == "ce_batch":
            return link.time("all_reduce", 8)
        return 0.0

    def edge_time_k(self, arg: fx.Node, node: fx.Node, idx: int, src, k: int) -> tuple[float, float]:
        """``edge_time`` for the node's k-th strategy, cached by structure (signature, input, specs, flags)."""
        key = (self.sig[node.name], idx, src, k, arg.name in self.requires_grad, node.name in self.requires_grad,
               arg.name in self.params)
        hit = self._edge_time.get(key)
        if hit is None:
            hit = self._edge_time[key] = self.edge_time(arg, node, idx, src, self.strategies[node.name][k])
        return hit

    def edge_time(self, arg: fx.Node, node: fx.Node, idx: int, src, strat: Strategy) -> tuple[float, float]:
        """(per-step seconds from per-microbatch traffic, per-step seconds of gradient sync) of one input."""
        dst = strat.in_specs[idx]
        if src == dst and not (arg.name in self.requires_grad and grad_partial_axes(dst, strat.out_spec)):
            return 0.0, 0.0
        val = self.views[node.name].in_vals[idx]
        needs_grad = arg.name in self.requires_grad and node.name in self.requires_grad
        grad_axes = grad_partial_axes(dst, strat.out_spec) if needs_grad else ()
        fwd, bwd = self.env.reshard(val, src, dst, grad_axes, needs_grad)
        if arg.name in self.params:
            return self.env.microbatches * fwd, bwd
        return self.env.microbatches * (fwd + bwd), 0.0

    def node_memory(self, name: str, strat: Strategy) -> float:
        node = self.nodes[name]
        val = node.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else [val]
        if node.op == "placeholder" and name in self.params:
            numel = np.prod(local_shape(tuple(val.shape), strat.out_spec, self.env.mesh_shape))
            return float(numel) * self.env.training.param_state_bytes_per_element(val.dtype)
        share = self.saved.get(name, 0.0)
        if not share:
            return 0.0
        return share * self.env.inflight * sum(local_bytes(v, strat.out_spec, self.env.mesh_shape) for v in vals)

    # ---- group vectors ---------------------------------------------------------------------------
    def price_groups(self) -> None:
        for group in self.groups:
            n = len(group.pick)
            group.cost, group.comm, group.mem, group.peak = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
            for i, pick in enumerate(group.pick):
                for name in group.members:
                    strat = self.strategies[name][pick[name]]
                    node = self.nodes[name]
                    view = self.views.get(name)
                    t, c = self.node_time_k(name, pick[name])
                    group.cost[i] += t
                    group.comm[i] += c
                    group.mem[i] += self.node_memory(name, strat)
                    if view is None:
                        continue
                    out_bytes = sum(local_bytes(v, strat.out_spec, self.env.mesh_shape) for v in view.out_vals)
                    group.peak[i] = max(group.peak[i], 2.0 * out_bytes)
                    for idx, arg in enumerate(view.tensor_args):
                        if self.group_of[arg.name] == self.group_of[name] or len(self.groups[self.group_of[arg.name]].pick) == 1:
                            mb, st = self.edge_time_k(arg, node, idx, self._spec_in_pick(arg.name, pick), pick[name])
                            group.cost[i] += mb + st
                            group.comm[i] += mb + st

    def edge_matrices(self) -> dict[tuple[int, int], np.ndarray]:
        """Resharding matrices between groups with variables: [src strategy, dst strategy].

        A matrix depends only on the two groups' structure, so edges of identical layers share one.
        """
        edges: dict[tuple[int, int], np.ndarray] = {}
        cache: dict[tuple, np.ndarray] = {}
        for node in self.graph.gm.graph.nodes:
            if node.op == "placeholder":
                continue
            gv = self.group_of[node.name]
            view = self.views[node.name]
            for idx, arg in enumerate(view.tensor_args):
                gu = self.group_of[arg.name]
                if gu == gv or len(self.groups[gu].pick) == 1:
                    continue
                src_picks = tuple(p[arg.name] for p in self.groups[gu].pick)
                dst_picks = tuple(p[node.name] for p in self.groups[gv].pick)
                key = (self.sig[arg.name], self.sig[node.name], idx, src_picks, dst_picks,
                       self._grad_flags(node, view))
                m = cache.get(key)
                if m is None:
                    m = cache[key] = self._edge_matrix(arg, node, idx, src_picks, dst_picks)
                edges[(gu, gv)] = edges.get((gu, gv), 0) + m
        return edges

    def shared_sync_rebates(self) -> dict[tuple[int, int], np.ndarray]:
        """Refunds for gradient all-reduces that codegen shares between readers of one value.

        Readers of u that read it in the same spec with the same Partial-gradient axes share one
        redistribution (``codegen._Emitter._input``): one backward all-reduce of their summed
        gradients. Each edge was priced with its own all-reduce, so consecutive readers (c_m, c_m+1)
        get an edge whose entry is minus one all-reduce when both strategies agree on (spec, axes).
        """
        rebates: dict[tuple[int, int], np.ndarray] = {}
        for u in self.graph.gm.graph.nodes:
            readers = [c for c in u.users if c.op == "call_function" and c.name in self.requires_grad]
            if u.name not in self.requires_grad or len(readers) < 2 or u.name in self.absorbed:
                continue
            for c1, c2 in zip(readers, readers[1:]):
                g1, g2 = self.group_of[c1.name], self.group_of[c2.name]
                if g1 == g2 or len(self.groups[g1].pick) == 1 or len(self.groups[g2].pick) == 1:
                    continue
                m = self._rebate_matrix(u, c1, c2, g1, g2)
                if m is not None:
                    rebates[(g1, g2)] = rebates.get((g1, g2), 0) + m
        return rebates

    def _rebate_matrix(self, u, c1, c2, g1, g2) -> np.ndarray | None:
        keys = []
        for c, g in ((c1, g1), (c2, g2)):
            idx = self.views[c.name].tensor_args.index(u)
            strat_of = [self.strategies[c.name][p[c.name]] for p in self.groups[g].pick]
            keys.append([(s.in_specs[idx], grad_partial_axes(s.in_specs[idx], s.out_spec)) for s in strat_of])
        val = self.views[c1.name].in_vals[self.views[c1.name].tensor_args.index(u)]
        m = np.zeros((len(keys[0]), len(keys[1])))
        for i, (dst1, axes1) in enumerate(keys[0]):
            if not axes1:
                continue
            refund = self._all_reduce_time(val, dst1, axes1)
            for j, key2 in enumerate(keys[1]):
                if key2 == (dst1, axes1):
                    m[i, j] = -refund
        return m if m.any() else None

    def _all_reduce_time(self, val, spec, axes) -> float:
        nbytes = local_bytes(val, spec, self.env.mesh_shape)
        return self.env.microbatches * sum(self.env.links[a].time("all_reduce", nbytes) for a in axes)

    def _edge_matrix(self, arg, node, idx, src_picks, dst_picks) -> np.ndarray:
        """Price each distinct (source layout, read layout + gradient axes) pair once, then broadcast."""
        src_specs = [self.strategies[arg.name][ku].out_spec for ku in src_picks]
        strategies = self.strategies[node.name]
        reads = [(strategies[kv].in_specs[idx], grad_partial_axes(strategies[kv].in_specs[idx], strategies[kv].out_spec))
                 for kv in dst_picks]
        first_k = {}
        for kv, read in zip(dst_picks, reads):
            first_k.setdefault(read, kv)
        rows = {}
        for spec in dict.fromkeys(src_specs):
            price = {read: sum(self.edge_time_k(arg, node, idx, spec, kv)) for read, kv in first_k.items()}
            rows[spec] = np.array([price[read] for read in reads])
        return np.stack([rows[spec] for spec in src_specs])


def build_problem(graph, strategies, blocks, env: CostEnv, budget: float | None):
    """Group, price and collapse repeated blocks; returns (builder, problem, class of each group)."""
    b = _Builder(graph, strategies, env)
    b.build_groups()
    b.price_groups()
    edges = b.edge_matrices()
    for key, m in b.shared_sync_rebates().items():
        edges[key] = edges.get(key, 0) + m
    class_of = _share_classes(b, blocks)
    n_classes = max(class_of) + 1
    cost = [None] * n_classes
    mem = [None] * n_classes
    peak = [None] * n_classes
    for g, group in enumerate(b.groups):
        c = class_of[g]
        cost[c] = group.cost if cost[c] is None else cost[c] + group.cost
        mem[c] = group.mem if mem[c] is None else mem[c] + group.mem
        peak[c] = group.peak if peak[c] is None else np.maximum(peak[c], group.peak)
    class_edges: dict[tuple[int, int], np.ndarray] = {}
    for (gu, gv), m in edges.items():
        cu, cv = class_of[gu], class_of[gv]
        if cu == cv:
            cost[cu] = cost[cu] + np.diag(m)
        else:
            class_edges[(cu, cv)] = class_edges.get((cu, cv), 0) + m
    return b, IlpProblem(cost, mem, class_edges, budget, peak), class_of


def _share_classes(b: _Builder, blocks) -> list[int]:
    """Map each group to an ILP class; groups at the same place in identical blocks share one."""
    key_to_class: dict[tuple, int] = {}
    class_of = []
    for g, group in enumerate(b.groups):
        key = _group_key(b, group, blocks) if blocks is not None else None
        if key is None:
            key = ("unique", g)
        class_of.append(key_to_class.setdefault(key, len(key_to_class)))
    return class_of


def _group_key(b: _Builder, group: Group, blocks) -> tuple | None:
    """("block", class, member positions, picks) when the whole group sits in one block instance.

    The picks (each member's strategy index per leader strategy) are part of the key, so two groups
    share a class only when index i means the same layout in both.
    """
    calls = [m for m in group.members if b.nodes[m].op == "call_function"]
    where = [blocks.where.get(m) for m in calls]
    if not where or any(w is None for w in where):
        return None
    if len({w[0] for w in where}) != 1 or len({w[1] for w in where}) != 1:
        return None
    picks = tuple(tuple(p[m] for m in group.members) for p in group.pick)
    return ("block", where[0][0], tuple(w[2] for w in where), picks)


def solve_intra_op(graph, strategies, blocks, env: CostEnv, budget: float | None = None,
                   time_limit: float = 60.0) -> IntraOpSolution:
    """Build and solve the ILP, then read back one strategy per node and the predicted costs."""
    b, problem, class_of = build_problem(graph, strategies, blocks, env, budget)
    result = solve_ilp(problem, time_limit)
    chosen: dict[str, Strategy] = {}
    compute = comm = 0.0
    for g, group in enumerate(b.groups):
        i = result.choice[class_of[g]]
        for name in group.members:
            chosen[name] = b.strategies[name][group.pick[i][name]]
        compute += group.cost[i] - group.comm[i]
        comm += group.comm[i]
    edge_comm = evaluate(problem, result.choice) - sum(
        float(problem.cost[c][result.choice[c]]) for c in range(problem.n_classes))
    comm += edge_comm
    return IntraOpSolution(env.mesh_shape, chosen, compute + comm, compute, comm,
                           memory_of(problem, result.choice), result)
