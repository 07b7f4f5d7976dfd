"""Inter-op planner on simulated clusters, against Alpa's published behaviour (models on the meta device).

* GPT on 2 nodes of 8 V100 with 25 Gbps between nodes: pipeline stages across nodes, intra-op inside;
* 4 identical layers on 4 single-device nodes with plenty of memory: a pipeline over a slow link, pure
  data parallelism over a fast one. The width is odd (8191), so no axis splits a weight: the choice is
  between pipelining, splitting the batch and replicating, which is the trade-off the test is about;
* forced stage counts, manual stage lists, and the plan's text.
The DP itself is checked against brute force in test_stage_dp.py.
"""
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.errors import AutoparError, PlanError
from autopar.hardware.cluster import Link
from examples.gpt import GPT, GPTConfig, make_batch

MID = GPTConfig(vocab_size=51200, seq_len=1024, n_layer=8, n_head=16, n_embd=2048)  # 0.6B parameters


def gpt_plan(cluster, batch: int, **options) -> autopar.Plan:
    with torch.device("meta"):
        model = GPT(MID).half()
    return autopar.plan(model, cluster, make_batch(MID, batch, device="meta"), **options)


def test_gpt_on_two_v100_nodes_pipelines_across_nodes_and_shards_inside():
    plan = gpt_plan(autopar.Cluster.preset("p3.16xlarge", nodes=2), 64)  # at 16 one node computing alone wins
    assert len(plan.stages) >= 2, "the slow inter-node link should be crossed by a pipeline"
    for stage in plan.stages:
        assert len({r // 8 for r in stage.ranks}) == 1, f"stage {stage.index} spans nodes: {stage.ranks}"
    sharded = [s for s in plan.stages if len(s.ranks) > 1 and any("S" in sh.out for sh in s.shardings.values())]
    assert sharded, "stages on several devices of a node should be intra-op sharded"
    assert plan.microbatches > 1 and plan.schedule == "1f1b"
    assert plan.predicted["peak_memory"] <= 16 * 2**30


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return F.gelu(self.fc(x))


class FourBlocks(nn.Module):
    def __init__(self, d=8191):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(4))

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(x, y)


def four_node_plan(bandwidth: float) -> autopar.Plan:
    with torch.device("meta"):
        model = FourBlocks()
    x = torch.empty(8192, 8191, device="meta")  # enough compute per step that data parallelism pays on a fast link
    base = dataclasses.replace(autopar.Cluster.preset("dgx-a100", nodes=4), devices_per_node=1, mesh_shape=None,
                               memory_per_device=640 * 2**30)
    cluster = dataclasses.replace(base, inter_node=Link(latency=5e-6, bandwidth=bandwidth))
    return autopar.plan(model, cluster, (x, x.clone()), microbatches=8)


def test_a_slow_link_chooses_a_pipeline_and_a_fast_one_pure_data_parallelism():
    slow, fast = four_node_plan(25e9 / 8), four_node_plan(300e9)
    assert len(slow.stages) >= 2, [s.layers for s in slow.stages]
    assert sorted(layer for s in slow.stages for layer in range(s.layers[0], s.layers[1] + 1)) == [0, 1, 2, 3]
    assert len(fast.stages) == 1 and fast.stages[0].mesh_shape in ((1, 4), (4, 1))
    weights = {n: s.out for n, s in fast.stages[0].shardings.items() if n.startswith("p_")}
    assert set(weights.values()) == {"RR"}, "pure data parallelism keeps weights replicated"
    assert "S(0)" in fast.stages[0].shardings["x"].out, "and splits the batch"


def test_forced_stage_count_and_manual_stages():
    cluster = autopar.Cluster.preset("dgx-a100", nodes=2)
    two = gpt_plan(cluster, 16, stages=2)
    assert len({tuple(s.ranks) for s in two.stages}) == 2, "two pipeline stages (each may hold v chunks)"
    assert len(two.stages) == 2 * two.virtual_stages
    manual = [{"layers": [0, 3], "submesh": [1, 8]}, {"layers": [4, 7], "submesh": [1, 8]}]
    fixed = gpt_plan(cluster, 16, stages=manual, microbatches=4, schedule="gpipe")
    assert [s.layers for s in fixed.stages] == [(0, 3), (4, 7)]
    assert fixed.microbatches == 4 and fixed.schedule == "gpipe"
    text = fixed.summary()
    assert "stage 1" in text and "layers 4..7" in text and "bubble" in text
    assert autopar.Plan.from_json(fixed.to_json()) == fixed


def test_more_stages_than_the_clustering_has_layers_re_clusters():
    """A 2-block GPT clusters into 2 layers; stages=4 (or manual stages naming layer 3) cuts it into 4,
    which a 0.6 MiB model fits on 4 devices whatever their memory (the error used to blame memory)."""
    model, batch = _tiny_gpt()
    cluster = autopar.Cluster.local(4)
    assert autopar.plan(model, cluster, batch, stages=2).planner["layers"] == 2, "the default clustering"
    four = autopar.plan(model, cluster, batch, stages=4)
    assert len(four.device_stages) == 4 and four.planner["layers"] >= 4
    manual = [{"layers": [k, k], "submesh": [1, 1]} for k in range(4)]
    assert [s.layers for s in autopar.plan(model, cluster, batch, stages=manual).stages] == [(k, k) for k in range(4)]


def test_stages_beyond_the_layers_or_devices_name_them_not_memory():
    model, batch = _tiny_gpt()
    with pytest.raises(PlanError, match=r"4 pipeline stages need at least 4 layers, but layers=2 .* layers=4"):
        autopar.plan(model, autopar.Cluster.local(4), batch, stages=4, layers=2)
    with pytest.raises(AutoparError, match=r"stages=4 needs at least 4 devices") as e:
        autopar.plan(model, autopar.Cluster.local(2), batch, stages=4)
    assert "memory" not in str(e.value)


def _tiny_gpt():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, n_embd=32)
    return GPT(config), make_batch(config, 8)


@pytest.mark.parametrize("stages,match", [
    ([{"layers": [0, 3], "submesh": [1, 8]}], "cover layers 0..7"),
    ([{"layers": [0, 3], "submesh": [1, 8]}, {"layers": [4, 7], "submesh": [1, 4]}], "tile it"),
    ([{"layers": [0, 7]}], "must look like"),
])
def test_bad_manual_stages(stages, match):
    with pytest.raises(PlanError, match=match):
        gpt_plan(autopar.Cluster.preset("dgx-a100", nodes=2), 16, stages=stages)


def test_microbatches_that_do_not_split_the_batch():
    with pytest.raises(PlanError, match="does not split the batch of 16"):
        gpt_plan(autopar.Cluster.preset("dgx-a100", nodes=1), 16, microbatches=3)


def test_a_user_fixed_microbatch_count_above_eight_plans():
    """B = 16 leaves no candidate ≤ 8 for the data-parallel reference microbatch (once a crash)."""
    plan = gpt_plan(autopar.Cluster.preset("dgx-a100", nodes=2), 32, microbatches=16, stages=2)
    assert plan.microbatches == 16 and len({tuple(s.ranks) for s in plan.stages}) == 2


class TwoStageReaders(nn.Module):
    """y is read in both stages: by the add of stage 0 and by the mul of stage 1."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x, y):
        h = torch.relu(self.fc1(x)) + y
        return (self.fc2(h) * y).mean()


def test_a_pinned_input_read_in_two_stages_is_moved_where_a_stage_reads_it_otherwise():
    """A pin cuts an input read by two nodes to one spec but leaves its readers free; in a stage holding one
    of them, the input is not stored "as its reader reads it" (it was a KeyError): it keeps its pinned spec
    and the move to the reader's is priced."""
    stages = [{"layers": [0, 0], "submesh": [1, 2], "mesh": [1, 2]},
              {"layers": [1, 1], "submesh": [1, 2], "mesh": [1, 2]}]
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    plan = autopar.plan(TwoStageReaders(), autopar.Cluster.local(4), (x, y), layers=2, stages=stages,
                        microbatches=2, pin={"y": "RR", "x": "RS(0)"})
    assert [s.shardings["y"].out for s in plan.stages] == ["RR", "RR"]
    assert all("y" in s.nodes for s in plan.stages)
