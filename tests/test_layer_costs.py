"""Per-layer prices of a mesh option's solution and its ZeRO-2 variant (``passes/layer_costs.py``), and the
third memory point that variant gives the stage DP (``inter_op.StageCosts``). No process group."""
import numpy as np
import torch

import autopar
from autopar.passes.batch_dims import batch_dims, rescale
from autopar.passes.capture import capture
from autopar.passes.cluster_layers import cluster_layers, find_repeated_blocks
from autopar.passes.inter_op import StageCosts
from autopar.passes.intra_op import CostEnv, build_problem, solve_built
from autopar.passes.intra_op_groups import is_light
from autopar.passes.layer_costs import layer_costs, zero2_variant
from autopar.passes.strategies import generate_strategies
from autopar.planner.options import PlanOptions, training_spec
from examples.gpt import GPT, GPTConfig, make_batch

CFG = GPTConfig(vocab_size=256, seq_len=32, n_layer=4, n_head=4, n_embd=64)


def _setup():
    with torch.device("meta"):
        model = GPT(CFG)
    graph = capture(model, make_batch(CFG, 16, device="meta"))
    blocks = find_repeated_blocks(graph)
    return graph, blocks, cluster_layers(graph, blocks, None, is_light), training_spec(graph, PlanOptions())


def _priced(mesh=(1, 4)):
    """(graph, blocks, layers, training, whole-model solution's LayerCosts, its ZeRO-2 variant's, both solutions)."""
    graph, blocks, layers, training = _setup()
    env = CostEnv(autopar.Cluster.local(4), mesh, training)
    built = build_problem(graph, generate_strategies(graph, mesh), blocks, env, None, None, True)
    first = solve_built(built, env, 60.0)
    sharded = zero2_variant(first, built.edges)
    base, twin = (layer_costs(s, layers, batch_dims(graph), mesh, 16, blocks) for s in (first, sharded))
    return graph, blocks, layers, training, base, twin, (first, sharded, built)


def test_zero2_variant_keeps_every_layout_and_trades_state_bytes_for_one_all_gather():
    """Same strategies and per-microbatch times; per layer, parameter bytes drop by the gradients and optimizer
    state that level 2 shards, and the once-per-step sync grows by the all-gather; edges and activations stay."""
    *_, base, twin, (first, sharded, built) = _priced()
    assert sharded.strategies == first.strategies
    assert np.allclose(twin.t, base.t) and np.allclose(twin.edges, base.edges)
    assert np.allclose(twin.act, base.act) and np.allclose(twin.peak, base.peak)
    holds = base.param > 0
    assert holds.any() and np.all(twin.param[holds] < base.param[holds]) and np.all(twin.sync[holds] > base.sync[holds])
    assert zero2_variant(sharded, built.edges) is None, "nothing left to move"


def test_the_stage_dp_prices_the_zero2_variant_where_memory_is_tight():
    """With a budget between the whole model's memory on (1, 4) and its ZeRO-2 variant's, that stage is priced
    (finite) through the variant, which is not counted as a solve. (At the full-batch reference: the lean
    solution, which may price below the variant on a model this small, is made at the smallest one only.)"""
    graph, blocks, layers, training, base, twin, _ = _priced()
    total = [c.ranges[2][0, -1] + c.ranges[3][0, -1] + c.ranges[4][0, -1] for c in (base, twin)]
    assert total[1] < total[0]
    cluster = autopar.Cluster.local(4, memory_per_device=sum(total) / 2)
    costs = StageCosts({8: rescale(graph, 2), 16: graph}, layers, blocks, cluster, training, batch_dims(graph), 60.0)
    m = next(m for m, o in enumerate(costs.options) if o.logical == (1, 4) and o.physical == (1, 4))
    table = costs.table(16, 1, 1)
    assert costs.solves == sum(c.solved for v in costs.variants.values() for c in v)
    assert np.isfinite(table[0, layers.count - 1, m, 0]), "the whole model fits on (1, 4) at ZeRO 2"
    picked = costs.costs(m)[costs.picks[1][0, 0, layers.count - 1, m, 0]]
    assert not picked.solved and picked.reference_batch == 16, "through the variant"
