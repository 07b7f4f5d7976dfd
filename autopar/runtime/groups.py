"""Process groups for the mesh axes of every stage, registered under readable keys.

Generated code names a group by key, e.g. ``all_gather(x, dim=0, group="m0.a1")``: mesh 0 (the stage's
submesh), axis 1. ``build_groups`` must run on every rank with the same meshes in the same order, since
``torch.distributed.new_group`` is collective over the whole world; each rank keeps only the handles of
the groups it belongs to. Every group gets the same timeout as the default group, so no collective
waits forever on a dead peer.

This registry is per process: a process belongs to one stage, so keys resolve unambiguously.
"""
from __future__ import annotations

import datetime

import numpy as np
import torch.distributed as dist

_GROUPS: dict[str, dist.ProcessGroup] = {}
_MEMBERS: dict[str, tuple[int, ...]] = {}
_NAMES: dict[str, str] = {}  # key -> the group's name in c10d (what functional collectives take)
_NEXT_MESH = [0]  # mesh ids are never reused, so modules compiled earlier keep their groups


def group_key(mesh_index: int, axis: int) -> str:
    return f"m{mesh_index}.a{axis}"


def build_groups(meshes: list[np.ndarray], timeout: datetime.timedelta | None = None,
                 extra: dict[str, list[int]] | None = None) -> int:
    """Create the groups of every axis of every mesh (an int array of global ranks per mesh), one group
    of each whole mesh ("m<id>.all", used by pipelines and by gradient buckets synced over both axes), and
    the ``extra`` named groups (keys get the same "m<first id>." prefix). Returns the id of the first
    mesh: mesh i is ``base + i``. Every compiled module gets fresh ids, so one process may hold several
    modules at once."""
    base = _NEXT_MESH[0]
    _NEXT_MESH[0] += len(meshes)
    for i, ranks in enumerate(meshes):
        m = base + i
        ranks = np.asarray(ranks)
        for axis in range(ranks.ndim):
            if ranks.shape[axis] == 1:
                continue
            for members in np.moveaxis(ranks, axis, -1).reshape(-1, ranks.shape[axis]):
                _new(group_key(m, axis), members, timeout)
        if ranks.size > 1 and (len(meshes) > 1 or sum(d > 1 for d in ranks.shape) > 1):
            _new(f"m{m}.all", ranks.ravel(), timeout)
    for key in sorted(extra or {}):
        _new(f"m{base}.{key}", extra[key], timeout)
    return base


def _new(key: str, members, timeout) -> None:
    """Collective over the world: every rank creates every group; members keep the handle under ``key``."""
    members = tuple(int(r) for r in members)
    pg = dist.new_group(list(members), timeout=timeout)
    if dist.get_rank() in members:
        _GROUPS[key] = pg
        _MEMBERS[key] = members
        _NAMES[key] = pg.group_name


def get(key: str) -> dist.ProcessGroup:
    try:
        return _GROUPS[key]
    except KeyError:
        raise RuntimeError(f"process group {key!r} is not set up on rank {dist.get_rank()}; "
                           f"autopar.compile must run on every rank of the cluster") from None


def name(key: str) -> str:
    """The c10d name of the group (``torch.ops._c10d_functional``'s ``group_name``): a plain string, which
    ``torch.compile`` traces as a constant."""
    return _NAMES[key]


def members(key: str) -> tuple[int, ...]:
    return _MEMBERS[key]


def size(key: str) -> int:
    return len(_MEMBERS[key])


def local_rank_in(key: str) -> int:
    return _MEMBERS[key].index(dist.get_rank())


def mesh_ranks(first_rank: int, shape: tuple[int, int]) -> np.ndarray:
    """Global ranks of a mesh of ``shape`` starting at ``first_rank``, laid out row-major."""
    return np.arange(first_rank, first_rank + int(np.prod(shape))).reshape(shape)


def coordinate(ranks: np.ndarray, rank: int) -> tuple[int, ...] | None:
    """Mesh coordinate of ``rank`` in ``ranks`` (None if the rank is not in this mesh)."""
    hit = np.argwhere(np.asarray(ranks) == rank)
    return tuple(int(c) for c in hit[0]) if len(hit) else None


__all__ = ["build_groups", "get", "group_key", "members", "name", "size", "local_rank_in", "mesh_ranks",
           "coordinate"]
