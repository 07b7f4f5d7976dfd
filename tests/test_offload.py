"""CPU offload: training with the optimizer stepped on host copies and with activations kept in host memory
equals one device (2 gloo ranks, tolerances of test_parity), so does a 2-stage pipeline whose stage DP offloaded
one stage only, and the planner takes offload where only it meets the memory budget (per pipeline stage: only
the stage whose memory binds), not where another lever is cheaper.

On CPU ranks the host copies are separate tensors in the same memory: the offload path runs in full (copies
out, host step, copies back; ``save_on_cpu``'s pack and unpack). Negative controls: the stepped host copies
never copied back, and offloaded activations returned as zeros.
"""
import functools

import pytest
import torch

import autopar
from autopar.errors import OptionError
from autopar.hardware.host import host_of
from autopar.passes.capture import capture
from autopar.planner.driver import PlanOptions, memory_bounds
from examples.gpt import GPTConfig, make_gpt

CASES = [("gpt", (1, 2), "dp:offopt", None), ("gpt", (1, 2), "dp:offact", None),
         ("gpt", (1, 2), "auto:offopt:offact", None)]
NEGATIVE = [("gpt", (1, 2), "dp:offopt", "host_step"), ("gpt", (1, 2), "dp:offact", "host_acts")]
STAGE_CASE = ("gpt", (1, 2), "pp2auto-1f1b", None)  # the DP offloads stage 0 only (``parity.pipeline_options``)
STAGE_NEGATIVE = ("gpt", (1, 2), "pp2auto-1f1b", "host_step")
PARITY_CASES = {2: CASES + NEGATIVE + [STAGE_CASE, STAGE_NEGATIVE]}


def _id(case):
    return f"{case[0]}-{case[2]}" + (f"-{case[3]}" if case[3] else "")


@pytest.fixture(scope="module")
def results(parity_runs):
    return {case: parity_runs[case][0] for case in CASES + NEGATIVE + [STAGE_CASE, STAGE_NEGATIVE]}


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_offloaded_training_matches_one_device(results, case):
    r = results[case]
    assert r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-4, r
    assert r["ranks_agree"]
    flags = case[2].split(":")[1:]
    assert ("optimizer" in r["offload"]) == ("offopt" in flags) and ("activations" in r["offload"]) == (
        "offact" in flags), r["offload"]


@pytest.mark.distributed
def test_a_pipeline_offloading_one_stage_matches_one_device(results):
    r = results[STAGE_CASE]
    assert r["offload"] == {"optimizer": [0]}, r["offload"]
    assert [n for _, _, n in r["stages"]] == [1, 1] and r["schedule"] == "1f1b"
    assert r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-4, r
    assert r["ranks_agree"] and r["compared_params"] > 10


@pytest.mark.distributed
@pytest.mark.parametrize("case", NEGATIVE + [STAGE_NEGATIVE], ids=_id)
def test_negative_control_breaks_offload_parity(results, case):
    r = results[case]
    assert not (r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-4), f"a broken offload went unnoticed: {r}"  # NaN too


@pytest.mark.parametrize("bad", ["yes", "", {}, {"gpu": True}, {"optimizer": 1}, 1, None])
def test_a_bad_offload_option_is_one_clear_error(bad):
    with pytest.raises(OptionError, match="offload"):
        PlanOptions(offload=bad)


def _wide_gpt():
    """Parameters dominate (width 1024, sequence 64): optimizer state is what memory is short of."""
    return make_gpt(GPTConfig(n_layer=2, n_embd=1024, n_head=8, seq_len=64, vocab_size=1024), batch_size=2)


def _floor(model, batch, cluster, offload) -> float:
    return memory_bounds(capture(model, batch), cluster, PlanOptions(offload=offload, recompute="none"))[0]


def test_a_budget_only_offload_meets_gets_offload():
    model, batch = _wide_gpt()
    one = autopar.Cluster.preset("dgx-h100", gpus=1)
    on_device = _floor(model, batch, one, "none")
    on_host = _floor(model, batch, one, {"optimizer": True})
    assert on_host < 0.8 * on_device, "optimizer state and master weights leave the device"
    tight = one.with_memory((on_host + on_device) / 2)
    with pytest.raises(autopar.errors.InfeasibleError):  # negative control: nothing else fits on one device
        autopar.plan(model, tight, batch, stages=1, recompute="none")
    plan = autopar.plan(model, tight, batch, stages=1, recompute="none", offload="auto")
    assert plan.planner["offload"] == {"optimizer": [0]}
    host = host_of(one)
    assert plan.stages[0].predicted["optimizer"] > 0 and host.pcie < one.memory_bandwidth


def test_offload_is_left_out_where_sharding_meets_the_budget_for_less():
    model, batch = _wide_gpt()
    node = autopar.Cluster.preset("dgx-h100", gpus=8)
    on_device = _floor(model, batch, node, "none")
    budget = node.with_memory(1.05 * on_device)
    plan = autopar.plan(model, budget, batch, stages=1, recompute="none", offload="auto")
    assert "offload" not in plan.planner
    forced = autopar.plan(model, budget, batch, stages=1, recompute="none", offload={"optimizer": True})
    assert forced.planner["offload"] == {"optimizer": [0]}
    assert forced.predicted["step_time"] > plan.predicted["step_time"], "PCIe and a host step cost more than NVLink"


def test_offload_none_leaves_the_plan_unchanged():
    model, batch = _wide_gpt()
    cluster = autopar.Cluster.local(2)
    assert autopar.plan(model, cluster, batch, stages=1).to_json() == \
        autopar.plan(model, cluster, batch, stages=1, offload="none").to_json()


def _deep_gpt():
    """Four blocks of width 1024 on two pipeline stages of one H100 each: parameters dominate, and under 1F1B
    the first stage keeps one microbatch more in flight than the second."""
    return make_gpt(GPTConfig(n_layer=4, n_embd=1024, n_head=8, seq_len=64, vocab_size=1024), batch_size=4)


PIPELINE = dict(stages=2, microbatches=2, schedule="1f1b", zero=0)


@functools.cache
def _free_pipeline():
    """The deep GPT, two H100s, and its 2-stage plan without offload or recompute (memory unbounded)."""
    model, batch = _deep_gpt()
    pair = autopar.Cluster.preset("dgx-h100", gpus=2)
    return model, batch, pair, autopar.plan(model, pair, batch, recompute="none", **PIPELINE)


def test_the_stage_dp_offloads_only_the_stage_whose_memory_binds():
    model, batch, pair, free = _free_pipeline()
    first, second = (s.predicted["memory"] for s in free.stages)
    assert first > 1.02 * second, "stage 0 holds an extra microbatch's activations"
    tight = pair.with_memory((first + second) / 2)
    with pytest.raises(autopar.errors.InfeasibleError):  # negative control: no cut fits without offload
        autopar.plan(model, tight, batch, recompute="none", **PIPELINE)
    plan = autopar.plan(model, tight, batch, recompute="none", offload="auto", **PIPELINE)
    assert plan.planner["offload"] == {"optimizer": [0]}
    host, device = (s.predicted["optimizer"] for s in plan.stages)
    assert host > 10 * device, "the offloaded stage steps on the host, over PCIe"
    assert all(s.predicted["memory"] <= tight.memory_per_device for s in plan.stages)
    assert plan.stages[0].predicted["memory"] < 0.7 * first, "optimizer state and master weights left the device"


def test_the_stage_dp_prefers_recompute_where_it_frees_memory_for_less():
    model, batch, pair, free = _free_pipeline()
    tight = pair.with_memory(sum(s.predicted["memory"] for s in free.stages) / 2)
    plan = autopar.plan(model, tight, batch, recompute="auto", offload="auto", **PIPELINE)
    assert "offload" not in plan.planner and plan.stages[0].recompute
    forced = autopar.plan(model, tight, batch, recompute="none", offload="auto", **PIPELINE)
    assert forced.planner["offload"] == {"optimizer": [0]}
    assert forced.predicted["step_time"] > plan.predicted["step_time"], "the host step costs more than a forward"


def test_offloading_a_stage_frees_its_state_and_adds_the_host_step_less_the_device_step():
    from autopar.cost_models.offload import optimizer_offload_effect

    h100 = autopar.Cluster.preset("dgx-h100", gpus=1)
    host, n = host_of(h100), 1e6
    freed, added = optimizer_offload_effect(n, torch.bfloat16, "adamw", h100)
    assert freed == n * (8 + 4)  # exp_avg, exp_avg_sq and the fp32 master weight
    transfers, host_step = 2 * n * 2 / host.pcie, n * 4 * 7 / host.host_bw  # bf16 out and back; fp32 AdamW
    device_step = n * 2 * 7 / h100.memory_bandwidth
    assert added == pytest.approx(transfers + host_step - device_step)
    assert optimizer_offload_effect(n, torch.float32, "sgd", h100)[0] == 0, "plain SGD keeps no state to free"


def _choose_among(step_times: dict, per_stage_offloads: bool):
    """choose_offload over plans whose predicted step times are given per candidate; the candidates planned."""
    from types import SimpleNamespace

    from autopar.planner.offload_choice import choose_offload
    planned = []

    def plan_with(options, per_stage):
        key = "per_stage" if per_stage else ("every" if options.offload != "none" else "none")
        planned.append(key)
        moved = {"offload": {"optimizer": [1]}} if key == "every" or (key == "per_stage" and per_stage_offloads) else {}
        return SimpleNamespace(name=key, predicted={"step_time": step_times[key]}, planner=moved)
    return choose_offload(plan_with, PlanOptions()).name, planned


def test_auto_keeps_the_plan_without_offload_where_the_dp_offloaded_a_stage_for_nothing():
    """The DP's per-stage prices can offload a stage the exact solve prices slower: the plan without offload
    is planned too and wins (GPT-3 15B on 32 A100-40GB: 40.5 s without, 42.4 s with stage 3 offloaded)."""
    times = {"per_stage": 42.4, "every": 43.0, "none": 40.5}
    assert _choose_among(times, per_stage_offloads=True) == ("none", ["per_stage", "every", "none"])
    # the per-stage plan is kept where it is the fastest, and ties go to no offload
    assert _choose_among({**times, "per_stage": 39.0}, True)[0] == "per_stage"
    assert _choose_among({**times, "per_stage": 40.5}, True)[0] == "none"
    # negative control: a DP that offloaded nothing already is the plan without offload, so none is not replanned
    assert _choose_among(times, per_stage_offloads=False) == ("per_stage", ["per_stage", "every"])


def test_the_infeasible_hint_counts_the_levers_auto_may_take():
    """Under recompute="auto" and offload="auto" the error's floor is the least plan with every layer recomputed
    and the optimizer on the host, not the least without them (it quoted twice what a lent H200 needed for a
    meta-built Llama-3-8B): a budget just over that floor fits; the floor without the levers is far above it."""
    model, batch = _wide_gpt()
    one = autopar.Cluster.preset("dgx-h100", gpus=1)
    graph = capture(model, batch)
    levers = memory_bounds(graph, one, PlanOptions(offload={"optimizer": True}, recompute="full"))[0]
    without = memory_bounds(graph, one, PlanOptions(offload="none", recompute="none"))[0]
    assert levers < 0.8 * without  # control: the two floors differ, so the message can quote the wrong one
    with pytest.raises(autopar.errors.InfeasibleError) as error:
        autopar.plan(model, one.with_memory(0.97 * levers), batch, recompute="auto", offload="auto")
    text = str(error.value)
    assert "with every layer recomputed and the optimizer state on the host needs at least" in text
    assert f"({levers:.0f} bytes)" in text
    plan = autopar.plan(model, one.with_memory(1.1 * levers), batch, recompute="auto", offload="auto")
    assert plan.planner["offload"] == {"optimizer": [0]}
