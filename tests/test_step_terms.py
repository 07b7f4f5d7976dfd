"""The CPU step terms the profile measures: collectives after a burst of compute ("@step" fits) and the
optimizer step's per-tensor op calls, counted from torch. Fast tier: no process groups."""
import json

import pytest
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.cost_models.communication import AxisLink, axis_links, zero_pair_time
from autopar.cost_models.compute import optimizer_host_calls, optimizer_step_time
from autopar.cost_models.optimizer_calls import optimizer_calls_per_tensor
from autopar.errors import ClusterError
from autopar.hardware.cluster import Cluster, CollectiveFit, Link
from autopar.profiling.profiler_in_step import IN_STEP_KINDS, in_step_fits, in_step_sizes, with_in_step_fits

MiB = 2**20
ISOLATED = CollectiveFit(alpha=5e-4, beta=1e-9)


def _link(**fits) -> Link:
    return Link(latency=5e-4, bandwidth=2e9, fits={"all_reduce/2": ISOLATED, **fits})


def test_an_in_step_fit_prices_the_collective_and_a_mesh_fit_still_comes_first():
    in_step = CollectiveFit(alpha=1e-3, beta=2e-9)
    link = _link(**{"all_reduce/2@step": in_step})
    axis = AxisLink(2, link.latency, link.bandwidth, link)
    assert axis.time("all_reduce", 13 * MiB) == pytest.approx(in_step.time(13 * MiB))
    assert axis.bandwidth_time("all_reduce", MiB) == pytest.approx(2e-9 * MiB)  # bucketed syncs use it too
    # an in-step fit below the isolated one (noise of a difference) never makes a collective cheaper
    low = _link(**{"all_reduce/2@step": CollectiveFit(alpha=1e-4, beta=5e-10)})
    assert AxisLink(2, 0, 1e9, low).time("all_reduce", MiB) == pytest.approx(ISOLATED.time(MiB))
    # control: without the in-step fit the isolated one prices it
    plain = AxisLink(2, link.latency, link.bandwidth, _link())
    assert plain.time("all_reduce", 13 * MiB) == pytest.approx(ISOLATED.time(13 * MiB))
    # a 2x2 mesh's own interleaved fit outranks the in-step one on that mesh
    mesh_fit = CollectiveFit(alpha=3e-3, beta=1e-9)
    meshed = _link(**{"all_reduce/2@step": in_step, "all_reduce/2@2x2": mesh_fit})
    assert AxisLink(2, 0, 1e9, meshed, "2x2").time("all_reduce", MiB) == pytest.approx(mesh_fit.time(MiB))


def test_in_step_fits_follow_the_measurement():
    points = {"all_reduce/2": [(MiB, 2e-3), (4 * MiB, 5e-3), (16 * MiB, 17e-3)]}
    fits, note = in_step_fits(points)
    fit = fits["all_reduce/2@step"]
    assert fit.time(16 * MiB) == pytest.approx(17e-3, rel=0.05) and "collectives after a compute burst" in note
    # control: a slower measurement moves the price with it
    slower = {"all_reduce/2": [(m, 2 * t) for m, t in points["all_reduce/2"]]}
    assert in_step_fits(slower)[0]["all_reduce/2@step"].time(16 * MiB) == pytest.approx(2 * fit.time(16 * MiB))


def test_in_step_points_that_added_nothing_are_left_out():
    fits, note = in_step_fits({"all_gather/2": [(MiB, -1e-4), (4 * MiB, 3e-3)],
                               "zero_pair/2": [(MiB, 2e-3), (4 * MiB, 0.0), (16 * MiB, 9e-3)]})
    assert "all_gather/2@step" not in fits and "all_gather/2 not fitted (1 positive points)" in note
    assert fits["zero_pair/2@step"].time(16 * MiB) == pytest.approx(9e-3, rel=0.05)
    assert in_step_fits({}) == ({}, "")  # GPUs and one rank measure nothing: nothing changes


def test_profiled_in_step_fits_reach_the_plan_links_and_gpus_get_none():
    cluster = Cluster.local(2)
    points = {"all_reduce/2": [(MiB, 3e-3), (16 * MiB, 30e-3)]}
    profiled, note = with_in_step_fits(cluster, [{"in_step": points}, {"in_step": points}])
    link = axis_links(profiled, (1, 2))[1]
    assert link.time("all_reduce", 16 * MiB) == pytest.approx(30e-3, rel=0.02)
    assert profiled.inter_node == profiled.intra_node and note
    assert with_in_step_fits(cluster, [{"in_step": {}}]) == (cluster, "")  # control: unmeasured, unchanged
    assert in_step_sizes((1, 2, 3, 4, 5, 6)) == (3, 4, 5, 6) and "zero_pair" in IN_STEP_KINDS


def test_in_step_fit_keys_round_trip_and_a_misspelt_one_is_refused():
    cluster = Cluster.local(2)
    link = _link(**{"all_reduce/2@step": CollectiveFit(alpha=1e-3, beta=2e-9)})
    profiled = Cluster(**{**cluster.__dict__, "intra_node": link, "inter_node": link})
    assert Cluster.from_json(profiled.to_json()) == profiled
    d = json.loads(profiled.to_json())
    d["intra_node"]["fits"]["all_reduce/2@stpe"] = {"alpha": 1e-3, "beta": 2e-9}
    with pytest.raises(ClusterError, match="@step"):
        Cluster.from_json(json.dumps(d))


def test_optimizer_calls_are_counted_from_torchs_cpu_loop():
    # torch 2.13's per-tensor AdamW: add_ (step), mul_ (decay), lerp_, mul_, addcmul_, item, sqrt, div, add_, addcdiv_
    assert optimizer_calls_per_tensor("adamw") == 10
    assert optimizer_calls_per_tensor("sgd") == 1 < optimizer_calls_per_tensor("sgd_momentum")
    assert optimizer_host_calls("adamw") == 11  # and zero_grad's one per tensor
    with FakeTensorMode():  # a planner's fake mode does not leak into the count
        optimizer_calls_per_tensor.cache_clear()
        assert optimizer_calls_per_tensor("adam") == 9
    with pytest.raises(ValueError, match="known"):
        optimizer_calls_per_tensor("lion")


def test_optimizer_host_time_moves_with_the_count_and_op_overhead_on_cpus_only():
    cpu = Cluster(**{**Cluster.local(1).__dict__, "op_overhead": 2e-5, "memory_bandwidth": 1e10})
    gpu = Cluster(**{**cpu.__dict__, "device_type": "cuda", "backend": "nccl"})
    traffic = 4e6 * 4 * 7 / 1e10
    assert optimizer_step_time(4e6, 65, 4, "adamw", cpu) == pytest.approx(traffic + 65 * 11 * 2e-5)
    assert optimizer_step_time(4e6, 65, 4, "sgd", cpu) < optimizer_step_time(4e6, 65, 4, "adamw", cpu)
    faster = Cluster(**{**cpu.__dict__, "op_overhead": 1e-5})  # control: a measured op_overhead moves it
    assert optimizer_step_time(4e6, 65, 4, "adamw", faster) == pytest.approx(traffic + 65 * 11 * 1e-5)
    assert optimizer_step_time(4e6, 65, 4, "adamw", gpu) == pytest.approx(traffic)  # GPUs: foreach, no per-tensor


def test_the_zero_pair_is_priced_from_its_own_fit_where_profiled():
    pair = CollectiveFit(alpha=1e-3, beta=5e-9)
    link = _link(**{"zero_pair/2@step": pair, "reduce_scatter/2": ISOLATED, "all_gather/2": ISOLATED})
    assert zero_pair_time(AxisLink(2, 0, 1e9, link), 16 * MiB) == pytest.approx(pair.time(16 * MiB))
    # control: without the profiled pair, the reduce-scatter's and the all-gather's own prices
    plain = AxisLink(2, 0, 1e9, _link(**{"reduce_scatter/2": ISOLATED, "all_gather/2": ISOLATED}))
    assert zero_pair_time(plain, 16 * MiB) == pytest.approx(2 * ISOLATED.time(16 * MiB))
