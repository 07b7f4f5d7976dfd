"""Intra-op planner on simulated 8- and 64-GPU clusters (no process group, models on the meta device).

The intra-op ILP must rediscover the known layouts: data parallelism when memory allows and links are
fast, Megatron tensor parallelism (column- then row-parallel) when parameters do not fit on one device
(without ZeRO; with it, ZeRO-3's prefetched gathers are priced faster on one V100 node),
and, on 64 V100s with a 25 Gbps link between nodes, tensor parallelism inside nodes with data
parallelism across them (Alpa's finding on the same cluster).
"""
import pytest
import torch

import autopar
from examples.gpt import GPT, GPTConfig, make_batch, suite_config

SMALL = GPTConfig(vocab_size=51200, seq_len=1024, n_layer=4, n_head=16, n_embd=1024)
COLUMN = ["p_blocks_0_attn_q_weight", "p_blocks_0_attn_k_weight", "p_blocks_0_attn_v_weight",
          "p_blocks_0_mlp_fc_weight"]
ROW = ["p_blocks_0_mlp_proj_weight"]
BLOCK_WEIGHTS = COLUMN + ROW + ["p_blocks_0_attn_o_weight"]


def plan_gpt(cfg: GPTConfig, batch: int, cluster: autopar.Cluster, **options) -> autopar.Plan:
    """One stage over the whole cluster: these tests are about the intra-op ILP's layouts."""
    with torch.device("meta"):
        model = GPT(cfg).half()
    return autopar.plan(model, cluster, make_batch(cfg, batch, device="meta"), stages=1, **options)


def specs(plan: autopar.Plan, names) -> dict[str, str]:
    return {n: plan.stages[0].shardings[n].out for n in names}


def test_data_parallel_on_8_gpus_when_memory_allows():
    plan = plan_gpt(SMALL, 64, autopar.Cluster.preset("dgx-a100"))
    assert set(specs(plan, BLOCK_WEIGHTS).values()) == {"RR"}, "block weights must stay replicated"
    assert plan.stages[0].shardings["linear"].out == "RS(0)", "activations must be split by batch"


def test_data_parallel_on_64_gpus_with_fast_links():
    plan = plan_gpt(SMALL, 512, autopar.Cluster.preset("dgx-a100", nodes=8))
    assert set(specs(plan, BLOCK_WEIGHTS).values()) == {"RR"}
    assert plan.stages[0].shardings["linear"].out == "S(0)S(0)", "batch split over both mesh axes"


def test_megatron_tensor_parallel_on_8_gpus_when_parameters_do_not_fit():
    """Without ZeRO, parameters that do not fit one device are split Megatron's way. With ZeRO searched,
    sharding them between uses instead (ZeRO-3: its all-gathers prefetched behind compute) is priced
    faster than tensor parallelism's activation all-reduces on the critical path."""
    cfg, cluster = suite_config("2.6B"), autopar.Cluster.preset("p3.16xlarge")
    assert cfg.n_params * 16 > cluster.memory_per_device, "training state must exceed one device"
    plan = plan_gpt(cfg, 8, cluster, zero=0)
    assert all(s == "RS(0)" for s in specs(plan, COLUMN).values()), specs(plan, COLUMN)
    assert all(s == "RS(1)" for s in specs(plan, ROW).values()), specs(plan, ROW)
    assert plan.predicted["peak_memory"] <= cluster.memory_per_device
    auto = plan_gpt(cfg, 8, cluster)
    assert set(specs(auto, COLUMN).values()) == {"RR"} and set(auto.stages[0].zero.values()) == {3}
    assert auto.predicted["step_time"] < plan.predicted["step_time"]
    assert auto.predicted["peak_memory"] <= cluster.memory_per_device


def test_megatron_inside_nodes_data_parallel_across_slow_links_on_64_gpus():
    cfg, cluster = suite_config("2.6B"), autopar.Cluster.preset("p3.16xlarge", nodes=8)
    plan = plan_gpt(cfg, 64, cluster)
    got = specs(plan, COLUMN + ROW + ["p_blocks_0_attn_o_weight"])
    assert all(got[n] == "RS(0)" for n in COLUMN), got
    assert got["p_blocks_0_attn_o_weight"] == got["p_blocks_0_mlp_proj_weight"] == "RS(1)", got
    assert plan.stages[0].shardings["linear"].out.startswith("S(0)"), "batch split across nodes (axis 0)"
    assert plan.predicted["peak_memory"] <= cluster.memory_per_device


def test_39b_model_on_meta_is_planned_without_its_memory():
    cfg = suite_config("39B")
    plan = plan_gpt(cfg, 8, autopar.Cluster.preset("dgx-a100", nodes=8))
    assert cfg.n_params > 39e9
    assert plan.predicted["peak_memory"] <= 80 * 2**30
    assert plan.predicted["step_time"] > 0
    summary = plan.summary()
    assert "stage 0" in summary and "collectives" in summary


@pytest.mark.parametrize("preset", ["p3.16xlarge", "dgx-a100", "dgx-h100"])
def test_every_preset_plans_a_transformer_that_fits(preset):
    cluster = autopar.Cluster.preset(preset, nodes=2)
    plan = plan_gpt(suite_config("1.3B"), 16, cluster)
    assert plan.predicted["peak_memory"] <= cluster.memory_per_device
    assert plan.num_devices == 16
