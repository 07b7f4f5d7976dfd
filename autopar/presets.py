"""Cluster presets: plain functions returning a frozen ``Cluster``; every constant cites its source.

GPU figures are vendor datasheet peaks; ``matmul_efficiency`` turns a peak into what large GEMMs reach.
The communication latencies are typical measured per-collective start-up costs (NCCL over NVLink/IB:
a few µs; TCP at 25 Gbps: tens of µs), not datasheet values; `autopar profile` replaces all of these with
fits measured on the cluster itself.
"""
from __future__ import annotations

import os

from autopar.cluster import Cluster, Link
from autopar.errors import ClusterError

GB = 1e9
GiB = 2**30
TFLOPS = 1e12


def p3_16xlarge(nodes: int = 1, mesh_shape=None) -> Cluster:
    """AWS p3.16xlarge: 8× V100-SXM2-16GB per node, NVLink inside, 25 Gbps Ethernet between nodes.

    Sources: AWS EC2 P3 instance page (8× V100 16 GB, NVLink, 25 Gbps networking for p3.16xlarge);
    NVIDIA Tesla V100 datasheet (SXM2: 125 TFLOPS tensor fp16, 15.7 TFLOPS fp32, 900 GB/s HBM2,
    NVLink 300 GB/s aggregate = 6 links × 25 GB/s per direction × 2). This is the cluster of Alpa's
    evaluation (Zheng et al., OSDI'22, §8: "8 V100 per node, 25 Gbps between nodes").
    """
    return Cluster(
        name="p3.16xlarge",
        nodes=nodes,
        devices_per_node=8,
        peak_flops={"float16": 125 * TFLOPS, "bfloat16": 125 * TFLOPS, "float32": 15.7 * TFLOPS},
        # cuBLAS fp16 GEMMs on V100 reach ~70-80 % of the tensor-core peak at large sizes (NVIDIA DL
        # performance guide); Megatron-LM reports ~30-50 % end to end, the rest being non-GEMM work.
        matmul_efficiency=0.7,
        memory_bandwidth=900 * GB,
        memory_per_device=16 * GiB,
        # The hybrid cube-mesh gives each V100 ~150 GB/s of its 300 GB/s NVLink in one ring direction.
        intra_node=Link(latency=8e-6, bandwidth=150 * GB),
        inter_node=Link(latency=40e-6, bandwidth=25e9 / 8),  # 25 Gbps per node
        mesh_shape=mesh_shape,
        backend="nccl",
        device_type="cuda",
        source="AWS EC2 P3 page; NVIDIA V100 SXM2 datasheet",
    )


def dgx_a100(nodes: int = 1, mesh_shape=None) -> Cluster:
    """NVIDIA DGX A100 (640 GB): 8× A100-SXM4-80GB, NVSwitch inside, 8× 200 Gb/s HDR InfiniBand out.

    Sources: NVIDIA DGX A100 datasheet (8× A100 80 GB, 600 GB/s NVLink per GPU via NVSwitch,
    8× ConnectX-6 200 Gb/s = 1.6 Tb/s compute network); NVIDIA A100 datasheet (312 TFLOPS bf16/fp16
    dense, 19.5 TFLOPS fp32, 2039 GB/s HBM2e on the 80 GB SXM part).
    """
    return Cluster(
        name="dgx-a100",
        nodes=nodes,
        devices_per_node=8,
        peak_flops={"float16": 312 * TFLOPS, "bfloat16": 312 * TFLOPS, "float32": 19.5 * TFLOPS},
        matmul_efficiency=0.7,  # large bf16 GEMMs on A100 reach ~70-80 % of peak (NVIDIA DL perf guide)
        memory_bandwidth=2039 * GB,
        memory_per_device=80 * GiB,
        intra_node=Link(latency=5e-6, bandwidth=300 * GB),  # 600 GB/s bidirectional -> 300 GB/s each way
        inter_node=Link(latency=6e-6, bandwidth=8 * 200e9 / 8),  # 8 × 200 Gb/s HDR per node
        mesh_shape=mesh_shape,
        backend="nccl",
        device_type="cuda",
        source="NVIDIA DGX A100 and A100 datasheets",
    )


def dgx_h100(nodes: int = 1, mesh_shape=None) -> Cluster:
    """NVIDIA DGX H100: 8× H100-SXM5-80GB, NVLink 4 via NVSwitch, 8× 400 Gb/s NDR InfiniBand out.

    Sources: NVIDIA DGX H100 datasheet (8× H100 80 GB, 900 GB/s NVLink per GPU, 8× ConnectX-7
    400 Gb/s); NVIDIA H100 datasheet (SXM5: 989 TFLOPS bf16/fp16 dense, 67 TFLOPS fp32, 3.35 TB/s HBM3).
    """
    return Cluster(
        name="dgx-h100",
        nodes=nodes,
        devices_per_node=8,
        peak_flops={"float16": 989 * TFLOPS, "bfloat16": 989 * TFLOPS, "float32": 67 * TFLOPS},
        matmul_efficiency=0.7,  # same ceiling as A100; H100 GEMMs reach ~70 % of dense peak in practice
        memory_bandwidth=3350 * GB,
        memory_per_device=80 * GiB,
        intra_node=Link(latency=5e-6, bandwidth=450 * GB),  # 900 GB/s bidirectional -> 450 GB/s each way
        inter_node=Link(latency=5e-6, bandwidth=8 * 400e9 / 8),  # 8 × 400 Gb/s NDR per node
        mesh_shape=mesh_shape,
        backend="nccl",
        device_type="cuda",
        source="NVIDIA DGX H100 and H100 datasheets",
    )


PRESETS = {"p3.16xlarge": p3_16xlarge, "dgx-a100": dgx_a100, "dgx-h100": dgx_h100}


def preset(name: str, nodes: int = 1, mesh_shape=None) -> Cluster:
    """Look a preset up by name; the error lists the known names."""
    if name not in PRESETS:
        raise ClusterError(f"unknown cluster preset {name!r}; known presets: {sorted(PRESETS)} "
                           f"(or load a measured cluster with Cluster.from_json)")
    if not isinstance(nodes, int) or nodes < 1:
        raise ClusterError(f"preset {name!r}: nodes must be a positive integer, got {nodes!r}")
    return PRESETS[name](nodes=nodes, mesh_shape=mesh_shape)


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
# Divided by the core share below, like the rates. benchmarks/profile_extras.py measures it for a
# profiled cluster.
_CPU_OP_OVERHEAD = 18e-6


def local_cpu(n: int, mesh_shape=None, memory_per_device: float | None = None) -> Cluster:
    """This machine as ``n`` CPU ranks over gloo; compute shares the cores when n exceeds them."""
    if not isinstance(n, int) or n < 1:
        raise ClusterError(f"Cluster.local(n): n must be a positive integer, got {n!r}")
    cores = os.cpu_count() or 1
    share = min(1.0, cores / n)
    if memory_per_device is None:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 8 * GiB
        memory_per_device = 0.8 * total / n
    link = Link(latency=_GLOO_LATENCY, bandwidth=_GLOO_BANDWIDTH)
    return Cluster(
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
