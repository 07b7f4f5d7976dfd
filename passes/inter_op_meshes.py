"""The submeshes the stage DP prices (Alpa's): (1, 2^k) inside a node and (n, M) whole nodes, each viewed as a
few logical 2-D meshes; and the reference microbatch a (data, tensor) mesh is also solved at.

Invariant: every logical mesh of a submesh has exactly the submesh's devices (a × t = nodes × width).
"""
from __future__ import annotations

import dataclasses
import math

from autopar.hardware.cluster import Cluster


@dataclasses.dataclass(frozen=True)
class MeshOption:
    """A submesh (nodes, devices per node) viewed as a logical 2-D mesh."""

    physical: tuple[int, int]
    logical: tuple[int, int]

    @property
    def size(self) -> int:
        return self.physical[0] * self.physical[1]


def mesh_options(cluster: Cluster) -> list[MeshOption]:
    """Alpa's submeshes — (1, 2^k) inside a node, (n, M) whole nodes — each as a few logical meshes:
    one axis over all its devices (any mix of data and tensor parallelism per op), and (D/t, t) for
    t = 2, 4, 8 devices of one node on the inner axis (data × t-way tensor parallel; t = M is the
    physical shape). These include every layout of Megatron's grid (tensor parallelism inside a node)."""
    M, N = cluster.devices_per_node, cluster.nodes
    physical = [(1, 2 ** k) for k in range(int(math.log2(M)) + 1) if 2 ** k <= M]
    if M not in [p[1] for p in physical]:
        physical.append((1, M))
    physical += [(n, M) for n in sorted({2 ** k for k in range(1, int(math.log2(N)) + 1)} | {N}) if 1 < n <= N]
    out = []
    for nodes, width in physical:
        D = nodes * width
        logical = [(1, D)] + [(D // t, t) for t in (2, 4, 8) if t < D and t <= width and D % t == 0]
        out += [MeshOption((nodes, width), shape) for shape in dict.fromkeys(logical)]
    return out


def own_reference(option: MeshOption, smallest: int, batch: int) -> int | None:
    """The reference microbatch a (data, tensor) mesh (a, t) is also solved at for ``restaged``: the smallest
    multiple of the smallest reference that its data axis a divides, lcm(a, smallest); None where a divides the
    smallest already (or is 1), or that size does not divide the batch. Why: a solution prices only the
    microbatches its batch split divides, and at the smallest reference the data axis must shard something
    other than the batch, while the largest reference's solution splits the batch widely; neither prices
    Megatron's dp × tp stage at one sequence per replica."""
    a = option.logical[0]
    if a == 1 or smallest % a == 0:
        return None
    b0 = math.lcm(a, smallest)
    return b0 if batch % b0 == 0 else None
