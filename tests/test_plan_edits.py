"""Hand-edited plans with impossible shardings are refused up front, naming the node (no process group).

Each case edits the JSON of a real MLP plan and expects ``Plan.validate(graph, cluster=...)`` or the
strategy check ``autopar.compile`` runs (``passes.plan_check``) to raise PlanError naming the node.
Negative control: the unedited plans pass both. One more case runs ``autopar.compile`` on one rank in
this process, which must raise PlanError before the first step.
"""
import json

import pytest
import torch.distributed as dist

import autopar
from autopar.errors import PlanError
from autopar.passes.capture import capture
from autopar.passes.plan_check import check_shardings
from tests.models import make_mlp


@pytest.fixture(scope="module")
def planned():
    model, batch = make_mlp()
    graph = capture(model, batch)
    plans = {n: autopar.plan(model, autopar.Cluster.local(n), batch, stages=1).to_json() for n in (2, 3)}
    return graph, plans


def edited(text: str, edit) -> autopar.Plan:
    d = json.loads(text)
    edit(d["stages"][0])
    return autopar.Plan.from_json(json.dumps(d))


def set_sharding(name, out=None, ins=None):
    def edit(stage):
        if out is not None:
            stage["shardings"][name]["out"] = out
        if ins is not None:
            stage["shardings"][name]["ins"] = ins
    return edit


def check(plan, graph, cluster):
    plan.validate(graph, world_size=cluster.num_devices, cluster=cluster)
    check_shardings(plan, graph)


def test_negative_control_unedited_plans_pass(planned):
    graph, plans = planned
    for n, text in plans.items():
        check(autopar.Plan.from_json(text), graph, autopar.Cluster.local(n))


CASES = {  # name: (devices, edit, message)
    "placements": (2, set_sharding("p_fc1_weight", out="S(0)"), r"node p_fc1_weight: output spec 'S\(0\)' has 1 "),
    "no such dim": (2, set_sharding("p_fc1_weight", out="RS(2)"), r"node p_fc1_weight: output spec 'RS\(2\)' does "
                                                                  r"not split shape \(128, 32\)"),
    "indivisible": (3, set_sharding("p_fc1_weight", out="RS(0)"), r"node p_fc1_weight: .* not split shape \(128, "
                                                                  r"32\) evenly on mesh \(1, 3\)"),
    "input count": (2, set_sharding("linear", ins=["RR", "RR"]), r"node linear: 2 input specs for 3 tensor inputs"),
    "input dim": (2, set_sharding("linear", ins=["RS(3)", "RR", "RR"]), r"node linear: input x spec 'RS\(3\)'"),
    "not a strategy": (2, set_sharding("linear", out="RS(0)"), r"node linear \(aten.linear.default\): sharding "
                                                               r"RS\(0\) <- \(RR, RR, RR\) is not one the op supports"),
    "ghost node": (2, lambda s: s["shardings"].update(ghost={"out": "RR", "ins": [], "kernels": []}),
                   r"node 'ghost' is not in the graph"),
    "submesh": (2, lambda s: s.update(submesh=[2, 1]), r"stage 0: submesh \(2, 1\) .* does not fit"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_impossible_edit_is_refused_naming_the_node(planned, case):
    graph, plans = planned
    devices, edit, message = CASES[case]
    with pytest.raises(PlanError, match=message):
        check(edited(plans[devices], edit), graph, autopar.Cluster.local(devices))


def test_a_plan_for_another_cluster_size_is_refused(planned):
    graph, plans = planned
    with pytest.raises(PlanError, match="plan is for 2 devices, cluster 'local-4' has 4"):
        autopar.Plan.from_json(plans[2]).validate(graph, cluster=autopar.Cluster.local(4))


def test_compile_refuses_an_impossible_plan_before_the_first_step():
    assert not dist.is_initialized(), "another test left a process group behind"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, batch = make_mlp()
        cluster = autopar.Cluster.local(1)
        text = autopar.plan(model, cluster, batch).to_json()
        with pytest.raises(PlanError, match="node p_fc2_weight: output spec 'R' has 1 placements"):
            autopar.compile(model, cluster, batch, plan=edited(text, set_sharding("p_fc2_weight", out="R")))
        with pytest.raises(PlanError, match="node linear_1 .* is not one the op supports"):
            autopar.compile(model, cluster, batch, plan=edited(text, set_sharding("linear_1", out="RP")))
    finally:
        dist.destroy_process_group()
