"""The cost model's preset terms on hand-computable cases: the matmul curve by call size, usable memory,
bandwidth by group size (V100 cube-mesh), ring/tree step latency, attention priced by its kernel, the
end-to-end compute factor, the profiler's training-condition measurements (synthetic inputs), and the pipeline
runtime's host time per (chunk, microbatch) in the step time and the stage DP."""
import dataclasses
import math
import types

import numpy as np
import pytest
import torch

from autopar.cost_models.communication import AxisLink, algorithm_steps, axis_links
from autopar.cost_models.compute import ATTENTION_RATE, SCORE_PASSES, attention_kernel, compute_time, node_flops
from autopar.errors import ClusterError
from autopar.hardware.cluster import Cluster, CollectiveFit, Link
from autopar.hardware.presets import GEMM_RAMP, gemm_curve, usable_memory
from autopar.passes.capture import capture
from autopar.passes.stage_dp import stage_dp
from autopar.placement import R
from autopar.plan import Stage
from autopar.planner.plan_builder import charge_microbatch_overhead, predict
from autopar.profiling.profiler_training import _share, in_mesh_fits, meshes_of, training_matmul_factor
from examples.gpt import GPT, GPTConfig, make_batch

GB, MiB, GiB = 1e9, 2**20, 2**30


# ---- compute: curve and factor -------------------------------------------------------------------
def test_gemm_curve_saturates_at_the_plateau_and_halves_at_plateau_times_ramp():
    plateau = 100e12
    curve = dict((f, r) for f, r in gemm_curve(plateau))
    half = plateau * GEMM_RAMP  # a call this size spends as long ramping as computing
    assert gemm_curve(plateau, ramp=5e-6)[0][1] == pytest.approx(plateau * 1e6 / (1e6 + plateau * 5e-6))
    assert plateau * half / (half + plateau * GEMM_RAMP) == pytest.approx(plateau / 2)
    assert curve[1e14] == pytest.approx(plateau * 1e14 / (1e14 + 5e8))  # within 0.5 % of the plateau
    rates = [r for _, r in gemm_curve(plateau)]
    assert rates == sorted(rates), "larger calls never run slower"


def test_presets_use_their_curve_so_small_matmuls_are_slower():
    a100 = Cluster.preset("dgx-a100")
    big, small = a100.matmul_flops("bfloat16", 1e13), a100.matmul_flops("bfloat16", 1e8)
    assert big == pytest.approx(0.859 * 312e12, rel=0.01)  # MAMF: 267.9 of 312 TFLOPS
    assert small < 0.1 * big


def test_usable_memory_is_capacity_less_context_less_reserve():
    assert usable_memory(16160 * MiB) == pytest.approx((16160 * MiB - GiB) * 0.95)
    assert usable_memory(80 * GiB, context=0.5 * GiB, reserve=0.1) == pytest.approx(79.5 * GiB * 0.9)


# ---- communication: topology and algorithm --------------------------------------------------------
def test_v100_cube_mesh_bandwidth_depends_on_the_group_size():
    link = Cluster.preset("p3.16xlarge").intra_node
    assert [link.bandwidth_for(n) for n in (2, 3, 4, 8)] == [25 * GB, 25 * GB, 50 * GB, 130 * GB]
    tp2, dp4 = axis_links(Cluster.preset("p3.16xlarge"), (4, 2))[::-1]
    assert (tp2.size, tp2.bandwidth) == (2, 25 * GB) and (dp4.size, dp4.bandwidth) == (4, 50 * GB)
    nvswitch = Cluster.preset("dgx-a100").intra_node
    assert nvswitch.bandwidth_for(2) == nvswitch.bandwidth_for(8) == nvswitch.bandwidth


def test_ring_and_tree_steps():
    assert algorithm_steps("all_reduce", 8) == 6  # tree 2·log2(8) beats ring 2·7
    assert algorithm_steps("all_reduce", 2) == 2 and algorithm_steps("all_reduce", 1) == 0
    assert algorithm_steps("all_gather", 8) == 7 and algorithm_steps("send", 8) == 1
    assert algorithm_steps("all_reduce", 64) == 12


def test_hop_latency_adds_per_step():
    link = Link(latency=1e-5, bandwidth=1e9, hop_latency=1e-6)
    axis = AxisLink(4, link.latency, link.bandwidth, link)
    assert axis.time("all_reduce", 1e6) == pytest.approx(1e-5 + 4 * 1e-6 + 1.5 * 1e6 / 1e9)
    assert axis.time("all_gather", 1e6) == pytest.approx(1e-5 + 3 * 1e-6 + 0.75 * 1e6 / 1e9)


def test_bad_group_bandwidth_is_a_cluster_error():
    d = Cluster.preset("p3.16xlarge").to_dict()
    d["intra_node"]["group_bandwidth"] = {"one": 1e9}
    with pytest.raises(ClusterError, match="group size"):
        Cluster.from_dict(d)
    d["intra_node"]["group_bandwidth"] = {"2": -1.0}
    with pytest.raises(ClusterError, match="group_bandwidth"):
        Cluster.from_dict(d)


# ---- attention by kernel ------------------------------------------------------------------------
def _attention_node(n_embd: int, n_head: int, dtype=torch.float16):
    cfg = GPTConfig(n_layer=1, n_embd=n_embd, n_head=n_head, seq_len=64, vocab_size=64)
    with torch.device("meta"):
        model = GPT(cfg).to(dtype)
    graph = capture(model, make_batch(cfg, 2, device="meta"))
    return next(n for n in graph.gm.graph.nodes if "scaled_dot_product" in str(n.target))


def _time(node, cluster):
    vals = [a.meta["val"] for a in node.args[:3] if isinstance(a, torch.fx.Node)]
    strategy = types.SimpleNamespace(work_fraction=1.0, in_specs=[(R,) * v.dim() for v in vals],
                                     out_spec=(R,) * node.meta["val"].dim())
    return compute_time(node, strategy, vals, [node.meta["val"]], (1, 1), cluster, differentiable=True)


def test_attention_kernel_follows_the_dispatcher():
    node = _attention_node(64, 4)  # head dim 16, fp16, causal, no mask
    assert attention_kernel(node, Cluster.preset("dgx-a100")) == "flash"
    assert attention_kernel(node, Cluster.preset("p3.16xlarge")) == "efficient"  # V100: no flash (sm70)
    assert attention_kernel(node, Cluster.local(1)) is None
    assert attention_kernel(_attention_node(48, 4), Cluster.preset("dgx-a100")) == "math"  # head dim 12


def test_fused_attention_is_causal_halved_flops_at_the_kernel_rate():
    node = _attention_node(64, 4)
    a100 = Cluster.preset("dgx-a100", nodes=1)
    a100 = Cluster(**{**a100.__dict__, "memory_bandwidth": 1e18, "compute_time_scale": 1.0})
    fwd, bwd = node_flops(node)
    rate = a100.matmul_flops("float16", fwd)
    assert _time(node, a100) == pytest.approx((fwd + bwd) * 0.5 / (rate * ATTENTION_RATE["flash"]))
    no_bf16 = Cluster(**{**a100.__dict__, "peak_flops": {"float16": 312e12, "float32": 19.5e12}})
    slower = ATTENTION_RATE["flash"] / ATTENTION_RATE["efficient"]
    assert _time(node, no_bf16) == pytest.approx(_time(node, a100) * slower)


def test_materialized_attention_pays_for_the_score_matrix():
    node = _attention_node(48, 4)  # head dim 12: math kernel
    a100 = Cluster(**{**Cluster.preset("dgx-a100").__dict__, "compute_time_scale": 1.0})
    fwd, bwd = node_flops(node)
    scores = 2 * 4 * 64 * 64 * 2  # batch · heads · s · s · fp16 bytes
    expected = (fwd + bwd) / a100.matmul_flops("float16", fwd) + scores * SCORE_PASSES / a100.memory_bandwidth
    assert _time(node, a100) == pytest.approx(expected)


def test_compute_time_scale_multiplies_the_roofline_not_the_overhead():
    node = _attention_node(64, 4)
    base = Cluster(**{**Cluster.local(1).__dict__, "compute_time_scale": 1.0, "op_overhead": 1e-3})
    scaled = Cluster(**{**base.__dict__, "compute_time_scale": 2.0})
    assert _time(node, base) > 2e-3
    assert _time(node, scaled) - 2e-3 == pytest.approx(2 * (_time(node, base) - 2e-3))


def test_host_time_adds_on_cpu_ranks_and_overlaps_on_gpus():
    """A GPU op costs max(kernel, host): a small kernel waits for its launch, a large one hides it."""
    node = next(n for n in _attention_node(64, 4).graph.nodes if "linear" in str(n.target))
    gpu = Cluster(**{**Cluster.preset("dgx-a100").__dict__, "compute_time_scale": 1.0})
    kernel = _time(node, gpu)  # op_overhead 0: the kernel alone
    for host in (kernel / 10, 10 * kernel):  # per call; the node is charged 2 calls (forward, backward)
        on_gpu = Cluster(**{**gpu.__dict__, "op_overhead": host})
        assert _time(node, on_gpu) == pytest.approx(max(kernel, 2 * host))
        as_cpu = Cluster(**{**on_gpu.__dict__, "device_type": "cpu", "backend": "gloo"})
        assert _time(node, as_cpu) == pytest.approx(kernel + 2 * host)  # negative control: the CPU sum


def test_autocast_copies_cost_a_kernel_and_an_op_call_each_way():
    from autopar.cost_models.compute import cast_time
    from autopar.placement import S

    x = torch.empty(4, 8, device="meta")  # 128 fp32 bytes
    gpu = Cluster(**{**Cluster.local(1).__dict__, "device_type": "cuda", "backend": "nccl",
                     "memory_bandwidth": 1e3, "op_overhead": 0.0})
    # a bf16 copy (ratio 0.5): forward reads 128 and writes 64 bytes, backward the same back
    assert cast_time(((0, 0.5),), [x], [(R, R)], (1, 1), gpu, True) == pytest.approx(2 * 128 * 1.5 / 1e3)
    assert cast_time(((0, 0.5),), [x], [(R, R)], (1, 1), gpu, False) == pytest.approx(128 * 1.5 / 1e3)
    assert cast_time(((0, 0.5),), [x], [(R, S(0))], (1, 2), gpu, True) == pytest.approx(128 * 1.5 / 1e3)  # half
    # host-bound copies on a GPU cost their two op calls; on CPU ranks calls and bytes add
    slow_host = Cluster(**{**gpu.__dict__, "op_overhead": 1.0})
    assert cast_time(((0, 0.5),), [x], [(R, R)], (1, 1), slow_host, True) == pytest.approx(2.0)
    as_cpu = Cluster(**{**slow_host.__dict__, "device_type": "cpu", "backend": "gloo"})
    assert cast_time(((0, 0.5),), [x], [(R, R)], (1, 1), as_cpu, True) == pytest.approx(2.0 + 0.384)
    assert cast_time((), [x], [(R, R)], (1, 1), as_cpu, True) == 0.0  # negative control: no copies, no cost


def test_optimizer_host_charge_is_per_tensor_on_cpus_only():
    from autopar.cost_models.compute import optimizer_step_time

    cpu = Cluster(**{**Cluster.local(1).__dict__, "op_overhead": 1e-5, "memory_bandwidth": 1e9})
    gpu = Cluster(**{**cpu.__dict__, "device_type": "cuda", "backend": "nccl"})
    traffic = 1000 * 4 * 7 / 1e9
    assert optimizer_step_time(1000, 10, 4, "adamw", gpu) == pytest.approx(traffic)
    assert optimizer_step_time(1000, 10, 4, "adamw", cpu) == pytest.approx(traffic + 10 * 11 * 1e-5)


# ---- profiler: training conditions, synthetic measurements ----------------------------------------
def test_meshes_of_lists_two_dimensional_meshes():
    assert meshes_of(4) == [(2, 2)] and meshes_of(8) == [(2, 4), (4, 2)] and meshes_of(2) == [] and meshes_of(3) == []


def test_in_mesh_fit_splits_an_alternating_pair_between_the_axes():
    cluster = Cluster.local(4)
    sizes = [4096.0, 65536.0, 1048576.0]
    pair = [(m, m, 2 * (1e-3 + m * 1e-9)) for m in sizes]  # each axis alone: 1 ms + 1 ns/byte
    fits = in_mesh_fits(cluster, [{"mesh": {((2, 2), "all_reduce"): pair}}] * 4)
    fit = fits["all_reduce/2@2x2"]
    assert fit.alpha == pytest.approx(1e-3) and fit.beta == pytest.approx(1e-9)
    alone = [CollectiveFit(alpha=1e-3, beta=1e-12), CollectiveFit(alpha=3e-3, beta=1e-12)]
    assert _share(alone, 0, 0.0, 0.0) == pytest.approx(0.25) and _share([None, alone[1]], 1, 0.0, 0.0) == 0.5


def test_training_matmul_factor_is_curve_time_over_kernel_time():
    cluster = Cluster(**{**Cluster.local(1).__dict__, "matmul_curve": {"float32": [[1.0, 1e10], [1e15, 1e10]]}})
    shapes = [(256, 256, 1024), (1024, 512, 512)]
    overhead = 1e-4
    measured = [2 * 3 * 2.0 * math.prod(s) / 1e10 + 2 * overhead for s in shapes]  # half the curve's speed
    assert training_matmul_factor(cluster, "float32", shapes, measured, overhead) == pytest.approx(0.5)
    # on a GPU the launches overlap the kernels: the measured time is the kernels' own
    gpu = Cluster(**{**cluster.__dict__, "device_type": "cuda", "backend": "nccl"})
    kernels = [2 * 3 * 2.0 * math.prod(s) / 1e10 for s in shapes]
    assert training_matmul_factor(gpu, "float32", shapes, kernels, overhead) == pytest.approx(0.5)
    assert training_matmul_factor(gpu, "float32", shapes, measured, overhead) < 0.5  # not subtracted


def test_single_step_release_counts_gradients_made_after_later_activations_are_freed():
    from autopar.cost_models.memory import single_step_release

    # layers at positions 0, 1, 2 keep 10, 10, 4 bytes; gradients of 3 (read at 0) and 6 (read at 2)
    acts, grads = [(0, 10.0), (1, 10.0), (2, 4.0)], [(0, 3.0), (2, 6.0)]
    # live at x = 0: 10 + 3 + 6; x = 1: 20 + 6; x = 2: 24 + 6: the peak 30 is 3 under A + G = 33
    assert single_step_release(acts, grads) == 3.0
    assert single_step_release(acts, []) == 0.0
    # negative control: a gradient read only at the end exists while everything is still kept
    assert single_step_release(acts, [(2, 9.0)]) == 0.0


# ---- ZeRO-3: prefetched gathers -----------------------------------------------------------------
def test_prefetched_gathers_hide_all_but_the_first_unit_behind_compute():
    """4 units, 0.4 s of gathers: with 1.2 s of compute beside them only the first unit's 0.1 s shows; with
    0.2 s of compute the gathers bind and 0.4 - 0.2 · 3/4 = 0.25 s shows; none to gather, none shown."""
    from autopar.cost_models.zero3 import exposed_gather

    assert exposed_gather(0.4, 1.2, 4) == pytest.approx(0.1)
    assert exposed_gather(0.4, 0.2, 4) == pytest.approx(0.25)
    assert exposed_gather(0.0, 1.0, 4) == 0.0
    assert exposed_gather(0.4, 5.0, 1) == pytest.approx(0.4)  # one unit: nothing to overlap with


def test_group_charge_bounds_the_stage_formula_less_the_first_unit():
    """A column with 0.3 s of gathers and 0.6 s of compute per microbatch (forward 0.2, backward 0.4) shows
    0.1 s in forward, none in backward. Summed over groups the charge is never below the stage's exposed
    gathers less g/U per direction (``cost_models.zero3``: the per-group bound), on random groups."""
    import numpy as np

    from autopar.cost_models.zero3 import exposed_gather, group_exposed

    assert group_exposed(0.3, 0.6) == pytest.approx(0.1)
    assert group_exposed(np.array([0.3, 1.0]), np.array([0.6, 0.0])) == pytest.approx([0.1, 2.0])
    rng = np.random.default_rng(0)
    for _ in range(200):
        g, c = rng.exponential(1.0, 6), rng.exponential(1.0, 6) * rng.choice([0.1, 1.0, 10.0])
        other = rng.exponential(1.0)  # compute of groups without level-3 parameters
        units = int(rng.integers(1, 20))
        stage = c.sum() + other
        exact = exposed_gather(g.sum(), stage / 3, units) + exposed_gather(g.sum(), 2 * stage / 3, units)
        assert group_exposed(g, c).sum() >= exact - 2 * g.sum() / units - 1e-12


def test_charge_zero3_adds_each_direction_exposed_part_at_the_gather_dtype():
    """Gradient all-reduce 0.8 s, every synced element at level 3, 4 units: g = 0.8 / 2 = 0.4 s per direction
    in fp32; forward 1.2 s hides all but 0.1, backward 0.2 s leaves 0.25. Gathered in bf16 (scale 1/2),
    g = 0.2: forward and backward each show one unit's 0.05 s. Memory adds the units held at once."""
    from autopar.plan import Stage
    from autopar.planner.plan_builder import charge_zero3

    def stage(scale):
        predicted = {"forward": 1.2, "backward": 0.2, "latency": 1.4, "grad_sync": 0.8, "zero3_share": 1.0,
                     "zero3_units": 4.0, "zero3_gather_scale": scale, "zero3_transient": 64.0, "memory": 100.0,
                     "peak_memory": 100.0}
        s = Stage(index=0, ranks=[0], mesh_shape=(1, 1), submesh=(1, 1), nodes=[], shardings={}, predicted=predicted)
        charge_zero3(s)
        return s.predicted

    fp32, bf16 = stage(1.0), stage(0.5)
    assert fp32["zero3_gather"] == pytest.approx(0.4) and bf16["zero3_gather"] == pytest.approx(0.2)
    assert (fp32["forward"], fp32["backward"]) == pytest.approx((1.3, 0.45))
    assert fp32["latency"] == pytest.approx(1.4 + 0.35) and fp32["zero3_exposed"] == pytest.approx(0.35)
    assert (bf16["forward"], bf16["backward"]) == pytest.approx((1.25, 0.25))
    assert fp32["memory"] == fp32["peak_memory"] == 164.0


# ---- the pipeline runtime's host time per (chunk, microbatch) ------------------------------------
def _stages(n: int, forward: float, backward: float) -> list[Stage]:
    p = {"forward": forward, "backward": backward, "latency": forward + backward, "grad_sync": 0.0,
         "compute": 0.0, "comm": 0.0, "peak_memory": 0.0}
    return [Stage(index=s, ranks=[s], mesh_shape=(1, 1), submesh=(1, 1), nodes=[], shardings={}, predicted=dict(p))
            for s in range(n)]


def _step(stages, microbatches: int, c: float, schedule: str = "1f1b", virtual: int = 1) -> float:
    cluster = dataclasses.replace(Cluster.local(1), microbatch_overhead=c)
    charge_microbatch_overhead(stages, cluster, microbatches)
    return predict(stages, microbatches, schedule, [], virtual)["step_time"]


@pytest.mark.parametrize("m", [2, 4, 8])
def test_microbatch_overhead_adds_2c_per_microbatch_and_stage_of_the_1f1b_fill(m):
    """2 uniform stages (f = 1, b = 2 ms), 1F1B: makespan (M + 1)(f + b), and with c on every forward and
    backward (M + 1)(f + b + 2c), so the step grows by exactly 2c·(M + pp − 1)."""
    c = 1e-4
    plain, charged = _step(_stages(2, 1e-3, 2e-3), m, 0.0), _step(_stages(2, 1e-3, 2e-3), m, c)
    assert plain == pytest.approx((m + 1) * 3e-3)
    assert charged - plain == pytest.approx(2 * c * (m + 1))


@pytest.mark.parametrize("m", [2, 4, 8])
def test_interleaving_v_chunks_pays_v_times_the_charges(m):
    """The same 2 devices as 4 chunks (v = 2) of half the time each: every chunk pays c per microbatch and
    direction, so the makespan grows by 2c·(M·v + pp − 1), against 1F1B's 2c·(M + pp − 1)."""
    c, pp, v = 1e-4, 2, 2
    plain = _step(_stages(pp * v, 0.5e-3, 1e-3), m, 0.0, "interleaved", v)
    charged = _step(_stages(pp * v, 0.5e-3, 1e-3), m, c, "interleaved", v)
    assert charged - plain == pytest.approx(2 * c * (m * v + pp - 1))


def test_without_microbatch_overhead_or_pipeline_nothing_is_charged():
    """c = 0 (presets, old cluster files) leaves the prediction and the stages' keys as they were; one stage
    at one microbatch runs without the pipeline runtime, so no c either; charging twice charges once."""
    stages = _stages(2, 1e-3, 2e-3)
    before = predict(stages, 4, "1f1b", [])["step_time"]
    assert _step(stages, 4, 0.0) == before and "microbatch_overhead" not in stages[0].predicted
    single = _stages(1, 1e-3, 2e-3)
    assert _step(single, 1, 1e-4) == pytest.approx(3e-3) and single[0].predicted["forward"] == 1e-3
    again = _stages(2, 1e-3, 2e-3)
    assert _step(again, 4, 1e-4) == _step(again, 4, 1e-4) == pytest.approx(before + 2e-4 * 5)
    assert _step(again, 4, 0.0) == pytest.approx(before) and again[0].predicted["forward"] == pytest.approx(1e-3)


def test_stage_dp_cost_grows_by_2c_per_stage_and_microbatch():
    """Every table entry carrying 2c (``stage_dp``'s docstring) adds 2c·(σ + B − 1) to T for σ stages."""
    rng = np.random.default_rng(0)
    table = rng.uniform(1, 2, size=(4, 4, 1, 4))
    table[np.tril_indices(4, -1)] = np.inf
    for B in (1, 4, 8):
        plain = stage_dp(table, [1], 2, B, stages=2)
        charged = stage_dp(table + 0.25, [1], 2, B, stages=2)
        assert charged.stages == plain.stages
        assert charged.cost == pytest.approx(plain.cost + 0.25 * (2 + B - 1))
