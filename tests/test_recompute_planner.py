"""Recompute in the planner and on one process: the joint choice with tensor parallelism, the option's
spelling, and checkpointed regions on a generated module.

The planner cases plan a 4-layer GPT (fp16, seq 1024, meta device) on 2 V100s, one microbatch, under a
memory budget between what data parallelism needs with recompute and without. Over a slow link
(1 GB/s) tensor parallelism's activation all-reduces cost more than a third more forward, so the planner
keeps data parallelism and recomputes; over a fast one (1 TB/s) it shards instead and recomputes nothing.
"""
import dataclasses

import pytest
import torch
import torch.fx as fx

import autopar
from autopar.errors import PlanError
from autopar.hardware.cluster import Link
from autopar.passes.recompute import LayerRecompute, check_policy
from autopar.plan import Plan
from autopar.runtime.recompute_regions import outline_recompute
from autopar.views.visualize import plan_to_html
from examples.gpt import GPT, GPTConfig, make_batch

CFG = GPTConfig(vocab_size=8192, seq_len=1024, n_layer=4, n_head=16, n_embd=1024)
GiB = 2 ** 30


def _plan(bandwidth: float, budget_gib: float, **options) -> autopar.Plan:
    link = Link(latency=5e-6, bandwidth=bandwidth)
    cluster = dataclasses.replace(autopar.Cluster.preset("p3.16xlarge"), devices_per_node=2, mesh_shape=None,
                                  intra_node=link, memory_per_device=budget_gib * GiB)
    with torch.device("meta"):
        model = GPT(CFG).half()
    return autopar.plan(model, cluster, make_batch(CFG, 8, device="meta"), microbatches=1, **options)


def _sharded(stage) -> int:
    return sum(1 for n, sh in stage.shardings.items() if n.startswith("p_") and "S" in sh.out)


def test_slow_link_recomputes_rather_than_shard():
    loose = _plan(1e9, 16, recompute="none")
    assert len(loose.stages) == 1 and _sharded(loose.stages[0]) == 0, "with memory to spare: data parallel"
    budget = 0.72 * loose.stages[0].predicted["memory"] / GiB  # below what it needs without recompute
    plan = _plan(1e9, budget)
    (stage,) = plan.stages
    assert stage.recompute and set(stage.recompute.values()) == {"full"}, stage.recompute
    assert _sharded(stage) == 0, "recompute was cheaper than tensor parallelism over a slow link"
    assert stage.predicted["memory"] <= budget * GiB
    assert stage.predicted["recompute"] > 0 and plan.recompute == "auto"
    assert "recompute in backward: layers" in plan.summary()
    assert "layers 0, 1" in plan_to_html(plan)
    assert Plan.from_json(plan.to_json()) == plan


def test_fast_link_shards_rather_than_recompute():
    # The budget is 80 % of what data parallelism needs without recompute (the slow link's loose plan: over
    # 1 TB/s the loose plan already shards weights for their shorter optimizer step, and 80 % of that would
    # leave recompute the only lever). ZeRO, the third lever, is off: tests/test_zero_planner.py.
    data_parallel = _plan(1e9, 16, recompute="none", zero=0).stages[0]
    assert _sharded(data_parallel) == 0
    budget = 0.8 * data_parallel.predicted["memory"] / GiB
    plan = _plan(1e12, budget, zero=0)
    (stage,) = plan.stages
    assert not stage.recompute, "tensor parallelism was cheaper than recompute over a fast link"
    assert _sharded(stage) > 0 and stage.predicted["memory"] <= budget * GiB


@pytest.mark.parametrize("bad", ["sometimes", 1, {"blocks.*": "half"}, {}, None])
def test_bad_recompute_option_names_the_fix(bad):
    with pytest.raises(PlanError, match="recompute="):
        check_policy(bad)
    with pytest.raises(PlanError, match="'auto', 'none', 'full'"):
        autopar.planner.driver.PlanOptions(recompute=bad)


def test_plan_json_with_a_bad_recompute_mode_is_one_plan_error():
    import json

    from tests.models import make_small_gpt

    model, batch = make_small_gpt()
    plan = autopar.plan(model, autopar.Cluster.local(2), batch, stages=1, recompute="full")
    assert plan.stages[0].recompute == {0: "full", 1: "full"}
    d = json.loads(plan.to_json())
    d["stages"][0]["recompute"] = {"0": "sometimes"}
    with pytest.raises(PlanError, match="recompute modes"):
        Plan.from_json(json.dumps(d))


class _Costs:
    """Two identical layers and one whose activations are cheap to keep: the shortest fitting prefix."""

    t = [3.0, 3.0, 3.0]
    comm = sync = [0.0, 0.0, 0.0]
    act = [10.0, 10.0, 1.0]
    peak = [10.0, 10.0, 10.0]


def test_replay_counts_what_later_layers_no_longer_keep():
    import numpy as np

    costs = _Costs()
    for field in ("t", "comm", "sync", "act", "peak"):
        setattr(costs, field, np.array(getattr(costs, field)))
    rec = LayerRecompute(costs, np.full(3, 1 / 3), keep=np.ones(3), modes=["auto"] * 3)
    assert rec.replay((0,), 0, 2) == 0.0    # layer 0's 9 bytes come back after layers 1-2 freed 10 + 1
    assert rec.replay((1,), 0, 2) == 8.0    # layer 1 re-creates 9 after layer 2 freed its 1
    assert rec.replay((0, 1), 0, 2) == 8.0  # layer 0's replay then sees 1 + 1 freed: 7 < 8
    assert rec.replay((0, 1), 0, 1) == 9.0  # a stage ending at layer 1: nothing after it


def test_fewest_recomputed_layers_that_fit():
    import numpy as np

    costs = _Costs()
    for field in ("t", "comm", "sync", "act", "peak"):
        setattr(costs, field, np.array(getattr(costs, field)))
    rec = LayerRecompute(costs, np.full(3, 1 / 3), keep=np.ones(3), modes=["auto"] * 3)
    latency = np.full((3, 3), np.inf)
    latency[0, 2] = 9.0
    memory = np.full((3, 3, 1), np.inf)
    memory[0, 2, 0] = 21.0
    lat, fits, prefix = rec.tables(latency, memory, 1.0, 13.0)  # one layer saves 9 bytes
    assert fits[0, 2, 0] and rec.choice(0, 2, prefix[0, 2, 0]) == (0,) and lat[0, 2, 0] == 10.0
    # Both: 21 − 18 + replay 8 (layer 1's 9 re-created while layer 2 keeps its 1) = 11; (0,) alone is 12.
    lat, fits, prefix = rec.tables(latency, memory, 1.0, 11.0)
    assert fits[0, 2, 0] and rec.choice(0, 2, prefix[0, 2, 0]) == (0, 1)
    lat, fits, prefix = rec.tables(latency, memory, 1.0, 10.9)
    assert not fits[0, 2, 0], "negative control: without the replay's 8 bytes both layers would fit in 3"
    forced = LayerRecompute(costs, np.full(3, 1 / 3), keep=np.ones(3), modes=["none", "full", "none"])
    assert forced.choice(0, 2, 0) == (1,)


def test_checkpointed_region_keeps_gradients_and_drops_saved_activations():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x))).sum()

    torch.manual_seed(0)
    net, x = Net(), torch.randn(32, 16)
    gm = fx.symbolic_trace(net)
    for node in gm.graph.nodes:
        if node.op in ("call_module", "call_function") and node.name in ("a", "tanh"):
            node.meta["recompute"] = 0
    plain = fx.symbolic_trace(net)
    # symbolic_trace gives call_module nodes; regions take call_function ones, so re-trace as functions
    gm = fx.GraphModule(net, _functional(gm.graph))
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.name.startswith(("linear", "tanh")) and node.name != "linear_1":
            node.meta["recompute"] = 0
    names = outline_recompute(gm)
    assert names == ["recompute_0"] and "checkpoint" not in gm.code and "recompute_0" in gm.code
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        loss = gm(x)
    with_region = sum(saved)
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        ref = plain(x)
    assert with_region < sum(saved), "the region's activations (32 × 64 twice) must not be kept"
    grads = torch.autograd.grad(loss, list(net.parameters()))
    ref_grads = torch.autograd.grad(ref, list(net.parameters()))
    assert all(torch.allclose(g, r) for g, r in zip(grads, ref_grads))


def _functional(graph: fx.Graph) -> fx.Graph:
    """The traced graph with each Linear call written as F.linear on get_attr weights."""
    out, env = fx.Graph(), {}
    for node in graph.nodes:
        if node.op == "call_module":
            w, b = out.get_attr(f"{node.target}.weight"), out.get_attr(f"{node.target}.bias")
            env[node] = out.call_function(torch.nn.functional.linear, (env[node.args[0]], w, b))
        else:
            env[node] = out.node_copy(node, lambda a: env[a])
    return out
