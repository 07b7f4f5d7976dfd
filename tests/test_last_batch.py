"""A smaller last batch trains the same weights: ``autopar.compile(model, cluster, small, share_with=pm)``.

2 ranks, the MLP under the planner's squeezed plan (it shards). Sequence: 2 full batches (16 rows) with ``pm``,
the epoch's last batch (5 rows: no even batch split on 2 ranks) with the module compiled for it sharing ``pm``'s
tensors, then 1 more full batch with ``pm``; one AdamW over ``pm.parameters()`` throughout. It must match one device
trained on the same 4 batches: the loss of the step after the small batch (so that step used the weights the small
batch trained) and the final weights. The small batch's error names ``share_with``. Negative control: the old advice
(a module compiled from the model without ``share_with``) trains another copy, and the final weights differ.
"""

import pytest
import torch

import autopar
from autopar.errors import InputError
from tests.models import make_mlp
from tests.parity import EPS, LR, layout_options, rel, train_one_device

SMALL = 5


def batches():
    _, full = make_mlp(batch_size=16, seed=0)
    _, small = make_mlp(batch_size=SMALL, seed=1)
    _, later = make_mlp(batch_size=16, seed=2)
    return [full, full, small, later]


def train_both(rank: int, cluster, plan_json: str) -> dict:
    """One launch: the sequence with ``share_with``, then again without (the negative control)."""
    return {"shared": train(cluster, plan_json, True), "unshared": train(cluster, plan_json, False)}


def train(cluster, plan_json: str, share: bool) -> dict:
    model, first = make_mlp()
    pm = autopar.compile(model, cluster, first, plan=autopar.Plan.from_json(plan_json))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    out = {"losses": [], "sharded": sum("S" in sh.out for n, sh in pm.plan.stages[0].shardings.items()
                                         if n.startswith("p_"))}
    for step, batch in enumerate(batches()):
        module = pm
        if step == 2:
            try:
                pm.train_step(*batch)
            except InputError as e:
                out["error"] = str(e)
            module = autopar.compile(model, cluster, batch, share_with=pm if share else None)
            out["same tensors"] = [id(p) for p in module.parameters()] == [id(p) for p in pm.parameters()]
        out["losses"].append(module.train_step(*batch).item())
        opt.step()
        opt.zero_grad()
    out["state"] = pm.full_state_dict()
    return out


def single_device() -> tuple[list, dict]:
    model, _ = make_mlp()
    return train_one_device(model, batches())


@pytest.fixture(scope="module")
def runs():
    model, batch = make_mlp()
    cluster, options = layout_options("auto", "mlp", autopar.Cluster.local(2), model, batch)
    plan_json = autopar.plan(model, cluster, batch, **options).to_json()
    first = autopar.launch(train_both, 2, cluster, plan_json, timeout=120)[0]
    return first["shared"], first["unshared"], single_device()


@pytest.mark.distributed
def test_the_last_batch_trains_the_weights_the_next_step_uses(runs):
    shared, _, (losses, state) = runs
    assert shared["sharded"] > 0, "the plan shards no parameter: sharing would be trivial"
    assert shared["same tensors"], "the small batch's module has its own parameters"
    assert abs(shared["losses"][3] - losses[3]) <= 1e-5 * abs(losses[3]), (shared["losses"], losses)
    assert max(rel(shared["state"][k], v) for k, v in state.items()) <= 1e-4


@pytest.mark.distributed
def test_the_small_batch_error_points_to_share_with(runs):
    assert "share_with=pm" in runs[0]["error"] and "(5, 32)" in runs[0]["error"]


@pytest.mark.distributed
def test_negative_control_a_module_without_share_with_trains_another_copy(runs):
    _, unshared, (_, state) = runs
    assert not unshared["same tensors"]
    assert max(rel(unshared["state"][k], v) for k, v in state.items()) > 1e-4
