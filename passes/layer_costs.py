r"""Per-layer prices of one mesh option's whole-model solution, and its ZeRO-2 variant (helpers of ``inter_op``).

``layer_costs`` splits an ``IntraOpSolution``'s group prices by layer: for layer l at the reference
microbatch b₀, t_l (op and resharding time per microbatch, gradient sync excluded), sync_l (once per step),
param_l and act_l (bytes), peak_l (largest transient, plus ZeRO-3's gathered units), and the resharding
e_{l,l'} between layers; ``LayerCosts.stage_tables`` turns them into every stage k..i's latency and memory
(formulas in ``inter_op``'s docstring).

``zero2_variant``: the same solution with every parameter group that has a ZeRO level-2 twin
(``intra_op_zero``) moved to it. A twin keeps its base column's picks, so layouts, op times and resharding
edges are unchanged; per group only

    mem_param' = mem_param − saved₂,    sync' = sync + g,    cost' = cost + g

(g: the after-step all-gather of its parameters). No solve is needed, so the stage DP gets a third memory
point per mesh option for free: between the unconstrained solution and the lean one, a stage that misses
the budget by less than its gradients and optimizer state fits at the price of one all-gather per step.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from autopar.passes.intra_op import IntraOpSolution
from autopar.placement import shard_factor

INF = float("inf")


@dataclasses.dataclass
class LayerCosts:
    """Per-layer prices of one whole-model solution at reference microbatch b₀ (see module docstring)."""

    t: np.ndarray
    edges: np.ndarray
    sync: np.ndarray
    param: np.ndarray
    act: np.ndarray
    peak: np.ndarray
    batch_split: int  # the most ways any batch dim is split (the activations' share per device)
    reference_batch: int = 1  # b₀, the microbatch size the solution was priced at
    comm: np.ndarray | None = None  # the communication part of t (sync included), for recompute pricing
    solved: bool = True  # False: derived from another solution without a solve (``zero2_variant``)
    host_state: tuple | None = None  # (freed bytes, added seconds) per layer of optimizer offload (``stage_offload``)
    replayed_edges: np.ndarray | None = None  # the part of ``edges`` an op's output makes (recompute re-runs it)
    last_resort: bool = False  # offered to the stage DP only where nothing fits without it (``zero3_variant``)

    def __post_init__(self):
        self.ranges = _range_matrices(self)

    def splits_within(self, b: int) -> bool:
        """Whether the widest split of a batch dim divides microbatch b (each device's share holds whole samples)."""
        return b % self.batch_split == 0

    def serves(self, b: int) -> bool:
        """Whether these layouts are valid at microbatch b at all: at a multiple of b₀ every dim holding the batch
        grows by b / b₀ and so still divides as it did at b₀, a [b·s, h] token stream split wider than b included
        (one 128K-token sequence over 64 devices); below b₀ only where ``splits_within(b)``."""
        return b % self.reference_batch == 0 or self.splits_within(b)

    def stage_tables(self, scale: float, microbatches: int, max_f: int) -> tuple[np.ndarray, np.ndarray]:
        """(latency [k, i], memory [k, i, f-1]) of every stage k..i (i < k entries are ∞), transfer excluded."""
        t, sync, param, act, peak = self.ranges
        latency = scale * t + sync / microbatches
        f = np.arange(1, max_f + 1)[None, None, :]
        memory = param[:, :, None] + f * scale * act[:, :, None] + scale * peak[:, :, None]
        return latency, memory


def _range_matrices(c: "LayerCosts") -> tuple[np.ndarray, ...]:
    """[k, i] over layers k..i (∞ below the diagonal): time with the edges inside the range, sync,
    parameter and activation bytes, and the largest transient. Prefix sums keep each O(L²)."""
    L = len(c.t)
    lower = np.tril(np.ones((L, L), dtype=bool), -1)

    def span(v):
        p = np.concatenate([[0.0], np.cumsum(v)])
        return p[None, 1:] - p[:-1, None]  # [k, i] = Σ v[k..i]

    P = np.zeros((L + 1, L + 1))
    P[1:, 1:] = np.cumsum(np.cumsum(c.edges, axis=0), axis=1)  # P[a, b] = Σ_{l < a, l' < b} edges
    k, i = np.meshgrid(np.arange(L), np.arange(L), indexing="ij")
    inner = P[i + 1, i + 1] - P[k, i + 1] - P[i + 1, k] + P[k, k]
    peak = np.array([np.maximum.accumulate(np.concatenate([np.zeros(k0), c.peak[k0:]])) for k0 in range(L)])
    out = [span(c.t) + inner, span(c.sync), span(c.param), span(c.act), peak]
    return tuple(np.where(lower, INF, m) for m in out)


def layer_costs(solution: IntraOpSolution, layers, batch_dims: dict, mesh_shape, reference_batch: int,
                blocks=None, solved: bool = True) -> LayerCosts:
    """Split a whole-model solution's group prices by layer. A group of a truncated instance 1 stands for
    instances 1..n-1 and adds its price to each of their layers (see ``intra_op_groups``). ``solved``: the
    solution came from a solve (False for ``zero2_variant``'s)."""
    L = layers.count
    t, sync, param, act, peak, comm = (np.zeros(L) for _ in range(6))
    spread = [_instance_layers(group.leader, layers, blocks, weight)
              for group, weight in zip(solution.groups, solution.weights)]
    for group, i, where in zip(solution.groups, solution.choice, spread):
        for layer in where:
            t[layer] += group.cost[i] - group.sync[i] - (group.optimizer[i] if group.optimizer is not None else 0.0)
            sync[layer] += group.sync[i]
            comm[layer] += group.comm[i]
            param[layer] += group.mem_param[i]
            act[layer] += group.mem_act[i]
            unit = group.zero3_unit[i] if group.zero3_unit is not None else 0.0  # ZeRO-3's gathered units
            peak[layer] = max(peak[layer], group.peak[i] + unit)
    edges, replayed = np.zeros((L, L)), np.zeros((L, L))
    ops = {name for names in layers.nodes for name in names}
    for (gu, gv), cost in solution.edge_costs.items():
        per_instance = cost / solution.weights[gv]
        from_op = solution.groups[gu].leader in ops  # not a parameter's or input's (their backward: its gradient)
        for lu, lv in _edge_layers(solution.groups[gu].leader, solution.groups[gv].leader, spread[gu], spread[gv],
                                   blocks, layers):
            edges[lu, lv] += per_instance
            replayed[lu, lv] += per_instance if from_op else 0.0
    split = max([shard_factor(s.out_spec, batch_dims[n], mesh_shape) for n, s in solution.strategies.items()
                 if batch_dims.get(n) is not None] or [1])
    return LayerCosts(t, edges, sync, param, act, peak, split, reference_batch, comm, solved, replayed_edges=replayed)


def _instance_layers(leader: str, layers, blocks, weight: int) -> list[int]:
    """The layers a group contributes to: its own, or those of instances 1..n-1 when truncated."""
    if weight == 1 or blocks is None:
        return [layers.of_node.get(leader, 0)]
    cid, inst, pos = blocks.where[leader]
    return [layers.of_node[instance[pos]] for instance in blocks.instances[cid][1:]]


def _edge_layers(u: str, v: str, u_layers: list[int], v_layers: list[int], blocks, layers) -> list[tuple[int, int]]:
    """(producer layer, reader layer) for each instance an edge stands for."""
    if len(v_layers) == 1 and len(u_layers) == 1:
        return [(u_layers[0], v_layers[0])]
    if len(v_layers) == 1:  # read outside the blocks from the last instance
        return [(u_layers[-1], v_layers[0])]
    if len(u_layers) > 1:  # inside instance j
        return list(zip(u_layers, v_layers))
    cid_v = blocks.where[v][0]
    where_u = blocks.where.get(u)
    if where_u is not None and where_u[0] == cid_v and where_u[1] == 0:  # crossing j-1 -> j
        pos = where_u[2]
        previous = [layers.of_node[instance[pos]] for instance in blocks.instances[cid_v][:-1]]
        return list(zip(previous, v_layers))
    return [(u_layers[0], lv) for lv in v_layers]  # from outside the blocks into every instance


def zero2_variant(solution: IntraOpSolution, edges: dict) -> IntraOpSolution | None:
    """``solution`` with every base column that has a level-2 twin replaced by it (module docstring); None
    when no group has one. ``edges``: the built problem's group resharding matrices (``BuiltProblem.edges``),
    weighted as ``solve_built`` weights them."""
    return zero_variant(solution, edges, 2)


def zero3_variant(solution: IntraOpSolution, edges: dict) -> IntraOpSolution | None:
    """``zero2_variant`` at level 3: every base column that has a level-3 twin replaced by it (module
    docstring); None when no group has one."""
    return zero_variant(solution, edges, 3)


def zero_variant(solution: IntraOpSolution, edges: dict, level: int) -> IntraOpSolution | None:
    """``solution`` with every column below ZeRO ``level`` that has a twin at that level replaced by it; None
    when no group has one. A column the solve took at level 2 (for its cheaper optimizer step) moves to level 3
    too: its twins are its base column's."""
    choice, moved = list(solution.choice), False
    for g, group in enumerate(solution.groups):
        if group.zero_base is None or group.zero_level[choice[g]] >= level:
            continue
        base = group.zero_base[choice[g]]
        twins = np.flatnonzero((group.zero_base == base) & (group.zero_level == level))
        if len(twins):
            choice[g], moved = int(twins[0]), True
    if not moved:
        return None
    edge_costs = {(gu, gv): solution.weights[gv] * float(m[choice[gu], choice[gv]]) for (gu, gv), m in edges.items()}
    return dataclasses.replace(solution, choice=choice, edge_costs=edge_costs)
