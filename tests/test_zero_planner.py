"""zero="auto": the planner chooses weight-update sharding (ZeRO) per parameter, on simulated clusters.

Two DGX-A100 nodes (2×8 mesh), a 4-layer GPT on the meta device, batch 128 × 512 tokens (4096 per device:
data parallelism moves less than tensor parallelism when memory allows). "fast" links the nodes as fast as
the GPUs inside one node; "slow" gives the nodes a 25 Gbps link (p3.16xlarge's). Each test asserts the
reason for its layout: the alternative the planner passed over is slower by the same cost model.
The ZeRO-3 cases run at batch 512 (16384 tokens per device): tensor parallelism's activation traffic grows with
the tokens, ZeRO-3's all-gathers of the weights do not.
"""
import dataclasses

import pytest
import torch

import autopar
from examples.gpt import GPT, GPTConfig, make_batch

CFG = GPTConfig(vocab_size=8192, seq_len=512, n_layer=4, n_head=16, n_embd=1024)
BATCH = 128
BATCH_Z3 = 512
BLOCK_WEIGHTS = [f"p_blocks_{i}_{w}_weight" for i in range(CFG.n_layer)
                 for w in ("attn_q", "attn_k", "attn_v", "attn_o", "mlp_fc", "mlp_proj")]
BASE = autopar.Cluster.preset("dgx-a100", nodes=2)
FAST = dataclasses.replace(BASE, inter_node=BASE.intra_node)
SLOW = dataclasses.replace(BASE, inter_node=autopar.Cluster.preset("p3.16xlarge").inter_node)
TIGHT = 0.6  # of the memory the plain data-parallel plan needs


def plan(cluster: autopar.Cluster, batch: int = BATCH, **options) -> autopar.Plan:
    with torch.device("meta"):
        model = GPT(CFG).half()
    return autopar.plan(model, cluster, make_batch(CFG, batch, device="meta"), stages=1, recompute="none", **options)


def layout(p: autopar.Plan) -> set[str]:
    return {p.stages[0].shardings[n].out for n in BLOCK_WEIGHTS}


def inter_node_bytes(p: autopar.Plan) -> float:
    """Bytes per step of the collectives on mesh axis 0 (the axis across the two nodes)."""
    return sum(c.nbytes for c in p.stages[0].collectives if c.axis == 0)


@pytest.fixture(scope="module")
def roomy():
    return plan(FAST)


def test_plenty_of_memory_plain_data_parallel_without_zero(roomy):
    assert layout(roomy) == {"RR"}, "block weights must stay replicated"
    assert roomy.stages[0].zero == {}, "nothing to save memory for: ZeRO's all-gather would only cost time"
    assert "ZeRO level(s) by stage: 0" in roomy.summary()


def test_tight_memory_zero_before_tensor_parallel_on_fast_links(roomy):
    tight = FAST.with_memory(TIGHT * roomy.predicted["peak_memory"])
    chosen = plan(tight)
    assert layout(chosen) == {"RR"}, "ZeRO buys the memory: weights stay replicated, no tensor parallelism"
    levels = chosen.stages[0].zero
    assert set(levels.values()) == {2} and any(n in levels for n in BLOCK_WEIGHTS), levels
    for w in ("attn_q", "attn_k", "attn_v", "attn_o", "mlp_fc", "mlp_proj"):  # identical layers, one level
        assert len({levels.get(f"p_blocks_{i}_{w}_weight", 0) for i in range(1, CFG.n_layer)}) == 1, levels
    assert chosen.predicted["peak_memory"] <= tight.memory_per_device
    without = plan(tight, zero=0)
    assert layout(without) != {"RR"}, "without ZeRO the same budget needs tensor parallelism"
    assert without.predicted["step_time"] > chosen.predicted["step_time"], "the reason: ZeRO is faster here"
    assert "ZeRO level(s) by stage: 0/2" in chosen.summary() or "ZeRO level(s) by stage: 2" in chosen.summary()


@pytest.fixture(scope="module")
def zero3_budget():
    """Memory between what the data-parallel layout needs with every parameter at ZeRO 2 and at ZeRO 3."""
    at = {z: plan(FAST, BATCH_Z3, zero=z, pin={"p_*": "RR"}).predicted["peak_memory"] for z in (2, 3)}
    assert at[3] < at[2]
    return (at[2] + at[3]) / 2


def test_tighter_memory_zero3_before_tensor_parallel_on_fast_links(zero3_budget):
    tight = FAST.with_memory(zero3_budget)
    chosen = plan(tight, BATCH_Z3)
    assert layout(chosen) == {"RR"}, "ZeRO-3 buys the memory: weights stay replicated, no tensor parallelism"
    levels = chosen.stages[0].zero
    assert 3 in levels.values() and any(levels.get(n) == 3 for n in BLOCK_WEIGHTS), levels
    assert chosen.predicted["peak_memory"] <= tight.memory_per_device
    assert chosen.stages[0].predicted["zero3_transient"] > 0, "the gathered units are part of the prediction"
    without = plan(tight, BATCH_Z3, zero=2)
    assert layout(without) != {"RR"}, "at ZeRO 2 the same budget needs tensor parallelism"
    assert without.predicted["step_time"] > chosen.predicted["step_time"], "the reason: ZeRO-3 is faster here"


def test_slow_inter_node_link_shards_inside_nodes_before_zero3_across_them(zero3_budget):
    tight = SLOW.with_memory(zero3_budget)
    chosen = plan(tight, BATCH_Z3)
    assert all(s.startswith("R") for s in layout(chosen)) and layout(chosen) != {"RR"}, \
        f"weights must be split inside nodes (mesh axis 1), never across the slow link: {layout(chosen)}"
    zero3_everywhere = plan(tight, BATCH_Z3, pin={"p_blocks_*": "RR"})  # the fast-link layout
    assert 3 in zero3_everywhere.stages[0].zero.values(), "replicated block weights need ZeRO-3 in this budget"
    assert inter_node_bytes(chosen) < inter_node_bytes(zero3_everywhere) / 2
    assert zero3_everywhere.predicted["step_time"] > chosen.predicted["step_time"], "the reason: the slow link"
