"""ZeRO 1-2's gradient sync priced from the profile's "zero_pair/<n>@step" fit (the reduce-scatter +
all-gather pair as the runtime issues it), where a CPU profile measured it; plans on clusters without that
fit keep the one-all-reduce price. Fast tier: planning on a simulated 2-rank CPU cluster, no process groups."""
import dataclasses

import pytest
import torch

import autopar
from autopar.cost_models.communication import AxisLink, zero_gather_time, zero_pair_excess, zero_pair_time
from autopar.hardware.cluster import CollectiveFit, Link
from autopar.planner.plan_builder import exposed_sync
from examples.gpt import GPT, GPTConfig, make_batch

MiB = 2**20
ALL_REDUCE = CollectiveFit(alpha=5e-4, beta=2e-9)
PAIR = CollectiveFit(alpha=2e-3, beta=8e-9)  # gloo measured the pair at 2-4x one all-reduce of the buffer
CFG = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, n_embd=64)


def _with_fits(cluster: autopar.Cluster, **fits) -> autopar.Cluster:
    link = dataclasses.replace(cluster.intra_node, fits={**cluster.intra_node.fits, "all_reduce/2": ALL_REDUCE,
                                                         **fits})
    return dataclasses.replace(cluster, intra_node=link, inter_node=link)


def _zero2_plan(cluster: autopar.Cluster) -> autopar.Plan:
    torch.manual_seed(0)
    model = GPT(CFG)
    return autopar.plan(model, cluster, make_batch(CFG, 8), stages=1, recompute="none", microbatches=2,
                        zero=2)


def test_the_pair_adds_its_excess_over_the_all_reduce_only_where_measured():
    link = Link(latency=5e-4, bandwidth=2e9, fits={"all_reduce/2": ALL_REDUCE, "zero_pair/2@step": PAIR})
    axis = AxisLink(2, 0, 1e9, link)
    m = 16 * MiB
    assert zero_pair_excess(axis, m) == pytest.approx(PAIR.time(m) - ALL_REDUCE.time(m))
    assert zero_gather_time(axis, m) == pytest.approx((8e-9 - 2e-9) * m)  # per byte beyond the all-reduce
    # control: no pair fit, no excess, and the after-step all-gather's bandwidth term as before
    plain = AxisLink(2, 0, 1e9, Link(latency=5e-4, bandwidth=2e9, fits={"all_reduce/2": ALL_REDUCE}))
    assert zero_pair_excess(plain, m) == 0.0
    assert zero_gather_time(plain, m) == pytest.approx(plain.bandwidth_time("all_gather", m))
    assert zero_pair_time(axis, m) > zero_pair_time(plain, m) - 1.0  # both defined
    # the excess is exposed in full: nothing hides the gathers it runs among
    assert exposed_sync(1.0, 10.0, 4, 1.0, 0.0, 0.3) == pytest.approx(exposed_sync(1.0, 10.0, 4, 1.0) + 0.3)


def test_a_zero2_plan_on_a_profiled_cpu_cluster_pays_the_measured_pair():
    base = _with_fits(autopar.Cluster.local(2))
    plain = _zero2_plan(base)
    priced = _zero2_plan(_with_fits(autopar.Cluster.local(2), **{"zero_pair/2@step": PAIR}))
    assert plain.stages[0].zero and priced.stages[0].zero, "zero=2 shards the weight updates"
    excess = priced.stages[0].predicted["zero_pair_excess"]
    assert excess > 0
    assert priced.predicted["step_time"] == pytest.approx(plain.predicted["step_time"] + excess, rel=1e-6)
    # control: without the fit the plan has no such key, so unprofiled (GPU) plans stay byte-identical
    assert "zero_pair_excess" not in plain.stages[0].predicted
    assert plain.to_json() == _zero2_plan(base).to_json()
