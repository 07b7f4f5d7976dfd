"""What autopar plans for: a 2-D device mesh (nodes × devices per node) and its costs.

A ``Cluster`` is plain, frozen data. The planner reads it; nothing in it needs the devices to exist,
so a 1024-GPU cluster is planned on a laptop. ``Cluster.local(n)`` is this machine as n CPU ranks
over gloo; ``Cluster.preset(name, nodes=N)`` describes real GPU clusters (see ``presets.py`` for the
source of every number); ``Cluster.profile(...)`` measures the machine it runs on.

Units: seconds, bytes, bytes/s, FLOP/s. Bandwidths are per device and unidirectional, the figure a
ring collective's bandwidth term divides by.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

from autopar.errors import ClusterError
from autopar.hardware import presets
from autopar.hardware.links import CollectiveFit, Link

__all__ = ["Cluster", "CollectiveFit", "Link"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """A homogeneous cluster: ``nodes`` machines of ``devices_per_node`` devices each.

    mesh_shape: the logical 2-D mesh used when the whole cluster runs one intra-op stage; defaults to
      (nodes, devices_per_node). Its product must equal the device count.
    peak_flops: dense matmul FLOP/s per device, by dtype name ("float32", "float16", "bfloat16").
    matmul_efficiency: fraction of peak_flops that large matmuls reach (a roofline ceiling, not 1.0).
    memory_bandwidth: bytes/s per device for ops bound by memory traffic (elementwise, norms, ...).
    memory_per_device: bytes available to training state on each device.
    intra_node / inter_node: the two link classes; inter_node.bandwidth is per node (one NIC shared by
      the node's devices), intra_node.bandwidth per device.
    backend / device_type: how the runtime talks ("gloo"/"cpu" locally, "nccl"/"cuda" on GPUs).
    source: where the numbers come from (a preset's citation, or "profiled on <host> <date>").
    matmul_curve: measured matmul throughput by dtype name, ``[[flops_per_call, achieved_flop_per_s], ...]``
      sorted by flops_per_call (see ``matmul_flops``); empty for presets, which have only a peak.
    op_overhead: seconds of host time each op call costs (Python, dispatcher, autograd bookkeeping, kernel
      launch); ``cost_models.compute`` charges it once per op in forward and once more in backward, added to
      the roofline time on CPU ranks and as max(roofline, host) on GPUs, whose launches overlap running
      kernels. 0 (the default, and what old cluster files load as) means "negligible"; the profiler measures it.
    microbatch_overhead: seconds of host time the pipeline runtime (``runtime.pipeline``, ``runtime.interleaved``)
      spends per (model chunk, microbatch) and direction beyond the ops of the chunk's graph: slicing the
      microbatch, send/recv calls, the generated module's call, autograd's bookkeeping. The step time charges
      it once per forward and once per backward of every (chunk, microbatch) of a plan that runs the
      pipeline runtime (more than one stage or microbatch; ``plan_builder.charge_microbatch_overhead``), the
      stage DP and the interleave pass too. 0 (the default, presets, old cluster files) means "negligible";
      the profiler measures it with 2 or more ranks (``autopar.profiling.profiler_pipeline``).
    memory_capacity: the device's physical memory in bytes, for reports (0: not known). ``memory_per_device``
      is what training may use: the capacity less the CUDA context and an allocator reserve (see
      ``presets.usable_memory``); the planner's budget is ``memory_per_device``.
    norm_act_bandwidth: bytes/s that normalization, activation and softmax ops achieve, forward + backward
      (``cost_models.compute.NORM_ACT_OPS``; bytes counted as the cost model counts them). They reduce over
      rows, evaluate transcendentals or run several kernels per op, and stream well below an ``add``: on an
      H100, LayerNorm at 0.23-0.38 and GELU at 0.45-0.61 of the preset's bandwidth; on one CPU core of the
      development VM, 0.05-0.09 of its add bandwidth. 0 (the default, presets, old cluster files): priced at
      ``memory_bandwidth`` like every other memory-bound op; the profiler measures it
      (``autopar.profiling.profiler_training``, item 6).
    attention_efficiency: the rate fused (flash) attention achieves, forward + backward on its causal FLOPs,
      as a fraction of the matmul curve's rate at the same call size. 0 (the default, presets, old cluster
      files): ``cost_models.compute.ATTENTION_RATE`` (FlashAttention-2's A100 figures), and on CPU clusters the
      plain roofline; the profiler measures it (``autopar.profiling.profiler_training``, item 7): it differs by
      generation (FlashAttention-2 reaches ~70 % of an A100's peak and ~35 % of an H100's), and torch's CPU
      kernel reaches 0.25-0.6 of the fp32 matmul rate on the development VM.
    comm_overlap: the share of a collective's time that compute running beside it hides (gradient sync behind
      backward, ZeRO-3's prefetched all-gathers behind the layers before them): 1 (the default, presets, old
      cluster files) where collectives have their own engines (GPUs: NCCL kernels on their own stream); on CPU
      ranks the profiler measures it (``autopar.profiling.profiler_in_step``), since gloo's threads then run on
      the cores the ranks compute on (0.3 on 2 ranks of the 2-core development VM).
    optimizer_call_overhead, optimizer_bandwidth: an optimizer step on CPU ranks (torch steps one tensor at a
      time with in-place ops outside autograd): host seconds per ATen call of the step, and the bytes per
      second its per-element passes reach as ``cost_models.compute.OPTIMIZER_TRAFFIC`` counts them. 0 (the
      default, presets, old cluster files, GPUs): ``op_overhead`` and ``memory_bandwidth``; the profiler
      measures both on CPU ranks (``autopar.profiling.profiler_optimizer``: 3 µs a call where a graph op takes
      12, and element passes at ~0.3 of the streaming bandwidth, on the development VM).
    compute_time_scale: end-to-end factor on every op's compute time (launch gaps, unfused epilogues and
      other kernel-level losses a per-op roofline misses), calibrated per preset against published runs
      (``benchmarks/calibration``); on a profiled CPU cluster, measured by the profiler on a probe training
      step (``autopar.profiling.profiler_training``, item 4; GPUs record it and keep 1.0).
    compiled_time_scale: the same factor for modules run under ``torch.compile`` (``autopar.compile(...,
      compile=True)``), measured by the profiler on the same probe step compiled, with no host time per op
      (a compiled graph issues fused kernels, not one call per op): what fusing pointwise chains and
      dropping per-op host calls saves. Plans for compiled modules are priced by ``compiled_view()``. 0
      (the default, presets, old cluster files) means "not measured": compiled modules are priced as eager
      ones. Left out of the JSON while 0, so clusters and plans without it stay byte-identical.
    """

    name: str
    nodes: int
    devices_per_node: int
    peak_flops: dict[str, float]
    matmul_efficiency: float
    memory_bandwidth: float
    memory_per_device: float
    intra_node: Link
    inter_node: Link
    mesh_shape: tuple[int, int] | None = None
    backend: str = "nccl"
    device_type: str = "cuda"
    source: str = ""
    matmul_curve: dict[str, list[list[float]]] = dataclasses.field(default_factory=dict)
    op_overhead: float = 0.0
    microbatch_overhead: float = 0.0
    memory_capacity: float = 0.0
    compute_time_scale: float = 1.0
    norm_act_bandwidth: float = 0.0
    attention_efficiency: float = 0.0
    compiled_time_scale: float = 0.0
    comm_overlap: float = 1.0
    optimizer_call_overhead: float = 0.0
    optimizer_bandwidth: float = 0.0

    def __post_init__(self):
        if self.nodes < 1 or self.devices_per_node < 1:
            raise ClusterError(f"cluster {self.name!r}: nodes ({self.nodes}) and devices_per_node "
                               f"({self.devices_per_node}) must be positive integers")
        for field in ("name", "device_type"):
            if not isinstance(getattr(self, field, ""), str):
                raise ClusterError(f"cluster: {field} must be a string, got {getattr(self, field)!r}{_FIX}")
        shape = tuple(self.mesh_shape) if self.mesh_shape is not None else (self.nodes, self.devices_per_node)
        if any(isinstance(n, bool) or not isinstance(n, int) for n in shape):
            raise ClusterError(f"cluster {self.name!r}: mesh_shape {shape} must be two integers{_FIX}")
        if len(shape) != 2 or math.prod(shape) != self.num_devices or min(shape) < 1:
            raise ClusterError(f"cluster {self.name!r}: mesh_shape {shape} does not tile {self.num_devices} devices; "
                               f"give two positive sizes whose product is {self.num_devices}, e.g. "
                               f"(1, {self.num_devices})")
        object.__setattr__(self, "mesh_shape", shape)
        for field in ("matmul_efficiency", "memory_bandwidth", "memory_per_device"):
            _check_positive(self.name, field, getattr(self, field))
        if not isinstance(self.peak_flops, dict) or not self.peak_flops:
            raise ClusterError(f"cluster {self.name!r}: peak_flops must map dtype names to FLOP/s, e.g. "
                               f"{{'float32': 1e12}}, got {self.peak_flops!r}{_FIX}")
        _check_positive(self.name, "op_overhead", self.op_overhead, allow_zero=True)
        _check_positive(self.name, "microbatch_overhead", self.microbatch_overhead, allow_zero=True)
        for field in ("optimizer_call_overhead", "optimizer_bandwidth"):
            _check_positive(self.name, field, getattr(self, field), allow_zero=True)
        _check_positive(self.name, "memory_capacity", self.memory_capacity, allow_zero=True)
        _check_positive(self.name, "norm_act_bandwidth", self.norm_act_bandwidth, allow_zero=True)
        _check_positive(self.name, "attention_efficiency", self.attention_efficiency, allow_zero=True)
        _check_positive(self.name, "compute_time_scale", self.compute_time_scale)
        _check_positive(self.name, "compiled_time_scale", self.compiled_time_scale, allow_zero=True)
        if isinstance(self.comm_overlap, bool) or not isinstance(self.comm_overlap, (int, float)) \
                or not 0.0 <= self.comm_overlap <= 1.0:
            raise ClusterError(f"cluster {self.name!r}: comm_overlap must be a share between 0 and 1, got "
                               f"{self.comm_overlap!r}{_FIX}")
        for dtype_name, value in self.peak_flops.items():
            _check_positive(self.name, f"peak_flops[{dtype_name!r}]", value)
        for link_name in ("intra_node", "inter_node"):
            _check_link(self.name, link_name, getattr(self, link_name))
        object.__setattr__(self, "matmul_curve", _checked_curve(self.name, self.matmul_curve))

    # ---- shape -------------------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def with_mesh(self, mesh_shape: tuple[int, int]) -> "Cluster":
        """The same cluster viewed as another logical 2-D mesh (same devices, same links)."""
        return dataclasses.replace(self, mesh_shape=tuple(mesh_shape))

    def with_memory(self, memory_per_device: float) -> "Cluster":
        """The same cluster with another per-device memory budget (bytes)."""
        return dataclasses.replace(self, memory_per_device=float(memory_per_device))

    def compiled_view(self) -> "Cluster":
        """The cluster as the cost model sees it for modules run under torch.compile: no host time per op
        (``op_overhead`` 0) and ``compiled_time_scale`` in place of ``compute_time_scale``, when the profiler
        measured it; else the cluster unchanged (compiled modules priced as eager ones)."""
        if self.compiled_time_scale <= 0:
            return self
        return dataclasses.replace(self, op_overhead=0.0, compute_time_scale=self.compiled_time_scale,
                                   source=f"{self.source}; priced for torch.compile'd modules")

    def flops(self, dtype_name: str) -> float:
        """Achievable matmul FLOP/s per device for a dtype (falls back to float32, then the max known)."""
        peak = self.peak_flops.get(dtype_name) or self.peak_flops.get("float32") or max(self.peak_flops.values())
        return peak * self.matmul_efficiency

    def matmul_flops(self, dtype_name: str, flops: float) -> float:
        """Achieved FLOP/s per device of one matmul call doing ``flops`` FLOPs (2·m·k·n for an mm).

        With a measured curve for the dtype, the rate is interpolated linearly in log(flops) between the
        two neighbouring points and clamped to the first/last point outside the measured range (small
        calls are slow, and nothing beyond the largest size measured is assumed faster). Without one it
        is ``flops(dtype_name)``: peak × matmul_efficiency, whatever the size.
        """
        curve = self.matmul_curve.get(dtype_name)
        if not curve:
            return self.flops(dtype_name)
        if flops <= curve[0][0]:
            return curve[0][1]
        if flops >= curve[-1][0]:
            return curve[-1][1]
        hi = next(i for i, (x, _) in enumerate(curve) if x >= flops)
        (x0, y0), (x1, y1) = curve[hi - 1], curve[hi]
        w = (math.log(flops) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return y0 + w * (y1 - y0)

    # ---- constructors ------------------------------------------------------------------------
    @staticmethod
    def local(n: int, mesh_shape: tuple[int, int] | None = None, memory_per_device: float | None = None) -> "Cluster":
        """This machine as ``n`` CPU ranks over gloo (see ``presets.local_cpu`` for the constants)."""
        return Cluster(**presets.local_cpu(n, mesh_shape=mesh_shape, memory_per_device=memory_per_device))

    @staticmethod
    def preset(name: str, nodes: int = 1, mesh_shape: tuple[int, int] | None = None, *,
               gpus: int | None = None) -> "Cluster":
        """A described GPU cluster: "p3.16xlarge", "dgx-a100", "dgx-h100", "a100-40gb", "l4", ... (``presets.PRESETS``).
        ``gpus`` instead of ``nodes``: that many devices, whole nodes or part of one (``presets.preset_gpus``)."""
        if gpus is None:
            return Cluster(**presets.preset(name, nodes=nodes, mesh_shape=mesh_shape))
        if nodes != 1:
            raise ClusterError(f"Cluster.preset({name!r}): give nodes={nodes!r} or gpus={gpus!r}, not both")
        fields = presets.preset_gpus(name, gpus)
        return Cluster(**(fields if mesh_shape is None else {**fields, "mesh_shape": mesh_shape}))

    @staticmethod
    def profile(*args, **kwargs) -> "Cluster":
        """Measure this machine as n local gloo ranks (out=path also writes the JSON); see
        ``autopar.profiling.profiler.profile_cluster``."""
        from autopar.profiling.profiler import profile_cluster

        return profile_cluster(*args, **kwargs)

    # ---- JSON --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if not self.compiled_time_scale:  # unmeasured: absent, as in files written before the field existed
            del out["compiled_time_scale"]
        if self.comm_overlap == 1.0:  # the default: absent, so files and plans of clusters without it stay as they were
            del out["comm_overlap"]
        for field in ("optimizer_call_overhead", "optimizer_bandwidth"):
            if not out[field]:  # unmeasured: absent, as in files written before the fields existed
                del out[field]
        return out

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """JSON text of the cluster; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Cluster":
        return _cluster_from_dict(d)

    @staticmethod
    def from_json(source: str | os.PathLike) -> "Cluster":
        """Load a cluster from JSON text or from a path to a JSON file."""
        text = str(source)
        if not text.lstrip().startswith("{"):
            path = Path(source)
            if not path.exists():
                raise ClusterError(f"cluster file {str(path)!r} does not exist; write one with "
                                   f"`autopar profile --out {path}` or Cluster.to_json({str(path)!r})")
            from autopar.ir.text_files import read_json_text

            text = read_json_text(path, "cluster file", ClusterError, f"write one with `autopar profile --out {path}`")
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ClusterError(f"cluster JSON is malformed ({e}); regenerate it with `autopar profile`") from None
        return _cluster_from_dict(d)


_REQUIRED = ("name", "nodes", "devices_per_node", "peak_flops", "matmul_efficiency", "memory_bandwidth",
             "memory_per_device", "intra_node", "inter_node")


_FIX = ("; fix the value in the cluster JSON or re-measure with `autopar profile --out cluster.json` "
        "(Cluster.profile(out='cluster.json') in Python)")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_positive(cluster: str, field: str, value, allow_zero: bool = False) -> None:
    ok = _is_number(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ClusterError(f"cluster {cluster!r}: {field} must be a finite number {bound}, got {value!r}{_FIX}")


def _valid_fit_key(key: str) -> bool:
    """"<collective>/<n>" with n >= 2, optionally "@<R>x<C>" (a mesh with both sizes >= 2) or "@step"
    (timed after a burst of compute, ``autopar.profiling.profiler_in_step``)."""
    kind, _, rest = key.partition("/")
    size, _, mesh = rest.partition("@")
    rows, _, cols = mesh.partition("x")
    mesh_ok = not mesh or mesh == "step" or (rows.isdigit() and cols.isdigit() and min(int(rows), int(cols)) >= 2)
    return bool(kind) and size.isdigit() and int(size) >= 2 and mesh_ok


def _check_link(cluster: str, link_name: str, link: Link) -> None:
    """latency >= 0, bandwidth > 0, and every fit has alpha >= 0, beta > 0 under a "<collective>/<n>" key
    (or "<collective>/<n>@<R>x<C>": measured on that mesh, see ``cost_models.communication``)."""
    _check_positive(cluster, f"{link_name}.latency", link.latency, allow_zero=True)
    _check_positive(cluster, f"{link_name}.bandwidth", link.bandwidth)
    _check_positive(cluster, f"{link_name}.hop_latency", link.hop_latency, allow_zero=True)
    if not isinstance(link.group_bandwidth, dict):
        raise ClusterError(f"cluster {cluster!r}: {link_name}.group_bandwidth must map group sizes to bytes/s, "
                           f"e.g. {{'2': 25e9}}, got {link.group_bandwidth!r}{_FIX}")
    for size, value in link.group_bandwidth.items():
        if not (isinstance(size, str) and size.isdigit() and int(size) >= 2):
            raise ClusterError(f"cluster {cluster!r}: {link_name}.group_bandwidth key {size!r} must be a group "
                               f"size >= 2 written as a string, e.g. '2'{_FIX}")
        _check_positive(cluster, f"{link_name}.group_bandwidth[{size!r}]", value)
    for key, fit in link.fits.items():
        if not _valid_fit_key(key):
            raise ClusterError(f"cluster {cluster!r}: {link_name}.fits key {key!r} must read "
                               f"'<collective>/<group size>', e.g. 'all_reduce/4', or "
                               f"'<collective>/<group size>@<rows>x<cols>', e.g. 'all_reduce/2@2x2', or "
                               f"'<collective>/<group size>@step'{_FIX}")
        _check_positive(cluster, f"{link_name}.fits[{key!r}].alpha", fit.alpha, allow_zero=True)
        _check_positive(cluster, f"{link_name}.fits[{key!r}].beta", fit.beta)


def _checked_curve(cluster: str, curve) -> dict[str, list[list[float]]]:
    """The matmul curve with every point [flops > 0, flop/s > 0] as floats, sorted by flops."""
    if not isinstance(curve, dict):
        raise ClusterError(f"cluster {cluster!r}: matmul_curve must map dtype names to "
                           f"[[flops_per_call, flop_per_s], ...], got {type(curve).__name__}{_FIX}")
    out = {}
    for dtype_name, points in curve.items():
        field = f"matmul_curve[{dtype_name!r}]"
        if not isinstance(points, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2
                                                             for p in points):
            raise ClusterError(f"cluster {cluster!r}: {field} must be a list of [flops_per_call, flop_per_s] "
                               f"pairs, got {points!r}{_FIX}")
        for flops, rate in points:
            _check_positive(cluster, f"{field} flops_per_call", flops)
            _check_positive(cluster, f"{field} flop_per_s", rate)
        out[dtype_name] = sorted([float(f), float(r)] for f, r in points)
    return out


def _fit_from_dict(v: Any, where: str) -> CollectiveFit:
    if not isinstance(v, dict) or set(v) != {"alpha", "beta"}:
        raise ClusterError(f"cluster JSON: {where} must be {{'alpha': seconds, 'beta': seconds per byte}}, "
                           f"got {v!r}{_FIX}")
    return CollectiveFit(alpha=v["alpha"], beta=v["beta"])


def _link_from_dict(d: dict[str, Any], where: str) -> Link:
    if not isinstance(d, dict) or "latency" not in d or "bandwidth" not in d:
        raise ClusterError(f"cluster JSON: {where} needs 'latency' (s) and 'bandwidth' (bytes/s), got {d!r}{_FIX}")
    fits = d.get("fits") or {}
    if not isinstance(fits, dict):
        raise ClusterError(f"cluster JSON: {where}.fits must be an object keyed '<collective>/<group size>', "
                           f"got {fits!r}{_FIX}")
    fits = {k: _fit_from_dict(v, f"{where}.fits[{k!r}]") for k, v in fits.items()}
    unknown = set(d) - {f.name for f in dataclasses.fields(Link)}
    if unknown:
        raise ClusterError(f"cluster JSON: {where} has unknown fields {sorted(unknown)}; known fields: "
                           f"{sorted(f.name for f in dataclasses.fields(Link))}{_FIX}")
    group_bandwidth = d.get("group_bandwidth") or {}
    if not isinstance(group_bandwidth, dict):
        raise ClusterError(f"cluster JSON: {where}.group_bandwidth must be an object (group size: bytes/s), "
                           f"got {group_bandwidth!r}{_FIX}")
    return Link(latency=d["latency"], bandwidth=d["bandwidth"], fits=fits,
                group_bandwidth=dict(group_bandwidth), hop_latency=d.get("hop_latency", 0.0))


def _cluster_from_dict(d: dict[str, Any]) -> Cluster:
    if not isinstance(d, dict):
        raise ClusterError(f"cluster JSON must be an object, got {type(d).__name__}{_FIX}")
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise ClusterError(f"cluster JSON is missing {missing}; every cluster file needs {list(_REQUIRED)} "
                           f"(write one with `autopar profile --out cluster.json`, Cluster.profile(out=...) "
                           f"or Cluster.local(n).to_json(path))")
    unknown = set(d) - {f.name for f in dataclasses.fields(Cluster)}
    if unknown:
        raise ClusterError(f"cluster JSON has unknown fields {sorted(unknown)}; known fields: "
                           f"{sorted(f.name for f in dataclasses.fields(Cluster))}{_FIX}")
    kwargs = dict(d)
    kwargs["intra_node"] = _link_from_dict(d["intra_node"], "intra_node")
    kwargs["inter_node"] = _link_from_dict(d["inter_node"], "inter_node")
    try:
        if kwargs.get("mesh_shape") is not None:
            kwargs["mesh_shape"] = tuple(kwargs["mesh_shape"])
        return Cluster(**kwargs)
    except TypeError as e:
        raise ClusterError(f"cluster JSON has a field of the wrong type: {e}{_FIX}") from None
