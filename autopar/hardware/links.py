"""The interconnect a ``Cluster`` describes: link classes and measured collective fits, plain frozen data.

A collective of per-device message m on a link with a fit for it takes ``t(m) = alpha + m * beta``; without
one, the cost model applies the analytic formula on ``latency`` and ``bandwidth_for(group size)``.
Below ``cluster`` (which validates them) and ``presets`` (which fills them in), importing neither.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectiveFit:
    """A fitted α-β line for one collective on one link class and group size: t(m) = alpha + m * beta.

    m is the per-device message size in bytes as ``cost_models.communication`` defines it for that
    collective (the input of an all-reduce, the output of an all-gather, ...).
    """

    alpha: float
    beta: float

    def time(self, nbytes: float) -> float:
        return self.alpha + nbytes * self.beta


@dataclasses.dataclass(frozen=True, kw_only=True)
class Link:
    """One class of interconnect (inside a node, or between nodes).

    latency: α, seconds per collective (or per send).  bandwidth: bytes/s one device can push.
    group_bandwidth: {"<group size>": bytes/s per device} where a group's size changes what it gets (a
    V100 pair shares 1-2 NVLinks, eight GPUs ring over all six); sizes not listed use the nearest smaller
    listed one, else ``bandwidth`` (see ``bandwidth_for``). Empty on switched fabrics (NVSwitch, IB).
    hop_latency: seconds each extra algorithm step adds to a collective (NCCL's per-step latency): a ring
    all-reduce over n devices takes 2(n-1) steps, a tree 2·ceil(log2 n); 0 keeps one α per collective.
    fits: measured α-β lines keyed ``"<collective>/<group size>"`` (e.g. ``"all_reduce/4"``); when a key
    is present the cost model uses it instead of the analytic ring formula on latency/bandwidth. A key
    ``"<collective>/<group size>@<R>x<C>"`` is a fit measured on an R×C mesh with both axes busy, which
    the cost model prefers on that mesh (see ``cost_models.communication``).
    """

    latency: float
    bandwidth: float
    fits: dict[str, CollectiveFit] = dataclasses.field(default_factory=dict)
    group_bandwidth: dict[str, float] = dataclasses.field(default_factory=dict)
    hop_latency: float = 0.0

    def bandwidth_for(self, group_size: int) -> float:
        """Bytes/s per device for a group of ``group_size`` devices on this link: ``group_bandwidth`` at the
        largest listed size <= group_size (topologies where a pair gets fewer links than a full ring, such as
        the V100 hybrid cube-mesh), else ``bandwidth``."""
        listed = [int(k) for k in self.group_bandwidth if int(k) <= group_size]
        return self.group_bandwidth[str(max(listed))] if listed else self.bandwidth
