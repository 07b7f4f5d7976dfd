"""Cluster presets: plain functions returning a cluster's fields (``Cluster(**fields)``, which
``Cluster.preset`` and ``Cluster.local`` build); every constant cites its source. Data only: this module
imports ``hardware.links`` for the link classes, never ``hardware.cluster``, which imports it.

GPU figures: vendor datasheet peaks, a matmul curve by call size built from the best measured GEMM
fraction (``gemm_curve``), the achieved share of HBM bandwidth, usable memory (capacity less context and
allocator reserve), intra-node bandwidth by group size where the topology makes it differ, and a per-step
collective latency for ring/tree algorithms. The communication latencies are typical measured per-collective
start-up costs (NCCL over NVLink/IB: a few µs; TCP at 25 Gbps: tens of µs), not datasheet values; `autopar
profile` replaces all of these with fits measured on the cluster itself.
"""
from __future__ import annotations

import os
from typing import Any

from autopar.errors import ClusterError
from autopar.hardware.links import Link

ClusterFields = dict[str, Any]  # keyword arguments of Cluster

GB = 1e9
GiB = 2**30
TFLOPS = 1e12

# End-to-end factor on compute time per GPU type (Cluster.compute_time_scale), fitted by
# `benchmarks/calibration/calibration.py --fit` on its "fit" rows only: s = s · geometric mean of
# (predicted / published throughput), two rounds, each row priced with the gradient sync, ZeRO-3 gathers and
# recompute its run used (benchmarks/calibration/published_schedule.py). V100: Megatron-LM's five runs on
# p3.16xlarge from Alpa's OSDI'22 artifact (ratios after the fit 0.94-1.07; Alpa's six hold-out plans
# 0.96-1.08); A100: Megatron-LM SC'21 Table 1's 1.7B@32 and 3.6B@64 (0.99, 1.01; hold-out 7.5B, 18B, 39B:
# 1.05, 1.07, 1.04).
# H100 at 500 W with HBM2e (grand_teton_h100): torchtitan's Llama 3.1 8B FSDP run on 8 GPUs (Table 1 of its
# llama3_h100_202412 benchmark; hold-out: the same on 128 GPUs, Table 3, 1.02 after the fit). 1.43 (1.60
# before the measured kernel rates) is large: it holds what the roofline does not see on that part and run, and
# the calibration cannot apportion it: the
# 500 W limit (the source's footnote: the peak lies between the SXM's and the NVL's), eager execution (the
# same table's torch.compile run is 1.16x faster) and FSDP2's copy-in/out around every gather. The hold-out
# shares the fit row's model and local batch, so it checks the scale-out, not the compute factor.
# DGX H100 (700 W, HBM3): no published run is predicted, so 1.0 (not calibrated; the 500 W part's factor is
# not carried over).
# Refitted once the presets priced norms and activations at their measured rate
# (NORM_ACT_FRACTION), H100 flash attention at its measured share (H100_ATTENTION_EFFICIENCY), and the
# calibration priced Megatron's and Alpa's fused scale-mask-softmax: V100 0.956 -> 0.938, A100 1.082 -> 1.077,
# H100 at 500 W 1.602 -> 1.433 (a tenth of that part's unexplained factor was its slow attention and norms).
P3_COMPUTE_TIME_SCALE = 0.938
A100_COMPUTE_TIME_SCALE = 1.077
H100_COMPUTE_TIME_SCALE = 1.0
H100_500W_COMPUTE_TIME_SCALE = 1.433


# ---- compute -----------------------------------------------------------------------------------------
# A matmul call of f FLOPs takes GEMM_RAMP + f / plateau seconds: a fixed cost per call (launch, the
# partial last wave of thread blocks) plus the large-size rate. So the rate rises with size and saturates:
#     rate(f) = plateau · f / (f + plateau · GEMM_RAMP)
# plateau = peak × the best measured large-GEMM fraction (MAMF: stas00/ml-engineering, compute/accelerator
# README, "Maximum Achievable Matmul FLOPS comparison table", bf16: A100 SXM 267.9 of 312 TFLOPS = 85.9 %,
# H100 SXM 792.1 of 989 = 80.1 %). V100 is not in that table: 0.80 is an estimate, and the preset's
# calibrated compute_time_scale absorbs its error. GEMM_RAMP = 5 µs: a kernel launch is 3-5 µs, and a
# 4096×4096 tile grid on 108 SMs leaves a tail wave of that order; an estimate, not a measurement.
GEMM_RAMP = 5e-6
CURVE_FLOPS = [10.0 ** (e / 2) for e in range(12, 29)]  # 1e6 ... 1e14 FLOPs per call, two points a decade


def gemm_curve(plateau: float, ramp: float = GEMM_RAMP) -> list[list[float]]:
    """[[flops per call, FLOP/s], ...] of the saturating curve above."""
    return [[f, plateau * f / (f + plateau * ramp)] for f in CURVE_FLOPS]


def gemm_curves(peak: dict[str, float], fraction: dict[str, float]) -> dict[str, list[list[float]]]:
    return {dtype: gemm_curve(peak[dtype] * fraction[dtype]) for dtype in peak}


# ---- memory ------------------------------------------------------------------------------------------
# Streaming kernels reach ~85-90 % of HBM peak (BabelStream, Deakin et al., "Evaluating attainable memory
# bandwidth of parallel programming models via BabelStream", 2018, and later GPU runs: V100 ~ 0.85-0.9,
# A100 / H100 ~ 0.85-0.9 of datasheet). Elementwise training ops are priced at this fraction.
STREAM_FRACTION = 0.85
# Norms, activations and softmaxes (Cluster.norm_act_bandwidth) stream well below a copy: they reduce over
# rows, evaluate transcendentals and run several kernels per op. Measured on the lent H100 SXM5 (HBM3,
# 3.35 TB/s) with the profiler's own calls (profiler_training item 6: forward + backward on
# 16384 × 2048 bf16, bytes as the cost model counts them): LayerNorm with its weight and bias gradients 1079,
# GELU 2724, softmax 1598 GB/s; the profiler's figure is their median, 1598 GB/s = 0.477 of the HBM peak
# (benchmarks/results/small_models_2026-11-26.md). No other GPU has been measured: its preset takes the same
# fraction of its own HBM peak (a derived figure; these kernels are bandwidth-bound on every generation, and
# `autopar profile` measures the real one).
NORM_ACT_FRACTION = 1598 / 3350
# Flash attention's rate as a share of the matmul curve's (Cluster.attention_efficiency), H100: the
# profiler's call (item 7: causal SDPA forward + backward on 8 × 16 × 2048 × 128 bf16) on the same H100 took
# 1.27 ms, 324 TFLOP/s on its causal FLOPs against the 792 TFLOP/s of the curve: 0.41 (FlashAttention-2 is
# not tuned for Hopper: Shah et al. 2024, FlashAttention-3, §1: "only 35 % of the H100's peak"). Other GPUs
# keep the default (cost_models.compute.ATTENTION_RATE: FlashAttention-2's own A100 figures).
H100_ATTENTION_EFFICIENCY = 0.41
# Usable device memory = (capacity - CUDA context and NCCL buffers) × (1 - allocator reserve).
# Capacity: what the driver exposes (nvidia-smi "Total": V100-SXM2-16GB 16160 MiB, A100-SXM4-80GB 81920 MiB,
# H100-SXM5-80GB 81559 MiB). Context: the CUDA context with lazy module loading is 0.3-0.5 GiB, and each
# NCCL communicator holds channel buffers (NCCL_BUFFSIZE 4 MiB per channel and peer): 1 GiB for both is an
# estimate for dp × tp × pp groups. Reserve: the caching allocator's rounding and fragmentation, 5 % (PyTorch
# "CUDA semantics: memory management"; plans that fill 99 % of the nominal 80 GiB do not run).
NCCL_BUFFERS = 2**29  # 0.5 GiB of the estimate below: what a profile cannot see before training builds its groups
CUDA_CONTEXT = 2**29 + NCCL_BUFFERS
ALLOCATOR_RESERVE = 0.05
MiB = 2**20


def usable_memory(capacity: float, context: float = CUDA_CONTEXT, reserve: float = ALLOCATOR_RESERVE) -> float:
    """Bytes of device memory a plan may fill: (capacity - context) × (1 - reserve)."""
    return (capacity - context) * (1.0 - reserve)


def p3_16xlarge(nodes: int = 1, mesh_shape=None) -> ClusterFields:
    """AWS p3.16xlarge: 8× V100-SXM2-16GB per node in a hybrid cube-mesh of NVLink 2, 25 Gbps Ethernet out.

    Sources: AWS EC2 P3 instance page (8× V100 16 GB, NVLink, 25 Gbps networking for p3.16xlarge);
    NVIDIA Tesla V100 datasheet (SXM2: 125 TFLOPS tensor fp16, 15.7 TFLOPS fp32, 900 GB/s HBM2; no bf16);
    NVIDIA DGX-1 with Tesla V100 system architecture whitepaper (hybrid cube-mesh: six NVLinks per GPU at
    25 GB/s per direction; a GPU pair is joined by one or two links, and `nvidia-smi topo -m` on a
    p3.16xlarge shows NV1 between GPUs 0 and 1). The cluster of Alpa's evaluation (Zheng et al., OSDI'22).
    Group bandwidth per device, per direction: a pair of consecutive GPUs gets its one link (25 GB/s; the
    pairs with two links wait for it in lockstep); a quad rings over two links per hop (50 GB/s); all eight
    ring over the six links in NCCL's three rings at ~85 % (130 GB/s, derived from the link counts).
    """
    peak = {"float16": 125 * TFLOPS, "float32": 15.7 * TFLOPS}
    return dict(
        name="p3.16xlarge", nodes=nodes, devices_per_node=8, peak_flops=peak,
        matmul_efficiency=0.8, matmul_curve=gemm_curves(peak, {"float16": 0.80, "float32": 0.90}),
        memory_bandwidth=900 * GB * STREAM_FRACTION, norm_act_bandwidth=900 * GB * NORM_ACT_FRACTION,
        memory_capacity=16160 * MiB, memory_per_device=usable_memory(16160 * MiB),
        intra_node=Link(latency=8e-6, bandwidth=130 * GB, group_bandwidth={"2": 25 * GB, "4": 50 * GB, "8": 130 * GB},
                        hop_latency=1.5e-6),  # NCCL's per-step latency over NVLink: ~1-2 µs (NCCL tuning tables)
        inter_node=Link(latency=40e-6, bandwidth=25e9 / 8, hop_latency=20e-6),  # 25 Gbps per node; TCP sockets
        mesh_shape=mesh_shape, backend="nccl", device_type="cuda", compute_time_scale=P3_COMPUTE_TIME_SCALE,
        source="AWS EC2 P3 page; NVIDIA V100 SXM2 datasheet; DGX-1 V100 whitepaper (cube-mesh); stas00 MAMF; "
               "calibrated compute_time_scale (benchmarks/calibration)",
    )


def dgx_a100(nodes: int = 1, mesh_shape=None) -> ClusterFields:
    """NVIDIA DGX A100 (640 GB): 8× A100-SXM4-80GB on NVSwitch, 8× 200 Gb/s HDR InfiniBand out.

    Sources: NVIDIA DGX A100 datasheet (8× A100 80 GB, 600 GB/s NVLink per GPU via NVSwitch, 8× ConnectX-6
    200 Gb/s); NVIDIA A100 datasheet (312 TFLOPS bf16/fp16 dense, 19.5 TFLOPS fp32, 2039 GB/s HBM2e).
    NVSwitch gives every group the same per-GPU bandwidth: 300 GB/s per direction, of which NCCL's
    all-reduce reaches ~230-240 GB/s bus bandwidth on 8 GPUs (nccl-tests figures NVIDIA publishes for DGX
    A100): 0.8 × 300. Inter-node: 8 × 200 Gb/s per node at ~90 % (IB HDR line rate less encoding/headers).
    """
    peak = {"float16": 312 * TFLOPS, "bfloat16": 312 * TFLOPS, "float32": 19.5 * TFLOPS}
    return dict(
        name="dgx-a100", nodes=nodes, devices_per_node=8, peak_flops=peak,
        matmul_efficiency=0.859,
        matmul_curve=gemm_curves(peak, {"float16": 0.859, "bfloat16": 0.859, "float32": 0.90}),
        memory_bandwidth=2039 * GB * STREAM_FRACTION, norm_act_bandwidth=2039 * GB * NORM_ACT_FRACTION,
        memory_capacity=81920 * MiB, memory_per_device=usable_memory(81920 * MiB),
        intra_node=Link(latency=5e-6, bandwidth=0.8 * 300 * GB, hop_latency=1e-6),
        inter_node=Link(latency=6e-6, bandwidth=0.9 * 8 * 200e9 / 8, hop_latency=3e-6),
        mesh_shape=mesh_shape, backend="nccl", device_type="cuda", compute_time_scale=A100_COMPUTE_TIME_SCALE,
        source="NVIDIA DGX A100 and A100 datasheets; nccl-tests DGX A100; stas00 MAMF; "
               "calibrated compute_time_scale (benchmarks/calibration)",
    )


def dgx_h100(nodes: int = 1, mesh_shape=None) -> ClusterFields:
    """NVIDIA DGX H100: 8× H100-SXM5-80GB on NVLink 4 / NVSwitch, 8× 400 Gb/s NDR InfiniBand out.

    Sources: NVIDIA DGX H100 datasheet (8× H100 80 GB, 900 GB/s NVLink per GPU, 8× ConnectX-7 400 Gb/s);
    NVIDIA H100 datasheet (SXM5: 989 TFLOPS bf16/fp16 dense, 67 TFLOPS fp32, 3.35 TB/s HBM3). NVLink:
    450 GB/s per direction, NCCL all-reduce bus bandwidth ~360 GB/s on 8 GPUs without NVLS (0.8 × 450).
    """
    peak = {"float16": 989 * TFLOPS, "bfloat16": 989 * TFLOPS, "float32": 67 * TFLOPS}
    return dict(
        name="dgx-h100", nodes=nodes, devices_per_node=8, peak_flops=peak,
        matmul_efficiency=0.801,
        matmul_curve=gemm_curves(peak, {"float16": 0.801, "bfloat16": 0.801, "float32": 0.90}),
        memory_bandwidth=3350 * GB * STREAM_FRACTION, norm_act_bandwidth=3350 * GB * NORM_ACT_FRACTION,
        attention_efficiency=H100_ATTENTION_EFFICIENCY,
        memory_capacity=81559 * MiB, memory_per_device=usable_memory(81559 * MiB),
        intra_node=Link(latency=5e-6, bandwidth=0.8 * 450 * GB, hop_latency=1e-6),
        inter_node=Link(latency=5e-6, bandwidth=0.9 * 8 * 400e9 / 8, hop_latency=3e-6),
        mesh_shape=mesh_shape, backend="nccl", device_type="cuda", compute_time_scale=H100_COMPUTE_TIME_SCALE,
        source="NVIDIA DGX H100 and H100 datasheets; stas00 MAMF; calibrated compute_time_scale "
               "(benchmarks/calibration)",
    )


# H100 96 GB HBM2e (the Grand Teton hosts of torchtitan's published runs): the same die as the H100 SXM5 at a
# 500 W power limit, with HBM2e at 2.4 TB/s instead of HBM3 at 3.35 TB/s. Exposed memory: 96 GiB less the same
# 361 MiB the 80 GB part's driver keeps (81920 - 81559 MiB), an estimate.
H100_96GB_EXPOSED = 96 * 1024 * MiB - 361 * MiB


def grand_teton_h100(nodes: int = 1, mesh_shape=None) -> ClusterFields:
    """Meta's Grand Teton: 8× H100 96 GB HBM2e per host, fully connected with NVLink, 400 Gb/s RDMA per GPU.

    Source: pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, "Hardware" (8 H100 per host fully
    connected with NVLink; 96 GB HBM2e, 2.4 TB/s; 400 Gb/s per GPU backend network; default 500 W power limit)
    and its footnote 2 (peak between the SXM's and the NVL's, exact value unknown: the SXM's 989 TFLOPS is
    kept, as that file's MFU does). Links as ``dgx_h100`` (NVLink 4 through NVSwitch; 8 × 400 Gb/s per host).
    The 500 W limit's lower clocks and everything else a roofline misses are in the calibrated
    compute_time_scale (``H100_500W_COMPUTE_TIME_SCALE``).
    """
    return dict(
        dgx_h100(nodes, mesh_shape), name="grand-teton-h100", memory_bandwidth=2400 * GB * STREAM_FRACTION,
        norm_act_bandwidth=2400 * GB * NORM_ACT_FRACTION,
        memory_capacity=H100_96GB_EXPOSED, memory_per_device=usable_memory(H100_96GB_EXPOSED),
        compute_time_scale=H100_500W_COMPUTE_TIME_SCALE,
        source="torchtitan llama3_h100_202412 Hardware (Grand Teton: H100 96 GB HBM2e, 500 W); NVIDIA H100 "
               "datasheet; stas00 MAMF; calibrated compute_time_scale (benchmarks/calibration)")


# A100-SXM4-40GB (p4d): nvidia-smi "Total" 40960 MiB. L4: 23034 MiB (nvidia-smi on GCP g2 instances; the
# 24 GB GDDR6 less the ECC and driver reservation).
A100_40GB_EXPOSED = 40960 * MiB
L4_EXPOSED = 23034 * MiB


def p4d_a100_40gb(nodes: int = 1, mesh_shape=None) -> ClusterFields:
    """AWS p4d.24xlarge: 8× A100-SXM4-40GB on NVSwitch, 4× 100 Gbps EFA out (400 Gbps per node).

    Sources: AWS EC2 P4 instance page (p4d.24xlarge: 8× A100 40 GB, 600 GB/s NVSwitch, 400 Gbps EFA);
    NVIDIA A100 datasheet (SXM4 40 GB: 312 TFLOPS bf16/fp16 dense, 19.5 TFLOPS fp32, 1555 GB/s HBM2).
    NVLink as ``dgx_a100`` (same NVSwitch generation). EFA: 0.8 of line rate is an estimate (libfabric's
    SRD transport reaches less of the line than InfiniBand's 0.9). Compute factor as the 80 GB part (same die
    and clocks; not calibrated on this part). The hardware of Mist's A100 runs (Zhu et al., EuroSys'25).
    """
    return dict(
        dgx_a100(nodes, mesh_shape), name="a100-40gb", memory_bandwidth=1555 * GB * STREAM_FRACTION,
        norm_act_bandwidth=1555 * GB * NORM_ACT_FRACTION,
        memory_capacity=A100_40GB_EXPOSED, memory_per_device=usable_memory(A100_40GB_EXPOSED),
        inter_node=Link(latency=15e-6, bandwidth=0.8 * 400e9 / 8, hop_latency=8e-6),
        source="AWS EC2 P4 page (p4d.24xlarge); NVIDIA A100 datasheet (40 GB HBM2); EFA efficiency estimated")


def gcp_g2_l4(nodes: int = 1, mesh_shape=None) -> ClusterFields:
    """GCP g2-standard-96: 8× NVIDIA L4 (24 GB GDDR6) on PCIe Gen4, no NVLink; 100 Gbps per VM.

    Sources: NVIDIA L4 datasheet (242 TFLOPS fp16/bf16 tensor *with sparsity* -> 121 dense; 30.3 TFLOPS fp32;
    24 GB GDDR6 at 300 GB/s; PCIe Gen4 x16, 64 GB/s both directions -> 32 GB/s one way; 72 W); Google Cloud
    "GPU machine types" page (g2-standard-96: 8 L4; 100 Gbps default network bandwidth). Between GPUs every
    byte crosses PCIe through the host's root complexes: 0.5 of the 32 GB/s one-way line is an estimate for
    NCCL's ring over PCIe without NVLink (host bridges, no switch peer-to-peer). Matmul fraction 0.7: an
    estimate (the 72 W cap lowers clocks under sustained tensor load); `autopar profile` measures it. The
    hardware of Mist's L4 runs (Zhu et al., EuroSys'25).
    """
    peak = {"float16": 121 * TFLOPS, "bfloat16": 121 * TFLOPS, "float32": 30.3 * TFLOPS}
    return dict(
        name="l4", nodes=nodes, devices_per_node=8, peak_flops=peak,
        matmul_efficiency=0.7, matmul_curve=gemm_curves(peak, {"float16": 0.7, "bfloat16": 0.7, "float32": 0.8}),
        memory_bandwidth=300 * GB * STREAM_FRACTION, norm_act_bandwidth=300 * GB * NORM_ACT_FRACTION,
        memory_capacity=L4_EXPOSED, memory_per_device=usable_memory(L4_EXPOSED),
        intra_node=Link(latency=10e-6, bandwidth=0.5 * 32 * GB, hop_latency=3e-6),
        inter_node=Link(latency=30e-6, bandwidth=100e9 / 8, hop_latency=15e-6),  # gVNIC TCP at 100 Gbps
        mesh_shape=mesh_shape, backend="nccl", device_type="cuda",
        source="NVIDIA L4 datasheet; GCP GPU machine types (g2-standard-96); PCIe and matmul fractions estimated")


PRESETS = {"p3.16xlarge": p3_16xlarge, "dgx-a100": dgx_a100, "dgx-h100": dgx_h100,
           "grand-teton-h100": grand_teton_h100, "a100-40gb": p4d_a100_40gb, "l4": gcp_g2_l4}


def preset(name: str, nodes: int = 1, mesh_shape=None) -> ClusterFields:
    """Look a preset up by name; the error lists the known names."""
    if name not in PRESETS:
        raise ClusterError(f"unknown cluster preset {name!r}; known presets: {sorted(PRESETS)} "
                           f"(or load a measured cluster with Cluster.from_json)")
    if not isinstance(nodes, int) or nodes < 1:
        raise ClusterError(f"preset {name!r}: nodes must be a positive integer, got {nodes!r}")
    return PRESETS[name](nodes=nodes, mesh_shape=mesh_shape)


def preset_gpus(name: str, gpus: int) -> ClusterFields:
    """``gpus`` devices of preset ``name``: whole nodes (gpus a multiple of the node size), or part of one node
    (a node of ``gpus`` devices, same links), as benchmarks quote runs on 1, 2 or 4 GPUs of a machine."""
    per_node = preset(name)["devices_per_node"]
    if not isinstance(gpus, int) or gpus < 1 or (gpus > per_node and gpus % per_node):
        raise ClusterError(f"preset {name!r}: {gpus!r} GPUs is neither part of one {per_node}-GPU node nor whole "
                           f"nodes; use 1..{per_node} or a multiple of {per_node}")
    if gpus < per_node:
        return dict(preset(name), devices_per_node=gpus, mesh_shape=None)
    return preset(name, nodes=gpus // per_node)


# Measured on the development machine (2-core AMD EPYC VM, torch 2.13 CPU, one thread per rank):
# fp32 GEMM 1024³ ≈ 75 GFLOP/s on one core; streaming add ≈ 3 GB/s; gloo collectives on
# loopback ≈ 0.2 ms start-up and ≈ 1 GB/s. Rough by design: `autopar profile` fits the real values.
_CPU_CORE_FLOPS = 75e9
_CPU_CORE_MEMBW = 3e9
_GLOO_LATENCY = 2e-4
_GLOO_BANDWIDTH = 1e9
# Host time per eager op call on a dedicated core (cost_models.compute charges it per node, forward and
# backward): GPTs with 8-wide tensors (kernels ~free; 1 and 4 layers, 31 and 94 graph nodes), forward +
# backward / (2 · nodes), one thread: 18-25 µs at load 4.5 and 27-31 µs at load 8 from other jobs
# (same VM as above); 4 ranks busy at once on the 2 cores: 42-82 µs per call at load 5.
# Divided by the core share below, like the rates. `autopar profile` measures it.
_CPU_OP_OVERHEAD = 18e-6


def local_cpu(n: int, mesh_shape=None, memory_per_device: float | None = None) -> ClusterFields:
    """This machine as ``n`` CPU ranks over gloo; compute shares the cores when n exceeds them."""
    if not isinstance(n, int) or n < 1:
        raise ClusterError(f"Cluster.local(n): n must be a positive integer, got {n!r}")
    cores = os.cpu_count() or 1
    share = min(1.0, cores / n)
    if memory_per_device is None:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 8 * GiB
        memory_per_device = 0.8 * total / n
    link = Link(latency=_GLOO_LATENCY, bandwidth=_GLOO_BANDWIDTH)
    return dict(
        name=f"local-{n}",
        nodes=1,
        devices_per_node=n,
        peak_flops={"float32": _CPU_CORE_FLOPS * share, "float64": _CPU_CORE_FLOPS * share / 2},
        matmul_efficiency=1.0,  # the constant above is already a measured, achieved figure
        memory_bandwidth=_CPU_CORE_MEMBW * share,
        memory_per_device=float(memory_per_device),
        intra_node=link,
        inter_node=link,
        mesh_shape=tuple(mesh_shape) if mesh_shape is not None else (1, n),
        backend="gloo",
        device_type="cpu",
        source="local CPU defaults (rough; run `autopar profile` for measured values)",
        op_overhead=_CPU_OP_OVERHEAD / share,
    )
