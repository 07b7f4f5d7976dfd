"""The optimizer step in the intra-op ILP's objective (``intra_op_zero.price_optimizer_step``), on simulated clusters.

With memory loose, ZeRO shards weight updates only where the shorter optimizer step (each of the n data-parallel
ranks updates 1/n of the state) outweighs the all-gather it adds; the ILP prices both with the functions the plan
predicts its step with (``optimizer_step_time``), so it and ``plan_builder`` agree. Controls: with the term off
(``CostEnv.price_optimizer``) the same problem keeps level 0, and where the optimizer step is small (fast memory)
the term changes no layout or level.
"""
import dataclasses

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.cost_models.compute import optimizer_step_time
from autopar.cost_models.memory import TrainingSpec
from autopar.passes.capture import capture
from autopar.passes.intra_op import CostEnv, solve_intra_op
from autopar.passes.strategies import generate_strategies

MESH = (1, 8)
WIDTH = 1024
NODE = autopar.Cluster.preset("a100-40gb")  # one p4d node: data parallelism over NVLink


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(4)))

    def forward(self, x):
        return self.layers(x).pow(2).mean()


@pytest.fixture(scope="module")
def problem():
    with torch.device("meta"):
        model = Mlp()
    graph = capture(model, (torch.empty(8192, WIDTH, device="meta"),))
    return graph, generate_strategies(graph, MESH)


def solve(problem, cluster=NODE, price_optimizer=True, **training):
    graph, strategies = problem
    env = CostEnv(cluster, MESH, TrainingSpec(zero_search=True, **training), price_optimizer=price_optimizer)
    return solve_intra_op(graph, strategies, None, env)


def weights(solution) -> dict[str, tuple]:
    return {n: s.out_spec for n, s in solution.strategies.items() if n.startswith("p_")}


def replicated(solution) -> bool:
    return all(not p.is_shard() for spec in weights(solution).values() for p in spec)


def test_zero_chosen_for_its_shorter_optimizer_step_with_memory_loose(problem):
    chosen = solve(problem)
    assert replicated(chosen), "plain data parallelism: the weights stay replicated"
    assert set(chosen.zero) == set(weights(chosen)) and set(chosen.zero.values()) <= {2, 3}, chosen.zero
    numel = 4 * (WIDTH * WIDTH + WIDTH)  # the four layers' weights and biases
    assert chosen.optimizer_time == pytest.approx(optimizer_step_time(numel / 8, 8, 4, "adamw", NODE)), \
        "each of the 8 ranks steps 1/8 of the weights, priced as plan_builder prices it"
    control = solve(problem, price_optimizer=False)
    assert replicated(control) and control.zero == {}, "without the term ZeRO's all-gather only costs time"
    assert control.optimizer_time == 0.0
    level0_step = optimizer_step_time(numel, 8, 4, "adamw", NODE)
    assert chosen.step_time + chosen.optimizer_time < control.step_time + level0_step, \
        "the reason: gathers plus the shorter step cost less than the whole step"


def test_plan_takes_zero_with_memory_loose_and_predicts_a_faster_step():
    with torch.device("meta"):
        model = Mlp()
    batch = (torch.empty(8192, WIDTH, device="meta"),)
    auto = autopar.plan(model, NODE, batch, stages=1, recompute="none")
    plain = autopar.plan(model, NODE, batch, stages=1, recompute="none", zero=0)
    assert auto.stages[0].zero and plain.stages[0].zero == {}
    assert auto.predicted["peak_memory"] < 0.1 * NODE.memory_per_device, "memory does not bind"
    assert auto.predicted["optimizer"] < plain.predicted["optimizer"] / 4
    assert auto.predicted["step_time"] < plain.predicted["step_time"]


def test_small_optimizer_step_changes_nothing(problem):
    fast_memory = dataclasses.replace(NODE, memory_bandwidth=1000 * NODE.memory_bandwidth)
    on, off = solve(problem, fast_memory), solve(problem, fast_memory, price_optimizer=False)
    assert on.zero == off.zero == {}, "a step that short does not pay for an all-gather"
    assert on.strategies == off.strategies and on.step_time == off.step_time
    assert 0 < on.optimizer_time < 1e-3 * on.step_time


def test_slow_data_parallel_link_keeps_level_zero(problem):
    slow = dataclasses.replace(NODE, intra_node=autopar.Cluster.preset("p3.16xlarge").inter_node)
    solution = solve(problem, slow)
    assert solution.zero == {}, "over 25 Gbps the all-gather costs more than the shorter step saves"
    assert solution.optimizer_time > 0
