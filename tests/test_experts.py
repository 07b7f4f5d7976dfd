"""Expert parallelism for Hugging Face MoE layers, chosen by the planner.

A Mixtral-8x7B-shaped model (hidden 4096, intermediate 14336, 8 experts top-2, GQA 32/8 heads, vocabulary
32000; 2 of its 32 layers, bf16, on the meta device) is planned for one simulated DGX-H100 node. When
memory binds, the planner splits the experts across the devices (each holds one whole expert) and runs
the expert MLP between its two grouped matmuls on its own experts' rows (EXPERT_ROWS); when memory is
plentiful and the link slow, it keeps the experts whole, because the per-layer collectives of any split
cost more than the replicated work. Parity of a planner-chosen EP plan on gloo ranks is in test_zoo.py.
"""
import dataclasses
import warnings

import pytest
import torch

import autopar
from autopar.cost_models.communication import UNREACHABLE_SECONDS, axis_links, redistribute_cost
from autopar.errors import InfeasibleError
from autopar.hardware.cluster import Link
from autopar.passes.capture_moe import keep_hf_experts
from autopar.placement import EXPERT_ROWS, P, R, local_shape, parse_spec, spec_str
from autopar.redistribute import redistribute_steps
from autopar.runtime import kernels
from examples.hf_causal_lm import MIXTRAL_8X7B as MIXTRAL
from examples.hf_causal_lm import CausalLMLoss

GiB = 2**30


@pytest.fixture(scope="module")
def mixtral_shaped():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(**MIXTRAL, num_hidden_layers=2, max_position_embeddings=4096, use_cache=False)
    with torch.device("meta"):
        model = CausalLMLoss(MixtralForCausalLM(cfg).to(torch.bfloat16))
    ids = torch.zeros(16, 4096, dtype=torch.long, device="meta")
    return model, (ids, ids)


def _plan(model, batch, cluster, **options):
    """Plans of transformers' grouped_mm path (``keep_hf_experts``: captured without the MoE experts op)."""
    with warnings.catch_warnings(), keep_hf_experts():
        warnings.simplefilter("ignore")
        return autopar.plan(model, cluster, batch, stages=1, **options)


def _experts(plan) -> dict:
    stage = plan.stages[0]
    return {n: sh for n, sh in stage.shardings.items() if "experts" in n and n.startswith("p_")}


def _grouped_mms(plan) -> dict:
    return {n: sh for n, sh in plan.stages[0].shardings.items() if "grouped_mm" in plan.node_ops.get(n, "")}


def test_mixtral_shaped_plan_splits_experts_across_devices_when_memory_binds(mixtral_shaped):
    model, batch = mixtral_shaped
    cluster = autopar.Cluster.preset("dgx-h100", 1).with_memory(24 * GiB)
    # ZeRO held out: its sharded optimizer state would let whole experts fit (tests/test_zero_planner.py)
    with pytest.raises(InfeasibleError):  # memory binds: whole experts on every device do not fit
        _plan(model, batch, cluster, pin={"p_*experts*": "RR"}, zero=0)
    plan = _plan(model, batch, cluster, zero=0)
    assert plan.stages[0].mesh_shape == (1, 8) and plan.predicted["peak_memory"] <= cluster.memory_per_device
    experts = _experts(plan)
    assert len(experts) == 4 and all(sh.out == "RS(0)" for sh in experts.values()), experts
    gate_up = next(n for n in experts if "gate_up" in n)
    assert local_shape((8, 2 * 14336, 4096), parse_spec(experts[gate_up].out), (1, 8)) == (1, 2 * 14336, 4096)
    mms = _grouped_mms(plan)
    assert len(mms) == 4 and all(sh.kernels == ((1, "local_experts"),) for sh in mms.values()), mms
    # the second matmul of each expert MLP reads the first one's rows where they are: no collective between
    assert sorted(sh.ins[0] for sh in mms.values()) == ["RP(rows)", "RP(rows)", "RR", "RR"]


def test_slow_link_and_plentiful_memory_keep_experts_whole(mixtral_shaped):
    """1 GB/s between devices, 1 TiB each: the planner replicates the experts; the reason is the link: the
    expert-parallel plan (forced) predicts more communication and a longer step."""
    model, batch = mixtral_shaped
    slow = dataclasses.replace(autopar.Cluster.preset("dgx-h100", 1),
                               intra_node=Link(latency=5e-5, bandwidth=1e9)).with_memory(2**40)
    plan = _plan(model, batch, slow)
    assert all(sh.out == "RR" for sh in _experts(plan).values())
    assert not any(sh.kernels for sh in _grouped_mms(plan).values())
    forced = _plan(model, batch, slow, pin={"p_*experts*": "RS(0)", "*grouped_mm*": "RP(rows)"})
    assert forced.predicted["comm"] > plan.predicted["comm"] + 0.05
    assert forced.predicted["step_time"] > plan.predicted["step_time"]


def test_expert_rows_spec_text_and_moves():
    spec = (EXPERT_ROWS, R)
    assert spec_str(spec) == "P(rows)R" and parse_spec("P(rows)R") == spec and parse_spec("PR") != spec
    assert redistribute_steps((EXPERT_ROWS,), (P,)) == []  # disjoint summands are summands: a relabel
    assert [s.kind for s in redistribute_steps((EXPERT_ROWS,), (R,))] == ["all_reduce"]
    assert [s.kind for s in redistribute_steps((R,), (EXPERT_ROWS,))] == ["unreachable"]
    links = axis_links(autopar.Cluster.preset("dgx-h100", 1), (1, 8))
    assert redistribute_cost((64, 64), 2, (R, R), (R, EXPERT_ROWS), (1, 8), links)[0] == UNREACHABLE_SECONDS
    assert redistribute_cost((64, 64), 2, (R, EXPERT_ROWS), (R, P), (1, 8), links) == (0.0, 0.0)
    assert local_shape((64, 32), (R, EXPERT_ROWS), (1, 8)) == (8, 32)  # expected rows: a balanced router


def _routed(seed: int, rows: int = 24, experts: int = 4, k: int = 16, n: int = 8):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(experts, k, n, generator=g)
    counts = torch.tensor([7, 0, 9, 8])  # an expert with no rows, uneven counts
    return x, w, torch.cumsum(counts, 0).to(torch.int32)


@pytest.mark.parametrize("native", [True, False])
def test_local_expert_kernels_sum_to_the_grouped_matmul(native):
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

    x, w, offs = _routed(0)
    full = torch.ops.aten._grouped_mm(x, w, offs) if native else torch.ops.transformers.grouped_mm_fallback(x, w,
                                                                                                          offs)
    padded, compact = [], []
    for first, lo, hi in ((0, 0, 7), (2, 7, 24)):  # two devices, two experts each (expert 1 has no rows)
        rows = kernels.local_experts_grouped_mm(x, w[first:first + 2], offs, first, native, False, False, 24)
        compact.append(rows)
        padded.append(kernels.pad_expert_rows(rows, offs, first, 24))
        from_rows = kernels.local_experts_grouped_mm(x[lo:hi], w[first:first + 2], offs, first, native, True, True, 24)
        torch.testing.assert_close(from_rows, padded[-1])  # an EXPERT_ROWS input: x holds those rows only
    assert [r.shape[0] for r in compact] == [7, 17]  # each device keeps only its own experts' rows
    torch.testing.assert_close(padded[0] + padded[1], full)
    wrong = kernels.pad_expert_rows(compact[1], offs, 0, 24)  # rows placed from the first expert's offset
    assert not torch.allclose(padded[0] + wrong, full)
