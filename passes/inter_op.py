"""Pass 5, inter_op: price every (layer range, submesh) and pick pipeline stages with the DP of ``stage_dp``.

Input:  the graph, its ``Layers``, the cluster, candidate microbatch counts B.
Output: ``StageChoice``: microbatches, and per stage its layers, mesh option and in-flight count.

Pricing (one intra-op ILP per logical mesh, not per stage candidate): for each mesh option the whole
model is solved once on the graph rescaled to a reference microbatch b₀, identical layers sharing one
solution; the solution's groups give per-layer costs. For a stage of layers k..i at microbatch b:

    t = max((b/b₀) · (Σ_l t_l + Σ_{k ≤ l,l' ≤ i} e_{l,l'}) + Σ_l sync_l / B + 2c,  transfer_k)
    mem = Σ_l param_l + f · (b/b₀) · Σ_l act_l + (b/b₀) · max_l peak_l  ≤  device memory

with t_l the layer's per-microbatch op and resharding time, e_{l,l'} resharding between layers, sync_l
its once-per-step gradient sync (spread over the B microbatches for the DP), transfer_k the send of the
tensors live at the cut before layer k (forward and backward; it overlaps compute, so it bounds the
stage's cycle and enters the DP's sum once as h_k, see ``stage_dp``), c the pipeline runtime's host time
per (stage, microbatch) and direction (``Cluster.microbatch_overhead``, once in forward and once in
backward, as ``plan_builder.charge_microbatch_overhead`` charges the plan), f the microbatches in flight. A mesh
option whose batch split does not divide b is not offered at that B. Where the unconstrained solution
is unlikely to fit, the same layouts at ZeRO level 2 (``layer_costs.zero2_variant``) and a lean solution
(near the least memory any plan needs) are priced too, and the same layouts at ZeRO level 3
(``layer_costs.zero3_variant``), which the DP is offered only where nothing fits without them (why:
``intra_op_zero``'s docstring). With ``offload`` every entry may also take its stage's
optimizer state to host memory (``stage_offload``: less memory, the host step's time), chosen per stage.
The DP's answer is read off the tables by ``inter_op_choice`` (``choose_stages``, ``restaged``,
re-exported here). The chosen stages are then re-solved exactly, stage by stage, by the driver. Being
prices, not plans, the whole-model solves here skip the solver's presolve (``ilp_highs.solve``: half the
solver time, a solution within the same relative gap).
"""
from __future__ import annotations

import functools

import numpy as np

from autopar.errors import InfeasibleError
from autopar.hardware.cluster import Cluster
from autopar.passes.forked import parallel_map
from autopar.passes.ilp import min_memory
from autopar.passes.inter_op_meshes import MeshOption, mesh_options, own_reference
from autopar.passes.intra_op import CostEnv, build_problem, solve_built
from autopar.passes.layer_costs import LayerCosts, layer_costs, zero2_variant, zero3_variant
from autopar.passes.recompute import LayerRecompute, forward_share
from autopar.passes.stage_offload import offload_layers, offloaded_tables
from autopar.passes.strategies import generate_strategies, strategy_signature

INF = float("inf")
LEAN_MARGIN = 1.25  # a lean solution may use this much more than the least memory any plan needs


class StageCosts:
    """Per-mesh-option layer costs (with memory-saving variants), turned into DP tables for any B.

    ``graphs`` maps a reference microbatch size b₀ to the graph rescaled to it (or is a function returning
    that map, called on first use: a plan on the user's stages never prices mesh options, so it never
    rescales); each mesh option is solved at every b₀ (a small b₀ keeps batch splits that divide small
    microbatches, the whole batch allows wide data parallelism), and each table entry takes the cheapest
    variant valid at its b. ``graphs``, ``cut_bytes`` and ``share`` are computed once, when first read.
    """

    def __init__(self, graphs, layers, blocks, cluster: Cluster, training, batch_dims: dict, time_limit: float,
                 strategies_for=generate_strategies, recompute_modes: list[str] | None = None, offload: bool = False,
                 rescaled=None):
        self._graphs = graphs
        self.rescaled = rescaled  # b₀ -> the graph rescaled to microbatch b₀ (``add_own_references``)
        self.own_solved: set[int] = set()
        self.layers, self.blocks, self.cluster = layers, blocks, cluster
        self.strategies_for = strategies_for
        self.training, self.batch_dims, self.time_limit = training, batch_dims, time_limit
        self.options = mesh_options(cluster)
        self.variants: dict[int, list[LayerCosts]] = {}
        self.held: dict[int, list[LayerCosts]] = {}  # ZeRO-3 variants, offered only where nothing fits without
        self.zero3_offered = False
        self.samples_split = False  # entries whose solutions split a sample over devices (``offer_sample_splits``)
        self.solves = 0
        self.modes = recompute_modes or ["none"] * layers.count
        self.picks: dict[int, np.ndarray] = {}  # B -> [k, i, m, f-1] the recompute choice behind each entry
        self._recompute: dict[int, LayerRecompute] = {}  # id of a LayerCosts in ``variants`` -> its prices
        self.offload = offload  # price optimizer offload per stage (``stage_offload``)
        self.offloads: dict[int, np.ndarray] = {}  # B -> [k, i, m, f-1] whether that entry offloads

    @functools.cached_property
    def graphs(self) -> dict:
        return self._graphs() if callable(self._graphs) else self._graphs

    @functools.cached_property
    def cut_bytes(self) -> dict[int, np.ndarray]:
        """{b₀: bytes per sample live at the cut before each layer}."""
        return {b0: _cut_bytes(g, self.layers) / b0 for b0, g in self.graphs.items()}

    @functools.cached_property
    def share(self) -> np.ndarray | None:
        """Each layer's share of the forward (``recompute.forward_share``); None when nothing may recompute."""
        if not set(self.modes) - {"none"}:
            return None
        return forward_share(next(iter(self.graphs.values())), self.layers)

    def _env(self, option: MeshOption) -> CostEnv:
        return CostEnv(self.cluster, option.logical, self.training, devices_per_node=option.physical[1])

    def prepare(self) -> None:
        """Solve every option up front, on all cores when that is safe (see ``parallel_map``)."""
        todo = [m for m in range(len(self.options)) if m not in self.variants]
        todo.sort(key=lambda m: -self.options[m].size)  # the largest meshes have the most strategies: first
        for graph in self.graphs.values():  # node signatures (cached in the nodes) once, before the workers fork
            for node in graph.gm.graph.nodes:
                if node.op != "output":
                    strategy_signature(node)
        for m, variants in zip(todo, parallel_map(self._solve_all, todo, "autopar: pricing submeshes")):
            self._store(m, variants)
        self.solves += sum(c.solved for m in todo for c in self.variants[m])

    def _solve_all(self, m: int) -> list[LayerCosts]:
        return [c for b0 in self.graphs if b0 in self.shared for c in self._solve(m, b0)]

    def add_own_references(self, options: list[int], global_batch: int) -> None:
        """Solve each of ``options`` (indices) at its ``own_reference`` too, once, appending those solutions to
        its variants (after the others, so the indices ``picks`` records stay valid). The stage DP prices
        without them (a solve more per (data, tensor) mesh: +70 % pricing CPU on Llama-3-8B / 64 H100s), and
        ``solves`` (the plan's "mesh_solves") counts the DP's only; ``restaged`` asks for the meshes of the
        submeshes it re-chooses among."""
        shared = self.shared
        for m in options:
            b0 = own_reference(self.options[m], min(shared), global_batch)
            if b0 is None or m in self.own_solved or self.rescaled is None:
                continue
            self.own_solved.add(m)
            self.costs(m)
            if b0 not in self.graphs:
                self.graphs[b0] = self.rescaled(b0)
                self.cut_bytes[b0] = _cut_bytes(self.graphs[b0], self.layers) / b0
            self.variants[m] += [c for c in self._solve(m, b0) if not c.last_resort]

    @functools.cached_property
    def shared(self) -> tuple[int, ...]:
        """The reference microbatches every option is solved at (the ones ``graphs`` was given)."""
        return tuple(self.graphs)

    def costs(self, m: int) -> list[LayerCosts]:
        """Option m's solutions at every reference microbatch (solved on first use): the unconstrained
        one, and, when a stage on this option may need less memory (the unconstrained solution's memory,
        spread over the layers a stage of this size would hold if every stage were this size, exceeds half
        a device), the same layouts with their parameters at ZeRO level 2 (``layer_costs.zero2_variant``,
        no solve) and, at the smallest reference microbatch, a lean solution (memory budget 1.25 × the least
        any plan needs)."""
        if m not in self.variants:
            self._store(m, self._solve_all(m))
            self.solves += sum(c.solved for c in self.variants[m])
        return self.variants[m]

    def _store(self, m: int, variants: list[LayerCosts]) -> None:
        """Keep option m's solutions: the ZeRO-3 variant apart until ``offer_zero3`` (appended last, so the
        indices ``picks`` records stay valid)."""
        self.variants[m] = [c for c in variants if not c.last_resort]
        self.held[m] = [c for c in variants if c.last_resort]
        if self.zero3_offered:
            self.variants[m] += self.held[m]

    def offer_zero3(self) -> bool:
        """Offer the ZeRO-3 variants to the tables from now on; False when there are none or they already are
        (``choose_stages`` calls it where nothing fits without them; see ``intra_op_zero``'s docstring)."""
        if self.zero3_offered or not any(self.held.values()):
            return False
        self.zero3_offered = True
        for m, held in self.held.items():
            self.variants[m] += held
        return True

    def offer_sample_splits(self) -> bool:
        """Let the tables enter, at a multiple b of a solution's b₀, the solutions that split a sample's tokens
        over more devices than b has samples (``LayerCosts.serves``); False when they already may. Offered as
        ZeRO-3's variants are, only where nothing fits without them (``choose_stages``): such an entry scales
        a solution made at a smaller microbatch, the DP's estimate farthest from its b, and entered always it
        made plans worse once solved exactly (Llama-2-70B on 64 H100s: 13.34 -> 14.25 s per step). Where memory
        leaves no other plan (one 128K-token sequence per microbatch) it is the lever that fits."""
        if self.samples_split:
            return False
        self.samples_split = True
        return True

    def _solve(self, m: int, b0: int) -> list[LayerCosts]:
        option, graph = self.options[m], self.graphs[b0]
        env = self._env(option)
        built = build_problem(graph, self.strategies_for(graph, option.logical), self.blocks, env, None, None, True)
        first = solve_built(built, env, self.time_limit, presolve=False)
        out = [self._layer_costs(first, option, b0)]
        share = option.size / self.cluster.num_devices
        pressed = first.memory * share > 0.5 * self.cluster.memory_per_device
        for variant in (zero2_variant, zero3_variant) if pressed else ():
            sharded = variant(first, built.edges)
            if sharded is not None:
                out.append(self._layer_costs(sharded, option, b0, solved=False))
                out[-1].last_resort = variant is zero3_variant
        smallest = b0 == min(self.graphs)  # memory pressure lives with the small microbatches of pipelines
        if smallest and pressed:
            try:
                lean = solve_built(built, env, self.time_limit, budget=LEAN_MARGIN * min_memory(built.problem),
                                   presolve=False)
                out.append(self._layer_costs(lean, option, b0))
            except InfeasibleError:
                pass
        return out

    def _layer_costs(self, solution, option: MeshOption, b0: int, solved: bool = True) -> LayerCosts:
        """``layer_costs`` of one solution, with its optimizer-offload prices when offload is searched."""
        costs = layer_costs(solution, self.layers, self.batch_dims, option.logical, b0, self.blocks, solved)
        if self.offload:
            costs.host_state = offload_layers(solution, self.graphs[b0], self.layers, self.blocks, self.training,
                                              self.cluster)
        return costs

    def table(self, global_batch: int, B: int, max_f: int) -> np.ndarray:
        """t[k, i, m, f-1] for B microbatches (∞ where memory or the batch split rules the entry out)."""
        L, M = self.layers.count, len(self.options)
        table = np.full((L, L, M, max_f), INF)
        self.picks[B] = np.full((2, L, L, M, max_f), -1, dtype=np.int32)
        if self.offload:
            self.offloads[B] = np.zeros((L, L, M, max_f), dtype=bool)
        for m in range(M):
            self._fill(table, m, global_batch // B, B, max_f)
        return table

    def _fill(self, table, m, b, B, max_f) -> None:
        transfer = self.hops_at(b)[:, None, None]
        for v, costs in enumerate(self.costs(m)):
            if not (costs.serves(b) if self.samples_split else costs.splits_within(b)):
                continue
            scale = b / costs.reference_batch
            tables = [costs.stage_tables(scale, B, max_f)]
            if self.offload and costs.host_state is not None:  # the same stage with its optimizer on the host
                tables.append(offloaded_tables(costs.host_state, *tables[0], B))
            for offload, (latency, memory) in enumerate(tables):
                better = self._enter(table, m, B, v, costs, latency, memory, scale, transfer)
                if self.offload:
                    self.offloads[B][:, :, m][better] = bool(offload)

    def _enter(self, table, m, B, v, costs, latency, memory, scale, transfer) -> np.ndarray:
        """Enter one variant's stage prices where they beat the table's (recompute chosen per entry); the mask."""
        budget = self.cluster.memory_per_device
        rec = self.layer_recompute(costs)
        if rec is None:
            lat, fits, prefix = np.broadcast_to(latency[:, :, None], memory.shape), memory <= budget, None
        else:
            lat, fits, prefix = rec.tables(latency, memory, scale, budget)
        host = 2 * self.cluster.microbatch_overhead  # the pipeline runtime's, forward + backward
        cycle = np.maximum(lat + host, transfer)  # a stage cannot cycle faster than its input link
        entry = np.where(fits, cycle, INF)
        better = entry < table[:, :, m]
        table[:, :, m] = np.where(better, entry, table[:, :, m])
        picks = self.picks[B][:, :, :, m]
        picks[0][better] = v
        picks[1][better] = prefix[better] if prefix is not None else 0
        return better

    def layer_recompute(self, costs: LayerCosts) -> LayerRecompute | None:
        """Recompute prices of one solution, or None when the policy recomputes nothing (``recompute``)."""
        if self.share is None:
            return None
        if id(costs) not in self._recompute:  # kept per solution: its prefix tables serve every B
            keep = self.cut_bytes[costs.reference_batch] * costs.reference_batch / costs.batch_split
            self._recompute[id(costs)] = LayerRecompute(costs, self.share, keep, self.modes)
        return self._recompute[id(costs)]

    def offload_of(self, B: int, k: int, i: int, m: int, f: int) -> bool:
        """Whether table entry [k, i, m, f-1] of the last ``table(.., B, ..)`` offloads its optimizer."""
        offloads = self.offloads.get(B)
        return bool(offloads[k, i, m, f - 1]) if offloads is not None else False

    def recompute_of(self, B: int, k: int, i: int, m: int, f: int) -> tuple[int, ...]:
        """The layers recomputed in table entry [k, i, m, f-1] of the last ``table(.., B, ..)``."""
        picks = self.picks.get(B)
        if picks is None or picks[0, k, i, m, f - 1] < 0:
            return ()
        rec = self.layer_recompute(self.costs(m)[picks[0, k, i, m, f - 1]])
        return rec.choice(k, i, int(picks[1, k, i, m, f - 1])) if rec is not None else ()

    def hops_at(self, microbatch: int) -> np.ndarray:
        """h[k]: the transfer into a stage that starts at layer k, at this microbatch size (``stage_dp``)."""
        return np.array([self._transfer(k, microbatch) for k in range(self.layers.count)])

    def _transfer(self, k: int, microbatch: int) -> float:
        """Forward send and backward return of the tensors live at the cut before layer k."""
        if k == 0:
            return 0.0
        per_sample = next(iter(self.cut_bytes.values()))[k]
        link = self.cluster.inter_node if self.cluster.nodes > 1 else self.cluster.intra_node
        return 2 * (link.latency + microbatch * per_sample / link.bandwidth_for(2))


def _cut_bytes(graph, layers) -> np.ndarray:
    """bytes[k]: the op outputs made before layer k and read in or after it (at the captured batch)."""
    L = layers.count
    out = np.zeros(L)
    for node in graph.gm.graph.nodes:
        if node.op != "call_function" or node.name not in layers.of_node:
            continue
        val = node.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else [val]
        size = sum(v.numel() * v.element_size() for v in vals if hasattr(v, "numel"))
        first, last = layers.of_node[node.name], max((layers.of_node.get(u.name, L - 1) for u in node.users),
                                                      default=layers.of_node[node.name])
        out[first + 1:last + 1] += size
    return out


from autopar.passes.inter_op_choice import (  # noqa: E402 - re-exported: the DP's answer, read off these tables
    TIE,
    ChosenStage,
    StageChoice,
    choose_stages,
    restaged,
)

__all__ = ["INF", "LEAN_MARGIN", "TIE", "ChosenStage", "MeshOption", "StageChoice", "StageCosts", "choose_stages",
           "mesh_options", "own_reference", "restaged"]
