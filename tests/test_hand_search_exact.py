"""The hand-grid search's shortcuts leave every score what a fresh ``autopar.plan`` of the config gives.

* shared microbatch graphs (``hand_search.microbatch_graphs``): every config's plan on the graphs shared across
  the grid prices exactly as ``autopar.plan`` on a fresh capture; control: a wrong shared graph is caught;
* the step-time floor (``hand_bounds``) never exceeds a plan's predicted step, fitting or with memory ignored,
  on a cluster where compute dominates (so the floor is tight); control: the floor without its 1/k (a bound
  that forgets the mesh splits the work) exceeds some plans, so the check can fail;
* the pruned search returns the unpruned search's best, memory-binds answer and ceiling, planning fewer configs.
"""
import dataclasses

import pytest
import torch

import autopar
from autopar.baselines.hand_bounds import StepFloor
from autopar.baselines.hand_search import Scored, capture_once, microbatch_graphs, precapture, search_hand
from autopar.baselines.megatron_configs import (
    MegatronConfig,
    config_floor,
    megatron_options,
    score_config,
)
from autopar.errors import InfeasibleError
from autopar.planner.driver import plan_graph
from autopar.planner.options import PlanOptions
from examples.gpt import GPT, GPTConfig, make_batch

GPT_SMALL = GPTConfig(vocab_size=256, seq_len=32, n_layer=4, n_head=4, n_embd=64)
CONFIGS = [MegatronConfig(dp=4, tp=1, pp=1, microbatches=2, precision="bf16"),
           MegatronConfig(dp=2, tp=2, pp=1, microbatches=4, distributed_optimizer=True, precision="bf16"),
           MegatronConfig(dp=2, tp=1, pp=2, microbatches=4, recompute="full", precision="bf16"),
           MegatronConfig(dp=1, tp=2, pp=2, microbatches=4, virtual_stages=2, precision="bf16"),
           MegatronConfig(dp=1, tp=1, pp=4, microbatches=8, recompute="selective", precision="bf16"),
           MegatronConfig(dp=1, tp=4, pp=1, microbatches=2, precision="bf16")]


def _slow_compute(cluster):
    """``cluster`` with matmuls 10^4 times slower: compute dominates every op, so floors come near the plans."""
    return dataclasses.replace(cluster, peak_flops={k: v / 1e4 for k, v in cluster.peak_flops.items()},
                               matmul_curve={})


def _fresh(model, batch, cluster, config) -> float | None:
    """``autopar.plan`` of ``config`` from scratch; None when it does not fit."""
    try:
        plan = autopar.plan(model, cluster, batch, **megatron_options(config, 4, cluster.devices_per_node))
    except InfeasibleError:
        return None
    return plan.predicted["step_time"] if plan.predicted["peak_memory"] <= cluster.memory_per_device else None


@pytest.fixture(scope="module")
def small():
    with torch.device("meta"):
        model = GPT(GPT_SMALL)
    return model, make_batch(GPT_SMALL, 16, device="meta")


def test_shared_microbatch_graphs_score_every_config_as_a_fresh_plan(small):
    model, batch = small
    cluster = autopar.Cluster.preset("dgx-a100", gpus=4).with_memory(4.5e6)
    graph, recapture = capture_once(model, batch, "bf16")
    precapture(graph, recapture, {c.microbatches for c in CONFIGS})
    shared = [score_config(graph, cluster, c, 4, recapture).step_time for c in CONFIGS]
    fresh = [_fresh(model, batch, cluster, c) for c in CONFIGS]
    assert shared == fresh
    assert any(t is None for t in fresh) and any(t is not None for t in fresh), "the budget splits the configs"
    # control: a shared graph at the wrong microbatch count is caught by the same comparison
    config = CONFIGS[1]
    wrong = plan_graph(graph, cluster, PlanOptions(**megatron_options(config, 4, 8)), recapture=recapture,
                       at_microbatch=lambda b: microbatch_graphs(graph, recapture)(2 * b))
    assert wrong.predicted["step_time"] != fresh[1]


def test_the_floor_never_exceeds_a_plan_and_a_looser_floor_would(small):
    model, batch = small
    cluster = _slow_compute(autopar.Cluster.preset("dgx-a100", gpus=4))
    graph, recapture = capture_once(model, batch, "bf16")
    floor = StepFloor(graph, cluster, 4)
    ratios, unsplit = [], []
    for config in CONFIGS:
        step = score_config(graph, cluster, config, 4, recapture).step_time
        assert step is not None
        ratios.append(config_floor(floor, config, 4) / step)
        unsplit.append(ratios[-1] * config.dp * config.tp)
    assert max(ratios) <= 1.0 and min(ratios) > 0.3, ratios
    assert max(unsplit) > 1.0, "control: a floor that ignores the mesh's split of the work exceeds some plans"


@pytest.mark.slow
def test_the_pruned_search_returns_the_unpruned_answer_planning_fewer_configs(small):
    model, batch = small
    cluster = _slow_compute(autopar.Cluster.preset("dgx-a100", gpus=4)).with_memory(4.5e6)
    graph, recapture = capture_once(model, batch, "bf16")
    grid = [MegatronConfig(dp=dp, tp=4 // (dp * pp), pp=pp, microbatches=b, recompute=rc, precision="bf16")
            for dp, pp in ((4, 1), (2, 1), (2, 2), (1, 4)) for rc in ("none", "full") for b in (1, 2, 4, 8)
            if b >= pp and 16 % (b * dp) == 0]
    precapture(graph, recapture, {c.microbatches for c in grid})
    roomy = cluster.with_memory(2.0 ** 50)
    floor = StepFloor(graph, cluster, 4)

    def score(config, unbounded=False) -> Scored:
        return score_config(graph, roomy if unbounded else cluster, config, 4, recapture)

    def layout(c):
        return c.dp, c.tp, c.pp, c.recompute

    plain = search_hand(grid, score, layout, memory_free=lambda c: c.recompute == "none", parallel=False)
    pruned = search_hand(grid, score, layout, memory_free=lambda c: c.recompute == "none", parallel=False,
                         floor=lambda c: config_floor(floor, c, 4))
    assert pruned.best.config == plain.best.config and pruned.best.step_time == plain.best.step_time
    assert pruned.memory_binds == plain.memory_binds and pruned.ceiling == plain.ceiling
    skipped = [r for r in pruned.scored + pruned.free if r.status.startswith("skipped")]
    assert skipped, "the floor ruled some configs out"
    planned = {(r.config, r.step_time) for r in pruned.scored if r.step_time is not None}
    assert planned <= {(r.config, r.step_time) for r in plain.scored if r.step_time is not None} | planned


def test_a_config_reads_back_from_its_text_and_bad_text_is_refused():
    for config in CONFIGS + [MegatronConfig(dp=2, tp=2, pp=8, microbatches=256, virtual_stages=2, recompute="full",
                                            distributed_optimizer=True, precision="bf16")]:
        assert MegatronConfig.parse(str(config), precision="bf16") == config
    for bad in ("dp2·tp2·pp8·X4", "dp2·tp·pp1·B1", "tp2·dp2·pp1·B1", "dp2·tp2·pp1·B1·rc-some"):
        with pytest.raises(ValueError):
            MegatronConfig.parse(bad)
