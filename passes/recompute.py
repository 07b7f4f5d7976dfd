r"""Activation recompute in the planner: which layers of a stage keep their activations, which recompute them.

Policy (``PlanOptions.recompute``): "auto" (the planner chooses per stage), "none", "full" (every layer),
or {layer glob: "none" | "full" | "selective" | "auto"}. A glob matches layer l when it matches ``str(l)``
or the module path of one of the layer's ops (``"blocks.1"``, ``"transformer.h.*"``); the first matching
entry wins, unmatched layers are "auto". "selective" recomputes only the attention core of the layer
(Megatron's selective recompute: the ops in ``ATTENTION_CORE``); "auto" never chooses it, and the
tables price a selective layer as keeping its activations (an upper bound on its memory).

Pricing of a fully recomputed layer l at the reference microbatch b₀ of a mesh option's solution:

    act'_l   = keep_l = bytes of the tensors live at the cut before l, / batch split  (its boundary input)
    t'_l     = t_l + fwd_l,   fwd_l = φ_l · compute_l + ½ · (comm_l − sync_l) + ½ · Σ_{l'} e_{l',l}

with t_l the layer's per-microbatch time (compute and communication, gradient sync excluded), comm_l its
communication (sync_l, the once-per-step gradient sync, included), compute_l = t_l + sync_l − comm_l,
φ_l = forward FLOPs / (forward + backward FLOPs) of the layer's ops (about ⅓ for matmuls) and half
of the layer's non-gradient-sync communication (tensor parallelism's collectives come in forward/backward
pairs of equal size; the once-per-step gradient sync is not repeated). e_{l',l} is the resharding of an
op's output in layer l' for a reader in layer l (``LayerCosts.replayed_edges``, forward and backward;
a parameter's or input's edges are left out: their backward half is a gradient's reduction, their forward
a slice, and a tied weight's cross-stage gradient all-reduce is no replay): codegen emits a
redistribution right before its reader, inside the reader's checkpointed region, so the replay re-runs
its forward half. Megatron's all-reduces are such edges (a row-parallel output's Partial → Replicate in
forward, a column-parallel input's gradient in backward): measured on the 2-rank GPT of the fidelity
benchmark, tensor parallelism with every layer recomputed ran 29 all-reduces of the [16, 128, 256]
activation per step against 20 without recompute, while comm_l alone priced about 4 % of them.

The replay. Backward re-creates a recomputed layer's activations (save_l = act_l − keep_l more bytes)
while it runs that layer's backward; by then the layers after it in the stage have run theirs and freed
what they kept, m_l (keep_l if recomputed, else act_l), and the other in-flight microbatches keep all of
theirs. So the stage's peak is its no-replay peak (f microbatches' Σ m, the transient, the state) plus

    replay(P) = max(0, max_{j ∈ P} (save_j − Σ_{l ∈ (j, i]} m_l))

for recomputed layers P of stage k..i: recomputing every layer costs the last one's save_i on top of
f · Σ keep; recomputing only early layers costs nothing when what the later layers keep exceeds it.
(Measured on the GPT example recomputing every layer: the peak comes in the replay of the last layer.)

Choice per table entry (stage k..i, option m, f in flight, microbatch scale s = b/b₀): layers marked
"full" are always recomputed, "none" never; the "auto" layers are taken in one order, most bytes saved
per second of extra forward first (ties: lower layer first), and the entry uses the shortest prefix of
that order, restricted to k..i, whose memory

    mem_p = mem − f · s · Σ_{l ∈ prefix} (act_l − keep_l) + s · replay(prefix)

fits the device; its latency is lat + s · Σ_{l ∈ prefix} fwd_l. Extra time grows with the prefix, so the
first fitting prefix is the fastest; with identical layers this is exactly "the fewest recomputed layers
that fit", and only L + 1 prefixes per (k, i) are ever tried, so the dimension costs O(L³ · F) per option.
"""
from __future__ import annotations

import fnmatch

import numpy as np

from autopar.errors import OptionError
from autopar.ir.recompute import ATTENTION_CORE, region_keys

MODES = ("none", "full", "selective", "auto")
TABLE_CHUNK = 1 << 22  # cells [k, i, prefix, f] per vectorized step of ``LayerRecompute.tables``


def check_policy(policy) -> None:
    """PlanError naming the fix when ``policy`` is not a recompute option."""
    if isinstance(policy, str) and policy in ("auto", "none", "full"):
        return
    if isinstance(policy, dict) and policy and all(isinstance(k, str) and v in MODES for k, v in policy.items()):
        return
    raise OptionError(f"recompute={policy!r} is not a recompute option; use 'auto', 'none', 'full' or a dict "
                    f"{{layer glob: 'none' | 'full' | 'selective' | 'auto'}}, e.g. {{'blocks.*': 'full'}}")


def layer_modes(policy, graph, layers) -> list[str]:
    """The mode of every layer (see module docstring)."""
    check_policy(policy)
    if isinstance(policy, str):
        return [policy] * layers.count
    paths = [_module_paths(graph, names) | {str(layer)} for layer, names in enumerate(layers.nodes)]
    everywhere = sorted(set().union(*paths))
    for glob in policy:
        if not any(fnmatch.fnmatchcase(p, glob) for p in everywhere):
            shown = ", ".join(repr(p) for p in [p for p in everywhere if not p.isdigit()][:4])
            raise OptionError(f"recompute glob {glob!r} matches no layer: it is matched against module paths "
                              f"(here {shown or 'none'}, ...) and layer indices 0..{layers.count - 1}; fix the glob")
    out = []
    for here in paths:
        match = next((mode for glob, mode in policy.items() if any(fnmatch.fnmatchcase(p, glob) for p in here)),
                     "auto")
        out.append(match)
    return out


def _module_paths(graph, names: list[str]) -> set[str]:
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    out = set()
    for name in names:
        stack = nodes[name].meta.get("nn_module_stack") or {}
        out.update(path for path, _ in stack.values() if path)
    return out


def forward_share(graph, layers) -> np.ndarray:
    """φ_l: forward FLOPs / all FLOPs of layer l's ops (⅓ where the layer has none counted)."""
    from autopar.cost_models.compute import node_flops

    nodes = {n.name: n for n in graph.gm.graph.nodes}
    out = np.full(layers.count, 1 / 3)
    for layer, names in enumerate(layers.nodes):
        fwd = bwd = 0.0
        for name in names:
            try:
                f, b = node_flops(nodes[name])
            except Exception:  # an op the FLOP counter cannot run contributes nothing
                continue
            fwd, bwd = fwd + f, bwd + b
        if fwd + bwd > 0:
            out[layer] = fwd / (fwd + bwd)
    return out


def extra_forward(costs, share: np.ndarray) -> np.ndarray:
    """fwd_l of every layer of a ``LayerCosts`` (module docstring): the time one more forward costs."""
    compute = np.maximum(costs.t + costs.sync - costs.comm, 0.0)
    return share * compute + 0.5 * np.maximum(costs.comm - costs.sync, 0.0) + 0.5 * replayed_resharding(costs)


def replayed_resharding(costs) -> np.ndarray:
    """Σ_{l'} e_{l',l} per layer l: the resharding (forward and backward) of op outputs into readers in layer
    l, which a replay of layer l runs again in its forward half (module docstring)."""
    edges = getattr(costs, "replayed_edges", None)
    return np.zeros(len(costs.t)) if edges is None else np.asarray(edges).sum(axis=0)


def recomputed_ops(layers, recompute: dict[int, str], graph) -> dict[str, object]:
    """{op name: its region key} for the ops whose activations backward recomputes under ``recompute``
    ({layer: mode}); a region is what one checkpoint call replays (``ir.recompute.region_keys``)."""
    node_layers = {name: layer for layer, names in enumerate(layers.nodes) for name in names}
    return region_keys(graph, node_layers, recompute)


class LayerRecompute:
    """Per-layer recompute prices of one mesh option's solution at b₀ (module docstring): save, fwd, act."""

    def __init__(self, costs, share: np.ndarray, keep: np.ndarray, modes: list[str]):
        self.act = costs.act
        self.save = np.maximum(costs.act - keep, 0.0)
        self.fwd = extra_forward(costs, share)
        self.forced = np.array([m == "full" for m in modes])
        auto = [layer for layer, m in enumerate(modes) if m == "auto" and self.save[layer] > 0]
        self.order = sorted(auto, key=lambda n: (-self.save[n] / max(self.fwd[n], 1e-12), n))
        self._prefixes: dict[tuple[int, int], list] = {}
        self._arrays: tuple[np.ndarray, ...] | None = None

    def replay(self, chosen, k: int, i: int) -> float:
        """replay(P) of stage k..i with layers ``chosen`` recomputed (module docstring), by its definition."""
        kept = [self.act[n] - (self.save[n] if n in chosen else 0.0) for n in range(k, i + 1)]
        out = 0.0
        for j in chosen:
            out = max(out, self.save[j] - sum(kept[j - k + 1:]))
        return float(out)

    def _forced(self, k: int, i: int) -> tuple[float, float]:
        rng = slice(k, i + 1)
        on = self.forced[rng]
        return float(self.save[rng][on].sum()), float(self.fwd[rng][on].sum())

    def prefixes(self, k: int, i: int) -> list[tuple[tuple[int, ...], float, float, float]]:
        """[(recomputed layers, Σ save, Σ fwd, replay)] for the forced layers of k..i plus each prefix of
        the auto order restricted to k..i, shortest first."""
        if (k, i) not in self._prefixes:
            self._prefixes[k, i] = self._build_prefixes(k, i)
        return self._prefixes[k, i]

    def _build_prefixes(self, k: int, i: int) -> list:
        save, fwd = self._forced(k, i)
        chosen = tuple(layer for layer in range(k, i + 1) if self.forced[layer])
        out = [(chosen, save, fwd, self.replay(chosen, k, i))]
        for layer in self.order:
            if k <= layer <= i:
                save, fwd = save + self.save[layer], fwd + self.fwd[layer]
                chosen = tuple(sorted(chosen + (layer,)))
                out.append((chosen, save, fwd, self.replay(chosen, k, i)))
        return out

    def tables(self, latency: np.ndarray, memory: np.ndarray, scale: float, budget: float):
        """(latency [k, i, f], fits [k, i, f], prefix index [k, i, f]) with the first fitting prefix.

        Vectorized over (k, i, prefix, f), in blocks of first layers k that bound the temporaries; the
        arithmetic is that of evaluating ``prefixes(k, i)`` one by one (the replay term's sums grouped
        differently), so the chosen entries agree."""
        L, _, F = memory.shape
        f_scaled = np.arange(1, F + 1) * scale
        save, fwd, replay, index = self._prefix_arrays()
        best_lat = np.full(memory.shape, np.inf)
        best_p = np.full(memory.shape, -1, dtype=int)
        block = max(1, TABLE_CHUNK // (L * save.shape[2] * F))
        rows = np.arange(L)[None, :, None]
        for lo in range(0, L, block):
            ks = slice(lo, min(L, lo + block))
            mem = memory[ks][:, :, None, :] - f_scaled * save[ks][:, :, :, None] + scale * replay[ks][:, :, :, None]
            fits = mem <= budget                                                            # [k, i, q, f]
            first = fits.argmax(axis=2)                                                     # [k, i, f]
            any_fit = fits.any(axis=2)
            ks_idx = np.arange(ks.start, ks.stop)[:, None, None]
            best_lat[ks] = np.where(any_fit, latency[ks][:, :, None] + scale * fwd[ks_idx, rows, first], np.inf)
            best_p[ks] = np.where(any_fit, index[ks_idx, rows, first], -1)
        return best_lat, best_p >= 0, best_p

    def _prefix_arrays(self) -> tuple[np.ndarray, ...]:
        """[k, i, q] for q = 0..P over the auto order: Σ save, Σ fwd and replay of the forced layers of k..i
        plus the order's first q layers that lie in k..i, and that prefix's index in ``prefixes(k, i)``.
        A q whose layer lies outside k..i repeats q - 1, so the first fitting q is always a distinct prefix.
        Sums run in the order ``_build_prefixes`` adds them (cumsum is sequential)."""
        if self._arrays is not None:
            return self._arrays
        L = len(self.act)
        forced = np.zeros((2, L, L))
        if self.forced.any():
            for k in range(L):
                for i in range(k, L):
                    forced[:, k, i] = self._forced(k, i)
        order = np.array(self.order, dtype=int)
        k, i = np.arange(L)[:, None, None], np.arange(L)[None, :, None]
        inside = (k <= order) & (order <= i)                                            # [k, i, P]
        save = np.cumsum(np.concatenate([forced[0][..., None], np.where(inside, self.save[order], 0.0)], 2), 2)
        fwd = np.cumsum(np.concatenate([forced[1][..., None], np.where(inside, self.fwd[order], 0.0)], 2), 2)
        index = np.concatenate([np.zeros((L, L, 1), dtype=int), np.cumsum(inside, 2)], 2)
        self._arrays = (save, fwd, self._replay_arrays(len(order)), index)
        return self._arrays

    def _replay_arrays(self, n_order: int) -> np.ndarray:
        """replay [k, i, q] (module docstring). With member[q, l] = l forced or among the order's first q,
        m[q, l] = act_l − save_l · member and C[q, j] = Σ_{l ≤ j} m[q, l]: replay = max(0, max over recomputed
        j in k..i of (save_j + C[q, j]) − C[q, i]), the inner max a running max from k."""
        L = len(self.act)
        rank = np.full(L, np.inf)
        rank[np.array(self.order, dtype=int)] = np.arange(len(self.order))
        member = self.forced[None, :] | (rank[None, :] < np.arange(n_order + 1)[:, None])   # [q, l]
        running = np.cumsum(self.act[None, :] - self.save[None, :] * member, axis=1)        # C[q, j]
        value = np.where(member, self.save[None, :] + running, -np.inf)
        out = np.zeros((L, L, n_order + 1))
        for k in range(L):
            top = np.maximum.accumulate(value[:, k:], axis=1)                               # [q, i - k]
            out[k, k:, :] = np.maximum(0.0, top - running[:, k:]).T
        return out

    def choice(self, k: int, i: int, p: int) -> tuple[int, ...]:
        return self.prefixes(k, i)[p][0]


def stage_modes(modes: list[str], chosen: tuple[int, ...], k: int, i: int) -> dict[int, str]:
    """{layer: "full" | "selective"} of stage k..i: the layers the DP chose (forced ones included) and the
    layers forced to "selective"."""
    out = {layer: "selective" for layer in range(k, i + 1) if modes[layer] == "selective"}
    out.update({layer: "full" for layer in chosen})
    return out


def core_share(graph, layers) -> np.ndarray:
    """Share of each layer's forward FLOPs in its attention-core ops (what selective recompute re-runs)."""
    from autopar.cost_models.compute import node_flops

    nodes = {n.name: n for n in graph.gm.graph.nodes}
    core = {getattr(op, "overloadpacket", op) for op in ATTENTION_CORE}
    out = np.zeros(layers.count)
    for layer, names in enumerate(layers.nodes):
        total = part = 0.0
        for name in names:
            try:
                f = node_flops(nodes[name])[0]
            except Exception:  # an op the FLOP counter cannot run contributes nothing
                continue
            total += f
            part += f if getattr(nodes[name].target, "overloadpacket", None) in core else 0.0
        out[layer] = part / total if total else 0.0
    return out


def recompute_seconds(solution, graph, layers, blocks, mesh_shape, recompute: dict[int, str]) -> float:
    """Seconds per step the stage's ``solution`` spends recomputing: Σ fwd_l over its "full" layers, and
    the attention core's share of fwd_l for its "selective" ones (module docstring)."""
    from autopar.passes.batch_dims import batch_dims
    from autopar.passes.layer_costs import layer_costs

    costs = layer_costs(solution, layers, batch_dims(graph), mesh_shape, 1, blocks)
    fwd = extra_forward(costs, forward_share(graph, layers))
    core = core_share(graph, layers) if "selective" in recompute.values() else None
    return float(sum(fwd[layer] * (1.0 if mode == "full" else core[layer]) for layer, mode in recompute.items()))
