"""Recompute's replay is priced with the forward half of the resharding its layers read (passes.recompute).

Tensor parallelism's all-reduces are resharding edges of the ILP, not op communication. A fully recomputed
Megatron layer re-runs its forward all-reduces in backward, so slowing the link by Δ per byte must add to
the replay's price half of what it adds to the step's activation communication (forward + backward pairs).
Controls: data parallelism's replay has no activation collectives (only the loss's small one), so the same
slower link hardly moves it;
and the priced replay of the Megatron plan without the resharding term would not move either.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import autopar
import autopar.passes.recompute as recompute
from autopar.hardware.cluster import Link
from benchmarks.fidelity.fidelity_plans import _MESH_2, BATCH, CONFIG, data_parallel, megatron
from examples.gpt import make_gpt


def _plan(bandwidth: float, pin: dict) -> autopar.Plan:
    cluster = dataclasses.replace(autopar.Cluster.preset("p3.16xlarge"), devices_per_node=2, mesh_shape=None,
                                  intra_node=Link(latency=5e-6, bandwidth=bandwidth))
    model, batch = make_gpt(CONFIG, batch_size=BATCH)
    return autopar.plan(model, cluster.with_mesh(_MESH_2), batch, pin=pin, recompute="full", stages=1)


def _replay_and_activation_comm(bandwidth: float, pin: dict) -> tuple[float, float]:
    (stage,) = _plan(bandwidth, pin).stages
    p = stage.predicted
    return float(p["recompute"]), float(p["comm"] - p["grad_sync"])


def _slower_link_adds(pin: dict) -> tuple[float, float]:
    fast = _replay_and_activation_comm(20e9, pin)
    slow = _replay_and_activation_comm(2e9, pin)
    return slow[0] - fast[0], slow[1] - fast[1]


def test_tensor_parallel_replay_pays_half_its_activation_collectives():
    replay, comm = _slower_link_adds(megatron(_MESH_2, tp_axis=1, dp_axis=None))
    assert comm > 1e-3, "the slower link must cost tensor parallelism's all-reduces something"
    assert replay == pytest.approx(comm / 2, rel=0.05)


def test_data_parallel_replay_has_no_activation_collectives_to_replay():
    replay, comm = _slower_link_adds(data_parallel(_MESH_2))
    tensor_parallel = _slower_link_adds(megatron(_MESH_2, tp_axis=1, dp_axis=None))
    assert 0 <= replay < 0.1 * tensor_parallel[0] and comm < 0.1 * tensor_parallel[1]


def test_without_the_resharding_term_the_replay_misses_them(monkeypatch):
    monkeypatch.setattr(recompute, "replayed_resharding", lambda costs: np.zeros(len(costs.t)))
    replay, comm = _slower_link_adds(megatron(_MESH_2, tp_axis=1, dp_axis=None))
    assert replay < 0.2 * comm / 2
