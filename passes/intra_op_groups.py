"""The intra-op ILP's building blocks: decision groups, their price vectors, and resharding matrices.

A *group* is one decision: its leader's strategy index fixes every member's strategy. Members are light
ops (views, elementwise, casts) whose tensor inputs all come from the group, and placeholders with a
single reader in scope (they are stored exactly as that reader reads them, so they add no edge). Each
light member takes, for every leader strategy, its cheapest strategy given its inputs' specs.

A builder covers one *scope*: the whole graph, or one pipeline stage's nodes. A value a stage reads from
an earlier stage is a *boundary* group: free to arrive in any even spec (the transfer is priced by the
inter-op pass). A value a later stage reads pays here for being gathered whole before it is sent.

Truncation (``truncate=blocks``, ``block_truncation``): of a repeated-block class with n ≥ 3 instances in
scope only the first two are built; instance 1 stands for instances 1..n-1 (``weight`` n-1).

Prices per group and leader strategy (seconds per training step, B = env.microbatches):
    cost = B · (op time + activation resharding) + sync,   sync = gradient synchronization of parameters
    mem_param = parameter, gradient and optimizer bytes;    mem_act = saved activations × in-flight count
    peak = the largest transient (an op's output and its gradient)
The per-node and per-edge prices, and the caches that let identical layers share them, are
``intra_op_groups_prices.NodePrices`` (a base of ``GroupBuilder``); the group vectors are ``intra_op_prices``.
"""
from __future__ import annotations

import copy
import dataclasses
import operator

import numpy as np
import torch
import torch.fx as fx

from autopar.cost_models.memory import cast_inputs, saved_nodes
from autopar.ir.ops import OpView, is_free_view, requires_grad_nodes
from autopar.passes.block_truncation import truncation
from autopar.passes.intra_op_groups_prices import NodePrices
from autopar.passes.strategies import placeholder_strategies, strategy_signature
from autopar.passes.strategies.base import Strategy
from autopar.passes.strategies.registry import out_of_place_form
from autopar.placement import R

aten = torch.ops.aten


def _light_packets() -> frozenset:
    from autopar.passes.strategies import pointwise

    light = set(pointwise.NONLINEAR) | set(pointwise.SUMS) | set(pointwise.SCALES) | set(pointwise.COPIES)
    return frozenset(light | {aten.reshape, aten.flatten, aten.unflatten, aten.contiguous, aten.clone})


_LIGHT = _light_packets()


def is_light(node: fx.Node) -> bool:
    """Views, elementwise ops and casts: cheap ops that follow their producer's layout. An in-place form of
    one (``div_``, ``mul_``, ...) is light too: it takes its out-of-place form's rule (``strategies.registry``),
    and where its write could be lost it has the replicated strategy only, which ``build_groups`` never joins."""
    if node.op != "call_function":
        return False
    if is_free_view(node) or node.target is operator.getitem:
        return True
    target = out_of_place_form(node.target) or node.target
    return getattr(target, "overloadpacket", None) in _LIGHT


@dataclasses.dataclass
class Group:
    leader: str
    members: list[str]
    pick: list[dict[str, int]]          # per leader strategy: member name -> its strategy index
    cost: np.ndarray = None             # seconds per step (see module docstring), per leader strategy
    comm: np.ndarray = None             # the communication part of cost
    sync: np.ndarray = None             # the once-per-step part of cost (parameter gradient sync)
    mem_param: np.ndarray = None        # bytes of parameter state, per leader strategy
    mem_act: np.ndarray = None          # bytes of saved activations (× in-flight microbatches)
    peak: np.ndarray = None             # largest transient, per leader strategy
    zero_base: np.ndarray = None        # ZeRO twins (``intra_op_zero``): the column each column copies
    zero_gather: np.ndarray = None      # seconds of the twins' after-step all-gather (0 for base columns)
    zero_level: np.ndarray = None       # the ZeRO level each column puts its searched parameters at (0: base)
    zero3_gather: np.ndarray = None     # seconds per step of level 3's all-gathers compute does not hide
    zero3_unit: np.ndarray = None       # bytes of gathered level-3 units a column adds to its peak
    optimizer: np.ndarray = None        # seconds of the optimizer step over its parameters (in cost only)
    zero3_first: np.ndarray = None      # seconds per step of a level-3 column's first unit's gathers (not in cost)

    @property
    def mem(self) -> np.ndarray:
        return self.mem_param + self.mem_act


def recompute_saved(graph, saved: dict[str, float], recomputed: frozenset[str]) -> dict[str, float]:
    """``saved`` where backward recomputes the ops in ``recomputed``: they keep nothing, and the values
    outside the set that they read (a recomputed region's inputs, which checkpoint keeps) keep their output."""
    out = {name: share for name, share in saved.items() if name not in recomputed}
    for node in graph.gm.graph.nodes:
        if node.name in recomputed:
            for arg in node.all_input_nodes:
                if arg.name not in recomputed and arg.op == "call_function":
                    out[arg.name] = max(out.get(arg.name, 0.0), 1.0)
    return out


class GroupBuilder(NodePrices):
    """Builds groups, their prices and the inter-group resharding matrices for one scope and mesh."""

    def __init__(self, graph, strategies: dict[str, list[Strategy]], env, subset: set[str] | None = None,
                 truncate=None):
        self.graph, self.env, self.subset = graph, env, subset
        self.nodes = {n.name: n for n in graph.gm.graph.nodes}
        self.alias, self.stands_for = truncation(graph, truncate, subset) if truncate else ({}, {})
        view = graph.view
        self.params = {p.name for p in graph.placeholders if p.kind == "parameter"}
        device_type = env.cluster.device_type
        info = getattr(graph, "_grad_info", None)  # per graph and device type, not per builder
        if info is None or info[0] != device_type:
            needs = requires_grad_nodes(graph.gm, self.params)
            autocast = getattr(graph, "compute_dtype", None)
            graph._grad_info = info = (device_type, needs, saved_nodes(graph.gm, needs, device_type, autocast),
                                       cast_inputs(graph.gm, needs, device_type, autocast))
        _, self.requires_grad, self.saved, self.casts = info
        self.saved_without_recompute = self.saved
        if env.recomputed:
            self.saved = recompute_saved(graph, self.saved, env.recomputed)
        self.order, self.boundary, self.sends = self._scope()
        self.strategies = dict(strategies)
        for name in self.boundary:
            self.strategies[name] = placeholder_strategies(self.nodes[name], env.mesh_shape)
        self.views = {n.name: view(n) for n in self.order if n.op != "placeholder" and n.name not in self.boundary}
        for name, v in self.views.items():  # readers of dropped instances read instance 1 (on a copy)
            if any(a.name in self.alias for a in v.tensor_args):
                v = self.views[name] = copy.copy(v)
                v.tensor_args = [self.nodes[self.alias.get(a.name, a.name)] for a in v.tensor_args]
        self.group_of: dict[str, int] = {}
        self.groups: list[Group] = []
        self.absorbed: dict[str, str] = {}
        # Caches keyed by structural signatures, so identical layers are priced once.
        self.sig = {n.name: strategy_signature(n) if n.op != "output" else "output" for n in self.order}
        self._node_time: dict[tuple, tuple[float, float]] = {}
        self._edge_time: dict[tuple, tuple[float, float]] = {}
        self._follow: dict[tuple, int] = {}
        self._op_time_lists: dict[tuple, tuple[list[float], list[int]]] = {}
        # Cache keys hold specs by number (``spec_id``; see ``intra_op_groups_prices``)
        self._spec_ids: dict[int, tuple] = {}

    def _in(self, node: fx.Node) -> bool:
        if node.name in self.alias:
            return False
        if self.subset is None:
            return node.op != "placeholder" or not node.users or any(u.name not in self.alias for u in node.users)
        if node.name in self.subset:
            return True
        return node.op == "placeholder" and any(u.name in self.subset for u in node.users)

    def weight(self, g: int) -> int:
        """How many instances group g stands for (n-1 for instance 1 of a truncated class, else 1)."""
        return self.stands_for.get(self.groups[g].leader, 1)

    def _scope(self) -> tuple[list[fx.Node], set[str], set[str]]:
        """(nodes in scope, boundary values first; names of boundary values; names of values sent on).

        A value sent on from a truncated instance is priced at its instance-1 twin (``sends``); the real
        names stay in ``sends_real`` for the plan."""
        inside = [n for n in self.graph.gm.graph.nodes if self._in(n)]
        self.sends_real: set[str] = set()
        self.send_scale: dict[str, float] = {}
        if self.subset is None:
            return inside, set(), set()
        boundary = {a.name: a for n in inside if n.op != "placeholder" for a in self.graph.view(n).tensor_args
                    if a.op == "call_function" and a.name not in self.subset}
        self.sends_real = {n.name for n in self.graph.gm.graph.nodes if n.name in self.subset
                           and n.op == "call_function" and any(u.name not in self.subset for u in n.users)}
        priced = [self.alias.get(n, n) for n in self.sends_real]
        # a twin in instance 1 counts (n-1) times; its send must count as often as real sends map to it
        self.send_scale = {n: priced.count(n) / self.stands_for.get(n, 1) for n in priced}
        return list(boundary.values()) + inside, set(boundary), set(priced)

    def users_in_scope(self, node: fx.Node) -> list[fx.Node]:
        return [u for u in node.users if (self.subset is None or u.name in self.subset) and u.name not in self.alias]

    # ---- grouping --------------------------------------------------------------------------------
    def build_groups(self) -> None:
        absorbed = self.absorbed = self._single_use_placeholders()
        for node in self.order:
            if node.op == "placeholder" and node.name in absorbed:
                continue
            owners = self._owner_groups(node, absorbed)
            if is_light(node) and node.name not in self.boundary and len(owners) == 1 \
                    and len(self.strategies[node.name]) > 1:
                self._join(owners.pop(), node, absorbed)
            else:
                self._lead(node, absorbed)

    def _single_use_placeholders(self) -> dict[str, str]:
        """Placeholders read by exactly one node in scope, once: {placeholder: reader}."""
        out = {}
        for node in self.order:
            users = self.users_in_scope(node) if node.op == "placeholder" else []
            if len(users) == 1 and users[0].op == "call_function" \
                    and self.views[users[0].name].tensor_args.count(node) == 1 and self._storable(node, users[0]):
                out[node.name] = users[0].name
        return out

    def _storable(self, node: fx.Node, reader: fx.Node) -> bool:
        """Whether every spec ``reader`` may read ``node`` in is a spec ``node`` may be stored in. A pin
        cuts a placeholder read by several nodes to one spec without cutting its readers (``passes.pins``);
        with one of them in scope (a pipeline stage) that reader may want another spec: the placeholder then
        leads its own group and the move is priced on the edge."""
        idx = self.views[reader.name].tensor_args.index(node)
        options = {s.out_spec for s in self.strategies[node.name]}
        return all(tuple(R if p.is_partial() else p for p in s.in_specs[idx]) in options
                   for s in self.strategies[reader.name])

    def _owner_groups(self, node: fx.Node, absorbed) -> set[int]:
        if node.op == "placeholder" or node.name in self.boundary:
            return set()
        owners = set()
        for arg in self.views[node.name].tensor_args:
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
        sig, flags = self.sig[node.name], self._grad_flags(node, view)
        read = [None if self.absorbed.get(a.name) == node.name else a.name for a in view.tensor_args]
        for pick in group.pick:
            key = (sig, tuple(None if name is None else self._spec_id_in_pick(name, pick) for name in read), flags)
            if key not in self._follow:
                srcs = tuple(None if self.absorbed.get(a.name) == node.name else self._spec_in_pick(a.name, pick)
                             for a in view.tensor_args)
                self._follow[key] = self._cheapest(node, view, srcs)
            pick[node.name] = self._follow[key]
        group.members.append(node.name)
        self.group_of[node.name] = g
        self._absorb_inputs(group, node, absorbed)

    def _absorb_inputs(self, group: Group, node: fx.Node, absorbed) -> None:
        if node.op != "call_function" or node.name in self.boundary:
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

    def _spec_id_in_pick(self, name: str, pick: dict[str, int]) -> int:
        """``spec_id`` of ``_spec_in_pick``'s spec, without hashing it."""
        if name in pick:
            return self.strategy_spec_ids(name)[pick[name]][1]
        g = self.groups[self.group_of[name]]
        assert len(g.pick) == 1, f"{name} is outside the group and not fixed"
        return self.strategy_spec_ids(name)[g.pick[0][name]][1]

    def _cheapest(self, node: fx.Node, view: OpView, srcs: tuple) -> int:
        """argmin_k local cost. Fast path: a strategy reading every input as it comes costs only its own
        op; if that is no more than the cheapest op time of any strategy (a lower bound on every cost),
        it is the argmin and the other strategies need no pricing."""
        strategies = self.strategies[node.name]
        op_times, by_time = self._op_times(node.name)
        floor = op_times[by_time[0]]
        for k, strat in enumerate(strategies):
            if all(src is None or src == dst for src, dst in zip(srcs, strat.in_specs)):
                cost = self._local_cost(node, view, k, srcs)
                if cost <= floor:
                    return k
        # argmin by op time first: a strategy whose op alone costs more than the best total so far cannot
        # be the argmin (resharding only adds), so most strategies are never priced; ties keep the lowest k
        best, best_k = float("inf"), None
        for k in by_time:
            if op_times[k] > best:
                break
            cost = self._local_cost(node, view, k, srcs)
            if best_k is None or cost < best or (cost == best and k < best_k):
                best, best_k = cost, k
        return best_k

    def _op_times(self, name: str) -> tuple[list[float], list[int]]:
        """(per strategy k the op's own seconds (``node_time_k``), the ks by those seconds, ties by k),
        kept per signature and gradient flag."""
        key = (self.sig[name], name in self.requires_grad)
        hit = self._op_time_lists.get(key)
        if hit is None:
            times = [self.node_time_k(name, k)[0] for k in range(len(self.strategies[name]))]
            hit = self._op_time_lists[key] = times, sorted(range(len(times)), key=times.__getitem__)
        return hit

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
