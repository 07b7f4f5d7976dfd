"""Bad input gets one clear error naming the cause and the fix; odd sizes fall back, never crash.

Planner-side cases run without a process group; runtime cases share one 2-rank launch whose worker
returns (error type, message) for each mistake.
"""
import copy

import pytest
import torch

import autopar
from autopar.errors import ClusterError, InfeasibleError
from autopar.passes.capture import capture
from autopar.planner.driver import PlanOptions, memory_bounds
from tests.models import MLP, make_small_gpt


def test_infeasible_budget_names_the_smallest_budget_that_fits():
    model, batch = make_small_gpt()
    with pytest.raises(InfeasibleError) as err:
        autopar.plan(model, autopar.Cluster.local(4, memory_per_device=100_000), batch, stages=1)
    message = str(err.value)
    assert "smallest plan needs" in message and "memory_per_device" in message
    floor = float(message.split("(")[1].split(" bytes")[0])
    plan = autopar.plan(model, autopar.Cluster.local(4, memory_per_device=floor * 1.001), batch, stages=1)
    assert plan.predicted["peak_memory"] <= floor * 1.001


def test_infeasible_pipeline_budget_names_a_budget_that_fits():
    model, batch = make_small_gpt()
    with pytest.raises(InfeasibleError) as err:
        autopar.plan(model, autopar.Cluster.local(4, memory_per_device=100_000), batch)
    message = str(err.value)
    assert "no pipeline" in message and "single-stage plan with every layer recomputed needs at least" in message
    floor = float(message.rsplit("(", 1)[1].split(" bytes")[0])  # a lower bound: "a few percent above" fits
    plan = autopar.plan(model, autopar.Cluster.local(4, memory_per_device=floor * 1.05), batch)
    assert floor <= plan.predicted["peak_memory"] <= floor * 1.05


def odd_mlp():
    torch.manual_seed(0)
    return MLP(d_in=7, hidden=30, d_out=5), (torch.randn(6, 7), torch.randn(6, 5))


def squeezed(cluster, model, batch):
    """The cluster with a memory budget that forces sharding (between the least and the replicated need)."""
    floor, replicated = memory_bounds(capture(model, batch), cluster, PlanOptions(zero=0))
    return cluster.with_memory(floor + 0.3 * (replicated - floor))


def test_dimensions_no_axis_divides_are_never_sharded():
    model, batch = odd_mlp()
    plan = autopar.plan(model, squeezed(autopar.Cluster.local(4), model, batch), batch, stages=1, zero=0)
    for name, sharding in plan.stages[0].shardings.items():
        assert "S(" not in sharding.out or name.startswith("p_fc2"), (name, sharding.out)


def test_plan_needs_a_cluster_and_compile_needs_a_process_group():
    model, batch = make_small_gpt()
    with pytest.raises(ClusterError, match="autopar.Cluster"):
        autopar.plan(model, "dgx-a100", batch)
    with pytest.raises(ClusterError, match="initialized process group"):
        autopar.compile(model, autopar.Cluster.local(1), batch)


def _outcome(fn):
    try:
        fn()
    except Exception as e:  # the test inspects the type and message
        return type(e).__name__, str(e)
    return None, None


def runtime_mistakes(rank: int) -> dict:
    model, batch = make_small_gpt()
    out = {"world size": _outcome(lambda: autopar.compile(model, autopar.Cluster.local(4), batch))}
    with torch.device("meta"):
        meta_model = copy.deepcopy(model).to("meta")
    out["meta weights"] = _outcome(lambda: autopar.compile(meta_model, autopar.Cluster.local(2), batch,
                                                           weights="/nonexistent/model.safetensors"))
    other_model, other_batch = make_small_gpt(n_layer=3)
    other_plan = autopar.plan(other_model, autopar.Cluster.local(2), other_batch)
    out["plan of another model"] = _outcome(lambda: autopar.compile(model, autopar.Cluster.local(2), batch,
                                                                   plan=other_plan))
    pm = autopar.compile(model, autopar.Cluster.local(2), batch)
    short = tuple(t[:4] for t in batch)
    out["input shapes"] = _outcome(lambda: pm.train_step(*short))
    out["input dtype"] = _outcome(lambda: pm(batch[0].float(), batch[1]))
    odd, odd_batch = odd_mlp()
    reference = copy.deepcopy(odd)
    pm_odd = autopar.compile(odd, squeezed(autopar.Cluster.local(2), odd, odd_batch), odd_batch, zero=0)
    out["odd sizes loss"] = (pm_odd.train_step(*odd_batch).item(), reference(*odd_batch).item())
    return out


@pytest.fixture(scope="module")
def mistakes():
    return autopar.launch(runtime_mistakes, 2, timeout=120)[0]


@pytest.mark.parametrize("case,error,needles", [
    ("world size", "ClusterError", ["4 devices", "2 ranks", "Cluster.local(2)"]),
    ("meta weights", "CheckpointError", ["does not exist", ".safetensors file"]),
    ("plan of another model", "PlanError", ["another model", "re-plan"]),
    ("input shapes", "InputError", ["(4, 32)", "(8, 32)", "global batch"]),
    ("input dtype", "InputError", ["torch.float32", "torch.int64"]),
])
def test_runtime_mistakes_get_one_clear_error(mistakes, case, error, needles):
    got_type, message = mistakes[case]
    assert got_type == error, (case, got_type, message)
    for needle in needles:
        assert needle in message, (case, needle, message)


def test_odd_sizes_fall_back_and_still_match_one_device(mistakes):
    loss, reference = mistakes["odd sizes loss"]
    assert abs(loss - reference) <= 1e-5 * abs(reference)
