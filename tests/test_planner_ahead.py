"""``autopar.planner.ahead``: exact checks solved in forked workers beside the DP's stages give the plans the
sequential walk gives. Planned on simulated clusters (meta device)."""
import dataclasses

import torch

import autopar
from examples.gpt import GPT, make_batch, suite_config


def test_the_twice_microbatch_plan_solved_beside_is_the_one_solved_in_turn(monkeypatch):
    """GPT-6.7B's width in 8 layers on 4 V100s, 1F1B: the DP picks 2 stages at B = 32 and ``more_microbatches``
    asks for its stages at 2B, which ``ahead.twice_ahead`` solved in a worker. The worker's plan is the one the
    driver solves in this process at 2B (negative control: the plan at B, the one kept, differs), so the walk reads
    what it would have solved in turn."""
    import autopar.planner.driver as driver

    cfg = dataclasses.replace(suite_config("6.7B"), n_layer=8)
    with torch.device("meta"):
        model = GPT(cfg).half()
    batch, cluster = make_batch(cfg, 64, device="meta"), autopar.Cluster.preset("p3.16xlarge", gpus=4)
    made = []  # (the worker, its solve, the B it was asked at, what it answered)
    twice_ahead = driver.twice_ahead

    def recorded(choice, candidates, solve_at):
        worker = twice_ahead(choice, candidates, solve_at)
        made.append([worker, solve_at, 2 * choice.microbatches, None])
        if worker is not None:
            result = worker.result
            worker.result = lambda: made[-1].__setitem__(3, result()) or made[-1][3]
        return worker

    monkeypatch.setattr(driver, "twice_ahead", recorded)
    forked_plan = autopar.plan(model, cluster, batch, schedule="1f1b")
    assert len(made) == 1 and made[0][0] is not None and made[0][3] is not None, "the 2B plan was solved beside"
    _, solve_at, twice, answered = made[0]
    assert len(forked_plan.stages) == 2 and twice == 2 * forked_plan.microbatches
    assert answered.to_json() == solve_at(twice).to_json()
    assert answered.to_json() != forked_plan.to_json(), "control: the plan of the stages at B is another plan"
