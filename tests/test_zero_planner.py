"""zero="auto": the planner chooses weight-update sharding (ZeRO) per parameter, on simulated clusters.

Two DGX-A100 nodes (2×8 mesh), a 4-layer GPT on the meta device, batch 128 × 512 tokens (4096 per device:
data parallelism moves less than tensor parallelism when memory allows). "fast" links the nodes as fast as
the GPUs inside one node; "slow" gives the nodes a 25 Gbps link (p3.16xlarge's). Each test asserts the
reason for its layout: the alternative the planner passed over is slower by the same cost model.
The ZeRO-3 cases run at batch 512 (16384 tokens per device): tensor parallelism's activation traffic grows with
the tokens, ZeRO-3's all-gathers of the weights do not, and compute hides them (they are prefetched).
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
    """ZeRO buys the memory; between levels 2 and 3 the cheaper: compute hides ZeRO-3's prefetched gathers,
    while ZeRO-2's all-gather after the step hides behind nothing, so ZeRO-3 is chosen (before the
    prefetch, ZeRO-2 was)."""
    tight = FAST.with_memory(TIGHT * roomy.predicted["peak_memory"])
    chosen = plan(tight)
    assert layout(chosen) == {"RR"}, "ZeRO buys the memory: weights stay replicated, no tensor parallelism"
    levels = chosen.stages[0].zero
    assert 3 in set(levels.values()) <= {2, 3} and any(n in levels for n in BLOCK_WEIGHTS), levels
    for w in ("attn_q", "attn_k", "attn_v", "attn_o", "mlp_fc", "mlp_proj"):  # identical layers, one level
        assert len({levels.get(f"p_blocks_{i}_{w}_weight", 0) for i in range(1, CFG.n_layer)}) == 1, levels
    assert chosen.predicted["peak_memory"] <= tight.memory_per_device
    without = plan(tight, zero=0)
    assert layout(without) != {"RR"}, "without ZeRO the same budget needs tensor parallelism"
    assert without.predicted["step_time"] > chosen.predicted["step_time"], "the reason: ZeRO is faster here"
    at2 = plan(tight, zero=2)
    assert layout(at2) == {"RR"} and at2.predicted["step_time"] > chosen.predicted["step_time"], \
        "ZeRO-3 is chosen over ZeRO-2 because it is priced faster"
    assert "ZeRO level(s) by stage: 0/3" in chosen.summary() or "ZeRO level(s) by stage: 3" in chosen.summary()


def test_prefetched_zero3_on_h100s_charges_only_the_gathers_compute_does_not_hide():
    """Two DGX-H100 nodes, the GPT with fp32 weights under the bf16 policy, every weight at ZeRO-3, data
    parallel: per microbatch and direction the plan charges exposed(g, c, U) = max(g/U, g − c·(U−1)/U) of
    g = f3 · grad_sync / 2 · 1/2 (gathered in bf16), with c the direction's compute (backward = 2 × forward),
    and its step replays the schedule over those times. Before, every fp32 gather (2g) sat on the critical
    path in both directions: the step was B · 2 · (2g − exposed) longer."""
    import copy

    from autopar.cost_models.zero3 import exposed_gather
    from autopar.planner.plan_builder import predict

    with torch.device("meta"):
        model = GPT(CFG)
    p = autopar.plan(model, autopar.Cluster.preset("dgx-h100", nodes=2), make_batch(CFG, 256, device="meta"),
                     stages=1, recompute="none", zero=3, precision="bf16", pin={"p_*": "RR"})
    s = p.stages[0].predicted
    g, units, mb = s["grad_sync"] / 4, s["zero3_units"], p.microbatches
    assert s["zero3_share"] == 1.0 and s["zero3_gather_scale"] == 0.5 and s["zero3_gather"] == pytest.approx(g)
    forward = (s["forward"] + s["backward"] - s["zero3_exposed"]) / 3  # before the gathers
    exposed = exposed_gather(g, forward, units) + exposed_gather(g, 2 * forward, units)
    assert s["zero3_exposed"] == pytest.approx(exposed) and exposed < 2 * g, "compute hides part of the gathers"
    before = copy.deepcopy(p.stages)
    before[0].predicted.update(forward=forward + 2 * g, backward=2 * forward + 2 * g)
    old = predict(before, p.microbatches, p.schedule, p.transfers)["step_time"]
    assert old - p.predicted["step_time"] == pytest.approx(mb * (4 * g - exposed), rel=1e-6)


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
