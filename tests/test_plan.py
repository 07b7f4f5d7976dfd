"""The Plan as data: exact JSON round-trip, deterministic text, a summary a person can read, clear errors."""
import json

import pytest

import autopar
from autopar.errors import PlanError
from autopar.passes.capture import capture
from tests.models import make_small_gpt


@pytest.fixture(scope="module")
def plan():
    model, batch = make_small_gpt()
    return autopar.plan(model, autopar.Cluster.local(4, mesh_shape=(2, 2), memory_per_device=2.3e6), batch, stages=1)


def test_json_round_trip_is_exact(plan, tmp_path):
    text = plan.to_json()
    again = autopar.Plan.from_json(text)
    assert again == plan and again.to_json() == text
    path = tmp_path / "plan.json"
    plan.to_json(path)
    assert autopar.Plan.from_json(path) == plan


def test_same_inputs_give_a_byte_identical_plan(plan):
    model, batch = make_small_gpt()
    other = autopar.plan(model, autopar.Cluster.local(4, mesh_shape=(2, 2), memory_per_device=2.3e6), batch, stages=1)
    assert other.to_json() == plan.to_json(), "planning twice must give byte-identical JSON"


def test_summary_shows_shardings_collectives_time_and_memory(plan):
    text = plan.summary()
    for needle in ("stage 0", "mesh 2×2", "predicted step time", "peak memory per device", "collectives",
                   "aten.linear.default", "S(0)"):
        assert needle in text, needle


def test_every_node_has_a_sharding_and_the_plan_validates(plan):
    graph = capture(*make_small_gpt())
    plan.validate(graph, world_size=4)
    with pytest.raises(PlanError, match="3 ranks"):
        plan.validate(graph, world_size=3)


def test_a_plan_for_another_model_is_refused(plan):
    with pytest.raises(PlanError, match="another model or other input shapes"):
        plan.validate(capture(*make_small_gpt(n_layer=3)))


@pytest.mark.parametrize("text,match", [
    ("{broken", "malformed plan JSON"),
    ("[1, 2]", "must be an object"),
    ('{"model": "x"}', "missing"),
])
def test_malformed_plans(text, match):
    with pytest.raises(PlanError, match=match):
        autopar.Plan.from_json(text)


def test_corrupted_field_is_a_plan_error(plan):
    d = json.loads(plan.to_json())
    d["stages"][0]["mesh_shape"] = [3, 3]
    with pytest.raises(PlanError, match="does not hold"):
        autopar.Plan.from_json(json.dumps(d))
    d = json.loads(plan.to_json())
    d["stages"][0]["shardings"]["linear"]["out"] = "Q(9)"
    with pytest.raises(PlanError, match="node linear: bad sharding spec 'Q\\(9\\)'"):
        autopar.Plan.from_json(json.dumps(d))


def test_parameter_gradient_syncs_are_listed_per_step_not_per_microbatch():
    from examples.gpt import make_gpt

    model, batch = make_gpt(batch_size=16)
    plan = autopar.plan(model, autopar.Cluster.local(4), batch, stages=1, pin={"idx": "RS(0)", "p_*": "RR"})  # DP
    synced = [c for c in plan.stages[0].collectives if c.phase == "step"]
    params = {name for name, _ in model.named_parameters()}
    assert synced and all(c.kind == "all_reduce" for c in synced)
    assert len(synced) >= len(params) - 1  # every parameter but possibly a tied one, once per step
    assert "collectives per step (parameters' gradient sync):" in plan.summary()


def test_predicted_step_includes_the_optimizer_step_over_local_shards():
    from autopar.cost_models.compute import optimizer_step_time
    from examples.gpt import make_gpt

    model, batch = make_gpt(batch_size=16)
    cluster = autopar.Cluster.local(4)
    replicated = autopar.plan(model, cluster, batch, stages=1, pin={"p_*": "RR"}, zero=0)  # level 0: whole step
    params = list(model.parameters())  # the tied lm_head/wte weight counts once
    want = optimizer_step_time(sum(p.numel() for p in params), len(params), 4, "adamw", cluster)
    assert replicated.predicted["optimizer"] == pytest.approx(want)
    sharded = autopar.plan(model, cluster, batch, stages=1, pin={"p_blocks_*_mlp_fc_weight": "RS(0)"}, zero=0)
    assert sharded.predicted["optimizer"] < replicated.predicted["optimizer"]
