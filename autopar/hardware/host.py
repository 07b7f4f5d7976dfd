"""Host side of a GPU node, for CPU offload: the host-device link and the host memory that steps an optimizer.

Per GPU (each rank's process has its own PCIe link and its share of the host's memory bandwidth):

    pcie:      bytes/s one way between a GPU and pinned host memory (cudaMemcpy of large pinned buffers
               reaches ~75-80 % of the PCIe line rate: NVIDIA's bandwidthTest sample on Gen3 x16 ~12 GB/s, on
               Gen4 x16 ~25 GB/s, on Gen5 x16 ~50 GB/s of the 16 / 32 / 64 GB/s line rates)
    host_bw:   bytes/s of host DRAM bandwidth one rank's optimizer step gets: the sockets' channels × DDR
               transfer rate × 8 bytes × 0.6 achieved (STREAM triad on two-socket servers reaches 60-70 % of
               the channel peak), divided among the node's GPUs

Sources for the hosts: AWS p3.16xlarge: two Xeon E5-2686 v4 (4 DDR4-2400 channels each); p4d.24xlarge: two
Xeon Platinum 8275CL (6 DDR4-2933 channels each); DGX A100: two EPYC 7742 (8 DDR4-3200 channels each); DGX
H100: two Xeon Platinum 8480C (8 DDR5-4800 channels each, PCIe Gen5); GCP g2-standard-96: two Cascade Lake
sockets (6 DDR4-2933 channels each assumed, an estimate; L4 on PCIe Gen4). These are estimates from the
parts' datasheets, not measurements; `autopar profile` does not measure them yet.
CPU ranks (``Cluster.local``): the "device" is host memory, so a copy runs at the cluster's memory bandwidth.
"""
from __future__ import annotations

import dataclasses

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Host:
    pcie: float      # bytes/s one way, per GPU
    host_bw: float   # bytes/s of host memory bandwidth per GPU's optimizer step


def _dram(sockets: int, channels: int, mts: float, gpus: int = 8) -> float:
    return sockets * channels * mts * 1e6 * 8 * 0.6 / gpus


HOSTS = {
    "p3.16xlarge": Host(pcie=12 * GB, host_bw=_dram(2, 4, 2400)),
    "a100-40gb": Host(pcie=25 * GB, host_bw=_dram(2, 6, 2933)),
    "dgx-a100": Host(pcie=25 * GB, host_bw=_dram(2, 8, 3200)),
    "dgx-h100": Host(pcie=50 * GB, host_bw=_dram(2, 8, 4800)),
    "grand-teton-h100": Host(pcie=50 * GB, host_bw=_dram(2, 8, 4800)),
    "l4": Host(pcie=25 * GB, host_bw=_dram(2, 6, 2933)),
}
DEFAULT_GPU_HOST = Host(pcie=25 * GB, host_bw=_dram(2, 8, 3200))  # a PCIe Gen4 server, as dgx-a100


def host_of(cluster) -> Host:
    """The host figures of ``cluster``: its preset's, else a Gen4 server; on CPU ranks the rank's own memory
    (copies at the memory bandwidth, the optimizer's passes at the rate the device step gets: one memory, so
    stepping "on the host" saves no time, whatever the profile measured)."""
    if getattr(cluster, "device_type", "cuda") == "cpu":
        return Host(pcie=cluster.memory_bandwidth,
                    host_bw=getattr(cluster, "optimizer_bandwidth", 0.0) or cluster.memory_bandwidth)
    return HOSTS.get(cluster.name, DEFAULT_GPU_HOST)
