"""Checkpoints lose nothing: 3 steps, save, load in a fresh process group, 3 more steps = 6 steps in one go.

Two launches. 4 ranks train the GPT example 3 AdamW steps under a one-stage 2×2-mesh plan that shards
parameters, and save (model and optimizer state, sharded). 2 fresh ranks load that checkpoint into the
planner's 2-rank plan (a 1×2 mesh, or two pipeline stages: another world size and other shardings either
way), train 3 more steps, which must match one device trained 6 steps (tolerances of tests/parity.py), and
save again under their plan. Negative control: the same resume with one parameter shard off by 1e-3 on
one rank must fail that check. The exports of both checkpoints load into the plain model. Plans are made
once here, squeezed in memory as parity's "auto" layout, and sent to the ranks as JSON.
"""
import copy
import os

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.errors import CheckpointError
from autopar.runtime.checkpoint import export_state_dict
from tests.models import make_mlp, make_small_gpt
from tests.parity import EPS, LR, layout_options, rel

STEPS = 3
LOSS_TOL, PARAM_TOL = 1e-5, 1e-4


def one_stage() -> dict:
    """Plan options for one stage on the cluster's mesh, where the planner might pipeline."""
    return {"stages": 1}


def squeezed_plan(world: int, mesh, **options) -> tuple:
    model, batch = make_small_gpt()
    cluster, _ = layout_options("auto", "gpt", autopar.Cluster.local(world, mesh_shape=mesh), model, batch)
    return cluster, autopar.plan(model, cluster, batch, zero=0, **options).to_json()


def train(pm, opt, batch, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        losses.append(pm.train_step(*batch).item())
        opt.step()
        opt.zero_grad()
    return losses


def compiled(cluster, plan_json):
    model, batch = make_small_gpt()
    pm = autopar.compile(model, cluster, batch, plan=autopar.Plan.from_json(plan_json))
    return pm, torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS), batch


def train_and_save(rank: int, cluster, plan_json: str, directory: str, export_path: str) -> dict:
    pm, opt, batch = compiled(cluster, plan_json)
    losses = train(pm, opt, batch, STEPS)
    pm.save(directory, opt)
    pm.export(export_path)
    sharded = sum(1 for n, s in pm.plan.stages[0].shardings.items() if n.startswith("p_") and "S" in s.out)
    return {"losses": losses, "sharded_params": sharded}


def continue_from(pm, opt, batch, directory: str, perturb: bool) -> dict:
    pm.load(directory, opt)
    if perturb and dist.get_rank() == 1:  # negative control: one parameter shard of one rank off by 1e-3
        with torch.no_grad():
            held_parameter_shard(pm).add_(1e-3)
    losses = train(pm, opt, batch, STEPS)
    return {"losses": losses, "state": pm.full_state_dict()}


def held_parameter_shard(pm) -> torch.Tensor:
    """A parameter shard this rank holds, a sharded one if there is any."""
    stage = pm.plan.stage_of_rank(dist.get_rank())
    held = [n for n in stage.shardings if n.startswith("p_") and pm.runner.local_state(n)[0] is not None]
    sharded = [n for n in held if "S" in stage.shardings[n].out]
    return pm.runner.local_state((sharded or held)[0])[0]


def resume_on_two_ranks(rank: int, cluster, plan_json: str, directory: str, resaved: str) -> dict:
    """The resumed run, saved again under this plan (when it pipelines, each stage saves its own); the
    perturbed run (loading again into the same, already trained module and optimizer: everything must be
    overwritten); the error of loading the GPT checkpoint into an MLP."""
    pm, opt, batch = compiled(cluster, plan_json)
    out = {"resumed": continue_from(pm, opt, batch, directory, perturb=False), "stages": len(pm.plan.stages)}
    pm.save(resaved, opt)
    out["perturbed"] = continue_from(pm, opt, batch, directory, perturb=True)
    model, batch = make_mlp()
    pm = autopar.compile(model, autopar.Cluster.local(2), batch)
    try:
        pm.load(directory)
    except CheckpointError as e:
        out["foreign"] = str(e)
    return out


def single_device_run(steps: int) -> tuple[list[float], dict]:
    model, batch = make_small_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, snapshots = [], {}
    for step in range(steps):
        loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        snapshots[step + 1] = copy.deepcopy(model.state_dict())
    return losses, snapshots


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    directory, export_path = str(root / "step3"), str(root / "step3.pt")
    cluster4, plan4 = squeezed_plan(4, (2, 2), **one_stage())
    cluster2, plan2 = squeezed_plan(2, (1, 2))  # the planner's choice: a 1×2 mesh, or two pipeline stages
    first = autopar.launch(train_and_save, 4, cluster4, plan4, directory, export_path, timeout=120)
    resaved = str(root / "step6")
    resumed = autopar.launch(resume_on_two_ranks, 2, cluster2, plan2, directory, resaved, timeout=120)
    reference_losses, snapshots = single_device_run(2 * STEPS)
    return {"first": first, "resumed": [r["resumed"] for r in resumed],
            "perturbed": [r["perturbed"] for r in resumed], "foreign": resumed[0].get("foreign"),
            "reference": reference_losses, "snapshots": snapshots, "directory": directory,
            "export_path": export_path, "resaved": resaved, "resumed_stages": resumed[0]["stages"]}


def errors(results: list[dict], runs) -> tuple[float, float]:
    """(largest relative loss error over the 3 resumed steps, largest relative parameter error)."""
    losses = results[0]["losses"]
    reference = runs["reference"][STEPS:]
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    final = runs["snapshots"][2 * STEPS]
    param_err = max(rel(results[0]["state"][k], v) for k, v in final.items())
    return loss_err, param_err


def test_the_saving_plan_shards_parameters_and_matches_one_device(runs):
    first = runs["first"][0]
    assert first["sharded_params"] > 0, "the 2x2 plan shards no parameter: the checkpoint would not be sharded"
    assert max(abs(a - b) / abs(b) for a, b in zip(first["losses"], runs["reference"][:STEPS])) <= LOSS_TOL


def test_resumed_training_on_another_plan_and_world_size_equals_an_uninterrupted_run(runs):
    loss_err, param_err = errors(runs["resumed"], runs)
    assert loss_err <= LOSS_TOL and param_err <= PARAM_TOL, (loss_err, param_err)
    assert len({tuple(r["losses"]) for r in runs["resumed"]}) == 1, "ranks disagree on the loss"


def test_negative_control_a_perturbed_shard_fails_the_check(runs):
    loss_err, param_err = errors(runs["perturbed"], runs)
    assert loss_err > LOSS_TOL or param_err > PARAM_TOL, (loss_err, param_err)


def test_each_rank_writes_only_its_shards(runs):
    """Every chunk is written once (the data files hold about the model plus AdamW's two moments) and
    no rank writes most of it."""
    sizes = [os.path.getsize(os.path.join(runs["directory"], f"__{r}_0.distcp")) for r in range(4)]
    model, _ = make_small_gpt()
    state_bytes = 3 * sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert state_bytes <= sum(sizes) < 1.3 * state_bytes, (sizes, state_bytes)
    assert max(sizes) < 0.6 * sum(sizes), f"one rank wrote most of the checkpoint: {sizes}"


def test_export_loads_into_the_plain_model(runs):
    state = export_state_dict(runs["directory"])
    model, batch = make_small_gpt()
    model.load_state_dict(state)
    expected = runs["snapshots"][STEPS]
    assert list(state) == list(expected)
    assert max(rel(state[k], v) for k, v in expected.items()) <= PARAM_TOL
    saved = torch.load(runs["export_path"])
    assert all(torch.equal(saved[k], state[k]) for k in state), "pm.export and export_state_dict disagree"


def test_the_resumed_plan_saves_the_six_step_model(runs):
    """Saved by the 2-rank plan (two pipeline stages when the planner pipelines: each saves its own)."""
    state = export_state_dict(runs["resaved"])
    expected = runs["snapshots"][2 * STEPS]
    assert max(rel(state[k], v) for k, v in expected.items()) <= PARAM_TOL, runs["resumed_stages"]


def test_missing_and_foreign_checkpoints_are_clear_errors(runs, tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        export_state_dict(tmp_path / "nowhere")
    message = runs["foreign"]
    assert message is not None, "loading a GPT checkpoint into an MLP went through"
    assert "model.fc1.weight is missing" in message and "saved from GPT" in message, message
