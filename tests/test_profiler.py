"""The cluster profiler and the cost formulas it feeds, cheapest first.

No process group: α-β fitting, ``Cluster.matmul_flops``, cluster-JSON validation, the communication and
compute formulas on hand-computable cases. Then one quick profile of 2 local gloo ranks (~10-20 s, mostly
process start-up). Measured values are never compared with absolute numbers: other jobs share this
machine; only sanity (positive, finite, consistent) is asserted.
"""
import json
import math
import types

import pytest
import torch
from torch.distributed.tensor import Shard

from autopar.cost_models.communication import AxisLink, axis_links, redistribute_messages
from autopar.cost_models.compute import compute_time, node_flops
from autopar.errors import ClusterError
from autopar.hardware.cluster import Cluster, CollectiveFit, Link
from autopar.passes.capture import capture
from autopar.placement import R
from autopar.profiling.probes import MIN_BETA, fit_alpha_beta
from autopar.profiling.profiler import group_sizes, profile_cluster
from autopar.profiling.profiler_in_step import IN_STEP_KINDS

MiB = 2**20


def _two_node_cluster(**changes) -> Cluster:
    """2 nodes × 4 devices with round-number links: intra α=10 µs, 100 GB/s; inter α=50 µs, 10 GB/s per node."""
    fields = dict(name="test-2x4", nodes=2, devices_per_node=4, peak_flops={"float32": 1e12}, matmul_efficiency=0.5,
                  memory_bandwidth=1e11, memory_per_device=16e9, intra_node=Link(latency=1e-5, bandwidth=1e11),
                  inter_node=Link(latency=5e-5, bandwidth=1e10), mesh_shape=(2, 4))
    return Cluster(**{**fields, **changes})


# ---- α-β fits ------------------------------------------------------------------------------------
def test_fit_recovers_an_exact_line():
    sizes = [4096 * 4**k for k in range(7)]
    fit = fit_alpha_beta(sizes, [2e-4 + m * 1e-9 for m in sizes])
    assert fit.alpha == pytest.approx(2e-4, rel=1e-9) and fit.beta == pytest.approx(1e-9, rel=1e-9)


def test_fit_keeps_alpha_non_negative_and_beta_positive():
    sizes = [1e3, 1e4, 1e5, 1e6]
    through_origin_below = fit_alpha_beta(sizes, [m * 1e-9 - 1e-7 if m > 1e3 else 5e-7 for m in sizes])
    assert through_origin_below.alpha >= 0 and through_origin_below.beta > 0
    flat = fit_alpha_beta(sizes, [1e-3, 1.1e-3, 0.9e-3, 1e-3])  # no measurable bandwidth cost
    assert flat.beta == MIN_BETA and flat.alpha == pytest.approx(1e-3, rel=0.1)
    with pytest.raises(ValueError, match="positive"):
        fit_alpha_beta([1e3, 1e4], [1e-3, 0.0])


def test_group_sizes_are_the_mesh_axis_sizes():
    assert group_sizes(4) == [2, 4] and group_sizes(2) == [2] and group_sizes(1) == [] and group_sizes(6) == [2, 3, 6]


# ---- communication formulas ----------------------------------------------------------------------
def test_all_reduce_on_a_4_device_axis_of_a_2x4_mesh():
    cluster = _two_node_cluster()
    intra_axis, inter_axis = axis_links(cluster, (2, 4))[1], axis_links(cluster, (2, 4))[0]
    m = 1 * MiB
    assert intra_axis.time("all_reduce", m) == pytest.approx(1e-5 + 2 * 3 / 4 * m / 1e11)
    # axis 0 pairs devices across the 2 nodes; its 4 groups share each node's 10 GB/s NIC
    assert inter_axis.time("all_reduce", m) == pytest.approx(5e-5 + 2 * 1 / 2 * m / (1e10 / 4))


def test_all_gather_message_is_the_gathered_output():
    # (8, 16) float32, Shard(0) over the 4-device axis -> Replicate: each device ends with all 8·16·4 bytes
    messages = redistribute_messages((8, 16), 4, (R, Shard(0)), (R, R), (2, 4), needs_grad=False)
    assert messages == [("all_gather", 1, 8 * 16 * 4, "forward")]
    axis = axis_links(_two_node_cluster(), (2, 4))[1]
    assert axis.time("all_gather", 512) == pytest.approx(1e-5 + 3 / 4 * 512 / 1e11)


def test_a_fit_replaces_the_ring_formula_only_for_its_key():
    link = Link(latency=1e-5, bandwidth=1e11, fits={"all_reduce/4": CollectiveFit(alpha=1e-3, beta=2e-9)})
    axis = AxisLink(4, link.latency, link.bandwidth, link)
    assert axis.time("all_reduce", MiB) == pytest.approx(1e-3 + MiB * 2e-9)
    assert axis.time("all_gather", MiB) == pytest.approx(1e-5 + 3 / 4 * MiB / 1e11)  # no fit: analytic
    assert AxisLink(2, link.latency, link.bandwidth, link).time("all_reduce", MiB) == pytest.approx(
        1e-5 + MiB / 1e11)  # the fit is for groups of 4 only


# ---- compute: FLOPs and the matmul curve ---------------------------------------------------------
@pytest.fixture(scope="module")
def linear_node():
    m, k, n = 4, 16, 8
    graph = capture(torch.nn.Linear(k, n), (torch.randn(m, k),))
    node = next(nd for nd in graph.gm.graph.nodes if nd.op == "call_function")
    return node, (m, k, n)


def test_matmul_flops_forward_and_backward(linear_node):
    node, (m, k, n) = linear_node
    assert node_flops(node) == (2 * m * k * n, 4 * m * k * n)


def test_matmul_flops_interpolates_in_log_flops_and_clamps():
    cluster = _two_node_cluster(matmul_curve={"float32": [[1e9, 4e10], [1e6, 1e10]]})  # unsorted on purpose
    assert cluster.matmul_curve["float32"] == [[1e6, 1e10], [1e9, 4e10]]
    assert cluster.matmul_flops("float32", math.sqrt(1e6 * 1e9)) == pytest.approx(2.5e10)  # log midpoint
    assert cluster.matmul_flops("float32", 1e7) == pytest.approx(1e10 + (1 / 3) * 3e10)
    assert cluster.matmul_flops("float32", 10.0) == 1e10 and cluster.matmul_flops("float32", 0.0) == 1e10
    assert cluster.matmul_flops("float32", 1e15) == 4e10
    assert cluster.matmul_flops("bfloat16", 1e7) == cluster.flops("bfloat16") == 0.5e12  # no curve: peak × eff.


def test_compute_time_prices_flops_at_the_call_size(linear_node):
    node, (m, k, n) = linear_node
    in_vals = [a.meta["val"] for a in node.args]
    strategy = types.SimpleNamespace(work_fraction=1.0, in_specs=[(R, R)] * len(in_vals), out_spec=(R, R))
    slow_small_calls = _two_node_cluster(matmul_curve={"float32": [[1e3, 1e6], [1e9, 1e12]]}, memory_bandwidth=1e15)
    t = compute_time(node, strategy, in_vals, [node.meta["val"]], (2, 4), slow_small_calls, differentiable=True)
    assert t == pytest.approx(6 * m * k * n / slow_small_calls.matmul_flops("float32", 2 * m * k * n))
    no_curve = compute_time(node, strategy, in_vals, [node.meta["val"]], (2, 4),
                            _two_node_cluster(memory_bandwidth=1e15), differentiable=True)
    assert no_curve == pytest.approx(6 * m * k * n / 0.5e12)


# ---- cluster JSON validation ---------------------------------------------------------------------
def _cluster_dict() -> dict:
    return json.loads(_two_node_cluster(matmul_curve={"float32": [[1e6, 1e10]]}).to_json())


def _set(d: dict, path: str, value) -> dict:
    *parents, last = path.split(".")
    for key in parents:
        d = d[key]
    d[last] = value


@pytest.mark.parametrize("path, value, named", [
    ("memory_bandwidth", -1.0, "memory_bandwidth"),
    ("memory_per_device", 0, "memory_per_device"),
    ("matmul_efficiency", "high", "matmul_efficiency"),
    ("peak_flops", {"float32": -5.0}, "peak_flops['float32']"),
    ("intra_node.latency", -1e-6, "intra_node.latency"),
    ("inter_node.bandwidth", 0.0, "inter_node.bandwidth"),
    ("intra_node.fits", {"all_reduce/2": {"alpha": 1e-4, "beta": -1e-9}}, "intra_node.fits['all_reduce/2'].beta"),
    ("intra_node.fits", {"all_reduce/2": {"alpha": -1e-4, "beta": 1e-9}}, "intra_node.fits['all_reduce/2'].alpha"),
    ("intra_node.fits", {"all_reduce/2": {"alpha": 1e-4}}, "intra_node.fits['all_reduce/2']"),
    ("intra_node.fits", {"all_reduce": {"alpha": 1e-4, "beta": 1e-9}}, "'<collective>/<group size>'"),
    ("matmul_curve", {"float32": [[1e6, -1e10]]}, "matmul_curve['float32'] flop_per_s"),
    ("matmul_curve", {"float32": [1e6, 1e10]}, "matmul_curve['float32']"),
    ("nodes", "two", "wrong type"),
])
def test_bad_cluster_json_gives_one_clear_error(path, value, named):
    d = _cluster_dict()
    _set(d, path, value)
    with pytest.raises(ClusterError) as info:
        Cluster.from_json(json.dumps(d))
    assert named in str(info.value) and ("Cluster.profile" in str(info.value))


@pytest.mark.parametrize("field", ["memory_bandwidth", "intra_node", "peak_flops"])
def test_missing_cluster_field_is_named(field):
    d = _cluster_dict()
    del d[field]
    with pytest.raises(ClusterError, match=f"missing \\['{field}'\\]"):
        Cluster.from_json(json.dumps(d))


def test_presets_and_curves_round_trip_exactly():
    for cluster in (Cluster.local(4), Cluster.preset("dgx-a100", nodes=2),
                    _two_node_cluster(matmul_curve={"float32": [[1e6, 1.0 / 3.0], [2e6, 2.0 / 3.0]]})):
        assert Cluster.from_json(cluster.to_json()) == cluster


def test_profile_rejects_bad_arguments_before_starting_ranks():
    with pytest.raises(ClusterError, match="nprocs"):
        profile_cluster(0, quick=True, progress=False)
    with pytest.raises(ClusterError, match="mesh_shape"):
        profile_cluster(2, mesh_shape=(2, 2), quick=True, progress=False)
    with pytest.raises(ClusterError, match="device must be one of"):
        profile_cluster(2, quick=True, progress=False, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ClusterError, match="needs 2 GPUs"):
            profile_cluster(2, quick=True, progress=False, device="cuda")


def test_cpu_machines_profile_on_gloo_and_gpu_machines_on_nccl():
    from autopar.profiling.profiler_device import ProbeDevice

    assert ProbeDevice.choose("cpu", 2).backend == "gloo"
    auto = ProbeDevice.choose("auto", 1)
    assert auto.backend == ("nccl" if torch.cuda.is_available() else "gloo")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_profile_uses_nccl_and_cuda_events(tmp_path):
    n = torch.cuda.device_count()
    cluster = profile_cluster(n, quick=True, progress=False, device="cuda", out=tmp_path / "gpu.json")
    assert cluster.backend == "nccl" and cluster.device_type == "cuda"
    assert "NCCL ranks" in cluster.source and 2**30 < cluster.memory_per_device < 0.96 * cluster.memory_capacity
    assert cluster.peak_flops["float32"] > 1e12  # any GPU beats a CPU core by far
    # host time per op is measured; the probe step's factor is recorded, not applied (GPU_PROBE)
    assert cluster.op_overhead > 0 and cluster.compute_time_scale == 1.0 and "not applied" in cluster.source
    assert Cluster.from_json(tmp_path / "gpu.json") == cluster


# ---- the pipeline runtime's host time (synthetic timings) ---------------------------------------
def _pipeline_rank(cluster, c: float, calls: float, counts=(2, 8), waits: float = 0.0) -> dict:
    """What a rank of ``measure_pipeline`` reports when its CPU does exactly its stage's op calls plus c per
    microbatch and direction (and a fixed part per step); ``waits``: wall seconds per microbatch on top."""
    cpu = {m: 0.01 + m * (calls * cluster.op_overhead + 2 * c) for m in counts}
    wall = {m: t + m * waits for m, t in cpu.items()}
    return {"pipeline": {"counts": counts, "cpu": cpu, "wall": wall, "calls": calls}}


def test_microbatch_overhead_is_the_cpu_slope_its_ops_do_not_explain():
    """s_r = n_r · op_overhead + 2c per rank; waits (wall clock only) do not count; the median over ranks."""
    from autopar.profiling.profiler_pipeline import microbatch_overhead

    cluster = Cluster(**{**Cluster.local(2).__dict__, "op_overhead": 2e-5})
    ranks = [_pipeline_rank(cluster, 3e-4, 8.0, waits=1e-3), _pipeline_rank(cluster, 3e-4, 6.0, waits=5e-3)]
    c, note = microbatch_overhead(cluster, ranks)
    assert c == pytest.approx(3e-4) and "microbatch_overhead 300 µs" in note
    assert microbatch_overhead(cluster, [_pipeline_rank(cluster, 0.0, 8.0)])[0] == pytest.approx(0.0, abs=1e-12)
    three = ranks + [_pipeline_rank(cluster, 1e-3, 6.0)]
    assert microbatch_overhead(cluster, three)[0] == pytest.approx(3e-4)  # the median rank's
    slower = Cluster(**{**cluster.__dict__, "op_overhead": 1.0})  # ops explain more than the slope: no negative c
    assert microbatch_overhead(slower, ranks)[0] == 0.0
    c, note = microbatch_overhead(cluster, [{"pipeline": None}])
    assert c == 0.0 and "one rank" in note


def test_pipeline_cpu_in_reference_units_becomes_seconds_at_the_level():
    """Timed against the reference (CPU ranks), the pipeline's CPU per step comes back in reference units;
    training_seconds scales it by the level, so microbatch_overhead sees seconds like op_overhead's."""
    from autopar.profiling.profiler_pipeline import microbatch_overhead
    from autopar.profiling.profiler_training import training_seconds

    cluster = Cluster(**{**Cluster.local(2).__dict__, "op_overhead": 2e-5})
    level = 4e-4  # seconds of one reference call
    ranks = []
    for calls in (8.0, 6.0):
        seconds = _pipeline_rank(cluster, 3e-4, calls)["pipeline"]
        relative = {m: t / level for m, t in seconds["cpu"].items()}
        raw = {m: 0.5 * t for m, t in seconds["cpu"].items()}  # CPU seconds as timed, on a faster moment
        pipeline = {"counts": seconds["counts"], "calls": calls, "units": "reference", "cpu": relative,
                    "cpu_raw": raw}
        ranks.append(training_seconds({"linears": {}, "pipeline": pipeline}, level))
    c, note = microbatch_overhead(cluster, ranks)
    assert c == pytest.approx(3e-4) and "before scaling to the reference's level" in note
    # negative control: the same ranks left in reference units read a slope 1/level times too large
    unscaled = [{"pipeline": dict(r["pipeline"], cpu={m: t / level for m, t in r["pipeline"]["cpu"].items()})}
                for r in ranks]
    assert microbatch_overhead(cluster, unscaled)[0] > 100 * c


# ---- one real profile: 2 gloo ranks, quick -------------------------------------------------------
@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "cluster.json"
    return profile_cluster(2, quick=True, progress=False, out=path), path


def test_quick_profile_round_trips_through_json(quick_profile):
    cluster, path = quick_profile
    assert Cluster.from_json(path) == cluster
    assert cluster.num_devices == 2 and cluster.backend == "gloo" and cluster.mesh_shape == (1, 2)


def test_quick_profile_fits_are_sane(quick_profile):
    cluster, _ = quick_profile
    fits = cluster.intra_node.fits
    isolated = {"all_reduce/2", "all_gather/2", "reduce_scatter/2", "all_to_all/2", "send/2"}
    assert isolated <= set(fits) and set(fits) - isolated <= {f"{k}/2@step" for k in IN_STEP_KINDS}
    for key, fit in fits.items():
        assert math.isfinite(fit.alpha) and fit.alpha >= 0, key
        assert math.isfinite(fit.beta) and fit.beta > 0, key
        assert fit.time(16 * MiB) > fit.time(4096), key
    assert cluster.inter_node == cluster.intra_node and "same measured link" in cluster.source
    ring = AxisLink(2, cluster.intra_node.latency, cluster.intra_node.bandwidth, Link(latency=0, bandwidth=1))
    assert ring.time("all_reduce", MiB) == pytest.approx(fits["all_reduce/2"].time(MiB))  # representative values


def test_quick_profile_compute_figures_are_sane(quick_profile):
    cluster, _ = quick_profile
    assert math.isfinite(cluster.memory_bandwidth) and cluster.memory_bandwidth > 0
    curve = cluster.matmul_curve["float32"]
    assert len(curve) >= 2 and [f for f, _ in curve] == sorted(f for f, _ in curve)
    assert all(math.isfinite(rate) and rate > 0 for _, rate in curve)
    assert cluster.peak_flops["float32"] == max(rate for _, rate in curve) and cluster.matmul_efficiency == 1.0
    assert cluster.matmul_flops("float32", curve[0][0] / 10) == curve[0][1]


def test_quick_profile_measures_training_conditions(quick_profile):
    """`autopar profile` also measures the host overhead per op call and scales the float32 curve by the
    speed of training-shaped linears (2 ranks have no 2-D mesh, so no in-mesh fits here)."""
    cluster, _ = quick_profile
    assert 1e-7 < cluster.op_overhead < 1e-2
    assert "op_overhead" in cluster.source and "float32 curve ×" in cluster.source
    assert not any("x" in key.partition("@")[2] for key in cluster.intra_node.fits)
    # collectives timed right after a burst of compute: fitted under "@step" and noted in the source
    assert "collectives after a compute burst" in cluster.source
    assert all(f"{kind}/2" in cluster.source for kind in IN_STEP_KINDS)  # each fitted, or said why not
    # the pipeline runtime's host time: a real 2-stage pipeline timed at 2 and 8 microbatches
    assert 0.0 <= cluster.microbatch_overhead < 0.1 and "microbatch_overhead" in cluster.source
    # the level as a training step meets it: the reference beside a neighbour's step (profiler_neighbour)
    assert "beside a neighbour's training step" in cluster.source
    # norms, activations and softmax forward + backward: slower than a streaming add, never zero
    assert 0 < cluster.norm_act_bandwidth < 2 * cluster.memory_bandwidth and "norm/activation" in cluster.source
    # every compute figure was timed against the reference mm and scaled to its median speed
    assert "compute probes timed against float32 mm 256³" in cluster.source
    assert "its windows ran at" in cluster.source  # how far the machine moved while it was profiled
    # the per-op terms' spreads are recorded, the pipeline's host time among them
    assert "spread (IQR / median" in cluster.source and "op_overhead " in cluster.source.split("spread")[1]
    assert "pipeline M=8" in cluster.source and "before scaling to the reference's level" in cluster.source
    # the optimizer step (profiler_optimizer): host time per call and the element passes' rate, both measured
    assert 0 < cluster.optimizer_call_overhead < 1e-2 and cluster.optimizer_bandwidth > 0
    assert "optimizer step:" in cluster.source and "optimizer calls" in cluster.source.split("spread")[1]
