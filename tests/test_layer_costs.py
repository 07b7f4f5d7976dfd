"""Per-layer prices of a mesh option's solution and its ZeRO-2 and ZeRO-3 variants (``passes/layer_costs.py``), the
third memory point the ZeRO-2 variant gives the stage DP, and the ZeRO-3 variant it is offered only where nothing
fits without it (``inter_op.StageCosts``). No process group."""
import dataclasses

import numpy as np
import torch

import autopar
from autopar.passes.batch_dims import batch_dims, rescale
from autopar.passes.capture import capture
from autopar.passes.cluster_layers import cluster_layers, find_repeated_blocks
from autopar.passes.inter_op import StageCosts, choose_stages
from autopar.passes.intra_op import CostEnv, build_problem, solve_built
from autopar.passes.intra_op_groups import is_light
from autopar.passes.layer_costs import layer_costs, zero2_variant, zero3_variant
from autopar.passes.strategies import generate_strategies
from autopar.planner.options import PlanOptions, training_spec
from examples.gpt import GPT, GPTConfig, make_batch

CFG = GPTConfig(vocab_size=256, seq_len=32, n_layer=4, n_head=4, n_embd=64)
# CPU ranks whose optimizer step is negligible (1 TB/s of memory): the unconstrained solution keeps level 0
# (ZeRO only costs time there) and the variants are what moves it
LOCAL = dataclasses.replace(autopar.Cluster.local(4), memory_bandwidth=1e12)


def _setup(options: PlanOptions = PlanOptions()):
    with torch.device("meta"):
        model = GPT(CFG)
    graph = capture(model, make_batch(CFG, 16, device="meta"))
    blocks = find_repeated_blocks(graph)
    return graph, blocks, cluster_layers(graph, blocks, None, is_light), training_spec(graph, options)


def _priced(mesh=(1, 4), options: PlanOptions = PlanOptions()):
    """(graph, blocks, layers, training, whole-model solution's LayerCosts, its ZeRO-2 variant's, both solutions)."""
    graph, blocks, layers, training = _setup(options)
    env = CostEnv(LOCAL, mesh, training)
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
    cluster = LOCAL.with_memory(sum(total) / 2)
    costs = StageCosts({8: rescale(graph, 2), 16: graph}, layers, blocks, cluster, training, batch_dims(graph), 60.0)
    m = next(m for m, o in enumerate(costs.options) if o.logical == (1, 4) and o.physical == (1, 4))
    table = costs.table(16, 1, 1)
    assert costs.solves == sum(c.solved for v in costs.variants.values() for c in v)
    assert np.isfinite(table[0, layers.count - 1, m, 0]), "the whole model fits on (1, 4) at ZeRO 2"
    picked = costs.costs(m)[costs.picks[1][0, 0, layers.count - 1, m, 0]]
    assert not picked.solved and picked.reference_batch == 16, "through the variant"


SMALL_UNITS = PlanOptions(bucket_bytes=2 ** 12)  # ZeRO-3 units of one weight each: the model is tiny


def _whole(c) -> float:
    """Memory of the whole model as one stage of one microbatch in flight (``LayerCosts.stage_tables``)."""
    return float(c.ranges[2][0, -1] + c.ranges[3][0, -1] + c.ranges[4][0, -1])


def test_zero3_variant_shards_the_parameters_too_and_charges_its_gathered_units():
    """Same strategies and edges as the solution; per layer holding parameters, fewer parameter bytes than the
    ZeRO-2 variant (the weights themselves are sharded), the gathered units on the peak, and no after-step
    all-gather (ZeRO-3 gathers in forward and backward instead: the per-microbatch time may grow, never the sync
    by more than ZeRO-2's)."""
    graph, blocks, layers, training, base, twin, (first, sharded, built) = _priced(options=SMALL_UNITS)
    third = zero3_variant(first, built.edges)
    assert third.strategies == first.strategies
    z3 = layer_costs(third, layers, batch_dims(graph), (1, 4), 16, blocks, solved=False)
    assert np.allclose(z3.edges, base.edges) and np.allclose(z3.act, base.act)
    holds = base.param > 0
    assert np.all(z3.param[holds] < twin.param[holds]), "level 3 shards the weights as well"
    assert np.all(z3.peak >= base.peak) and np.any(z3.peak > base.peak), "the gathered units are charged"
    assert np.all(z3.t >= base.t - 1e-12) and np.all(z3.sync <= twin.sync + 1e-12)
    assert _whole(z3) < _whole(twin) < _whole(base)
    assert zero3_variant(third, built.edges) is None, "nothing left to move"


def test_the_stage_dp_offers_the_zero3_variant_only_where_nothing_fits_without_it():
    """On one option, (1, 4): with a budget between the ZeRO-3 variant's whole-model memory and the least of
    every other solution's, the whole model does not fit until ``offer_zero3``, then fits through that variant;
    ``choose_stages`` does this itself when the DP finds nothing. Negative control: with room for the ZeRO-2
    variant, the ZeRO-3 variant is never offered, so the tables (and plans) are those made without it."""
    graph, blocks, layers, training = _setup(SMALL_UNITS)
    mesh_only = [o for o in StageCosts({16: graph}, layers, blocks, LOCAL, training, {}, 60.0)
                 .options if o.logical == (1, 4) and o.physical == (1, 4)]

    def costs_at(memory):
        c = StageCosts({16: graph}, layers, blocks, LOCAL.with_memory(memory), training,
                       batch_dims(graph), 60.0)
        c.options = mesh_only
        return c

    probe = costs_at(1.0)  # every option pressed: all variants priced
    offered, held = probe.costs(0), probe.held[0]
    assert len(held) == 1 and held[0].last_resort and not any(c.last_resort for c in offered)
    budget = (_whole(held[0]) + min(_whole(c) for c in offered)) / 2
    assert _whole(held[0]) < budget

    tight = costs_at(budget)
    assert not np.isfinite(tight.table(16, 1, 1)[0, layers.count - 1, 0, 0]), "nothing fits without ZeRO-3"
    assert tight.offer_zero3() and not tight.offer_zero3(), "offered once"
    assert np.isfinite(tight.table(16, 1, 1)[0, layers.count - 1, 0, 0])
    assert tight.costs(0)[tight.picks[1][0, 0, layers.count - 1, 0, 0]].last_resort, "through the ZeRO-3 variant"
    chosen = choose_stages(costs_at(budget), 16, [1], "1f1b", None)
    assert [(s.first, s.last) for s in chosen.stages] == [(0, layers.count - 1)]

    roomy = costs_at(max(_whole(c) for c in offered) * 1.01)
    choose_stages(roomy, 16, [1], "1f1b", None)
    assert not roomy.zero3_offered and all(not c.last_resort for c in roomy.costs(0))


def test_zero3_variant_also_moves_columns_the_solve_took_at_level_2():
    """A solution that took level-2 twins (for their cheaper optimizer step) still gets a ZeRO-3 variant: its
    twins are those of each column's base, so the variant is the base layouts at level 3, not a mix that keeps
    the level-2 groups' weights whole. Control: the ZeRO-2 variant never moves a level-3 column back."""
    graph, blocks, layers, training, base, twin, (first, sharded, built) = _priced(options=SMALL_UNITS)
    from_first, from_level2 = zero3_variant(first, built.edges), zero3_variant(sharded, built.edges)
    assert from_level2 is not None, "the level-2 columns move to level 3"
    assert from_level2.choice == from_first.choice
    assert zero2_variant(from_level2, built.edges) is None


def test_a_solution_serves_multiples_of_its_reference_and_below_it_only_what_its_batch_split_divides():
    """At b₀ = 1 a 64-way split (necessarily of a flattened token dim) serves every b but holds whole samples per
    device at none below 64; at b₀ = 16 a 8-way split serves 32 and 8 but not 4 (below b₀ the batch dim itself
    must split)."""
    *_, base, _, _ = _priced()
    one = dataclasses.replace(base, batch_split=64, reference_batch=1)
    sixteen = dataclasses.replace(base, batch_split=8, reference_batch=16)
    assert all(one.serves(b) for b in (1, 2, 8)) and not any(one.splits_within(b) for b in (1, 2, 8))
    assert sixteen.serves(32) and sixteen.serves(8) and not sixteen.serves(4)
    assert sixteen.splits_within(8) and not sixteen.splits_within(4)


def test_the_stage_dp_prices_a_sequence_split_wider_than_the_microbatch(monkeypatch):
    """Two sequences of 2048 tokens on 8 devices with a budget only a split of each sequence meets: the stage
    DP must enter the layout that splits the flattened tokens 8 ways at microbatches of 1 and 2 sequences.
    ``choose_stages`` offers them only after nothing fits without (``offer_sample_splits``). Negative control:
    never offered, no stage is priced and the same budget has no plan."""
    import pytest

    from autopar.errors import InfeasibleError
    from autopar.planner.driver import memory_bounds
    from examples.gpt import make_gpt

    model, batch = make_gpt(GPTConfig(seq_len=2048, n_embd=32, n_head=1, vocab_size=64, n_layer=2), batch_size=2)
    cluster = autopar.Cluster.local(8)
    floor = memory_bounds(capture(model, batch), cluster, PlanOptions(zero=0, recompute="none"))[0]
    tight = cluster.with_memory(1.5 * floor)
    plan = autopar.plan(model, tight, batch, zero=0, recompute="none")
    attention = [sh for s in plan.stages for n, sh in s.shardings.items() if "scaled_dot_product" in n]
    assert attention and all([1, "causal_context"] in [list(k) for k in sh.kernels] for sh in attention)
    monkeypatch.setattr(StageCosts, "offer_sample_splits", lambda costs: False)
    with pytest.raises(InfeasibleError):
        autopar.plan(model, tight, batch, zero=0, recompute="none")
