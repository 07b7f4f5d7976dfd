"""Where the profiler's probes run and how they are timed: CPU ranks over gloo, or GPUs over NCCL.

``ProbeDevice.choose(kind, nprocs)`` picks "cuda" when asked for it or, with kind="auto", when this
machine has at least ``nprocs`` CUDA GPUs; else "cpu". On GPUs every rank binds GPU ``rank`` (one process
per GPU, as torchrun and ``autopar.launch`` start them), probes run on it, and a window of calls is timed
with CUDA events recorded on the current stream around it (kernel time, not launch time; the end event
is synchronized before reading). On CPUs a window is timed with ``time.perf_counter``: CPU ops are
synchronous. Gloo and NCCL collectives both run on the same tensors as the compute probes.
"""
from __future__ import annotations

import dataclasses
import os
import time

import torch

from autopar.errors import ClusterError
from autopar.runtime.devices import local_gpu_index

KINDS = ("auto", "cpu", "cuda")


@dataclasses.dataclass(frozen=True)
class ProbeDevice:
    kind: str  # "cpu" or "cuda"
    index: int = 0  # the GPU this rank probes on (after ``bind``)

    @staticmethod
    def choose(kind: str, nprocs: int) -> "ProbeDevice":
        if kind not in KINDS:
            raise ClusterError(f"profile: device must be one of {list(KINDS)}, got {kind!r}")
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if kind == "cuda" and gpus < nprocs:
            raise ClusterError(f"profile: device='cuda' needs {nprocs} GPUs (one per rank) but this machine has "
                               f"{gpus}; profile fewer ranks or use device='cpu'")
        if kind == "auto":
            kind = "cuda" if gpus >= nprocs else "cpu"
        return ProbeDevice(kind)

    @property
    def backend(self) -> str:
        return "nccl" if self.kind == "cuda" else "gloo"

    def bind(self, rank: int) -> "ProbeDevice":
        """This device for ``rank``: on GPUs, the rank's GPU (``runtime.devices.local_gpu_index``, the one
        ``autopar.launch`` made current), made current."""
        if self.kind != "cuda":
            return dataclasses.replace(self, index=rank)
        index = local_gpu_index(rank)
        torch.cuda.set_device(index)
        return dataclasses.replace(self, index=index)

    @property
    def torch(self) -> torch.device:
        return torch.device("cuda", self.index) if self.kind == "cuda" else torch.device("cpu")

    def window_seconds(self, call, calls: int) -> float:
        """Seconds that ``calls`` back-to-back calls take (device time on GPUs)."""
        if self.kind == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                call()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        begin = time.perf_counter()
        for _ in range(calls):
            call()
        return time.perf_counter() - begin

    def describe(self, n: int, threads: int) -> str:
        """Who was measured, for the cluster's ``source`` line."""
        if self.kind == "cuda":
            name = torch.cuda.get_device_name(0)
            return f"{n} NCCL ranks on {n}× {name}, one GPU per rank, timed with CUDA events"
        return f"{n} gloo ranks on {os.cpu_count()} cores, {threads} thread(s) per rank"

    def cluster_fields(self) -> dict:
        """Fields that differ from ``Cluster.local``'s CPU description on this device kind. GPU memory: the
        usable figure of ``presets.usable_memory``, with the context measured (total - free once it exists)."""
        if self.kind != "cuda":
            return {}
        from autopar.hardware.presets import NCCL_BUFFERS, usable_memory

        free, total = torch.cuda.mem_get_info(0)  # after this process's CUDA context exists: total - free is it
        usable = usable_memory(total, context=(total - free) + NCCL_BUFFERS)
        return {"backend": "nccl", "device_type": "cuda", "memory_per_device": float(usable),
                "memory_capacity": float(total)}
