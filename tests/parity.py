"""Parity harness: train a model sharded on a local gloo cluster and on one device, and compare.

``run_cases`` runs in every rank of one ``autopar.launch``; each case compiles a model for a mesh and a
layout, takes 3 AdamW steps on both the sharded module and a single-device copy, and reports the largest
relative loss error over the steps and the largest relative parameter error (‖a−b‖/‖b‖ per tensor).

AdamW uses eps=1e-6 (a common setting): GPT-2's fused QKV bias has a key slice whose gradient is
analytically zero (softmax ignores a per-query constant). Its round-off noise differs with the reduction
order of any sharding, and eps=1e-8 turns that noise into full-size updates, which no parallel run can
reproduce; with eps=1e-6 such noise moves nothing.
"""
import copy

import torch

import autopar
from autopar.driver import PlanOptions, memory_bounds
from autopar.passes.capture import capture
from autopar.runtime import collectives
from tests.models import FACTORIES

LR, EPS, STEPS = 1e-3, 1e-6, 3


def layout_options(layout: str, model_name: str, cluster, model, batch) -> tuple:
    """(cluster, plan options) for a layout: "auto" squeezes memory so the plan must shard; "dp" pins
    the batch split on every axis and replicated parameters."""
    if layout == "dp":
        replicated = "R" * len(cluster.mesh_shape)
        split = "".join("S(0)" if size > 1 else "R" for size in cluster.mesh_shape)
        return cluster, {"pin": {"p_*": replicated, batch_pin_name(model_name, 0): split,
                                 batch_pin_name(model_name, 1): split}}
    floor, replicated = memory_bounds(capture(model, batch), cluster, PlanOptions())
    return cluster.with_memory(floor + 0.3 * (replicated - floor)), {}


def batch_pin_name(model_name: str, i: int) -> str:
    return {"mlp": ["x", "y"], "gpt": ["idx", "targets"], "hf_gpt2": ["input_ids", "labels"]}[model_name][i]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / (b.double().norm() + 1e-30))


def run_case(model_name: str, mesh, layout: str, world: int) -> dict:
    model, batch = FACTORIES[model_name]()
    reference = copy.deepcopy(model)
    cluster, options = layout_options(layout, model_name, autopar.Cluster.local(world, mesh_shape=mesh), model, batch)
    pm = autopar.compile(model, cluster, batch, **options)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, eps=EPS)
    loss_err = 0.0
    for _ in range(STEPS):
        loss = pm.train_step(*batch)
        opt.step()
        opt.zero_grad()
        ref_loss = reference(*batch)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_err = max(loss_err, abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
    full = pm.full_state_dict()
    param_err = max(rel(full[k], v) for k, v in reference.state_dict().items())
    stage = pm.plan.stages[0]
    return {"loss_err": loss_err, "param_err": param_err, "loss": loss.item(),
            "collectives": len(stage.collectives),
            "sharded_params": sum(1 for n, s in stage.shardings.items() if n.startswith("p_") and "S" in s.out),
            "keys_match": list(full) == list(reference.state_dict()),
            "shapes_match": all(full[k].shape == v.shape for k, v in reference.state_dict().items())}


def run_cases(rank: int, cases: list[tuple], world: int) -> dict:
    results = {}
    for case in cases:
        model_name, mesh, layout, sabotage = case
        original = collectives._all_reduce
        if sabotage:  # negative control: every all-reduce silently returns the local value
            collectives._all_reduce = lambda x, key: x.contiguous().clone()
        try:
            results[case] = run_case(model_name, mesh, layout, world)
        finally:
            collectives._all_reduce = original
    return results
