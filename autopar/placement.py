"""Sharding specs in DTensor's vocabulary, and the arithmetic on them.

A *spec* is a tuple of placements, one per mesh axis (``axis`` always means a mesh axis, ``dim`` a
tensor dim): ``Shard(d)`` splits tensor dim d evenly over the axis, ``Replicate()`` keeps a full copy
on every device of the axis, ``Partial()`` holds one summand per device (the value is their sum).
``EXPERT_ROWS`` (text ``P(rows)``) is a Partial whose summands have disjoint row support: each device holds
the rows of its own experts and zeros elsewhere (what an expert-parallel grouped matmul makes; see
``passes/strategies/expert_rows.py``), stored compacted: only its own rows, about 1/W of them. It is a
Partial, so it becomes one (rows padded back with zeros); nothing else becomes it.

Nested sharding follows DTensor: when several axes shard the same dim, axis 0 splits it first and
each later axis splits the piece it receives, so device (c0, c1) of an (M0, M1) mesh holding
``(Shard(0), Shard(0))`` owns chunk ``c0 * M1 + c1`` of M0·M1 chunks.

Invariant used everywhere: a shard is only ever proposed when it divides evenly (see ``divides``);
uneven shards are never generated, so local shapes are exact integers.
"""
from __future__ import annotations

import functools
import re
from typing import Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

Spec = tuple[Placement, ...]

R = Replicate()
P = Partial()
EXPERT_ROWS = Partial("rows")  # DTensor keeps the reduce_op name; autopar reduces it as a sum

_TOKEN = re.compile(r"S\((\d+)\)|R|P\(rows\)|P(?:\(sum\))?")


_TEXT = {EXPERT_ROWS: "P(rows)"}
_PARSED = {"R": R, "P(rows)": EXPERT_ROWS}


def S(dim: int) -> Shard:
    """Shorthand for ``Shard(dim)``."""
    return Shard(dim)


def replicated(ndim_mesh: int) -> Spec:
    """The all-Replicate spec on a mesh with ``ndim_mesh`` axes."""
    return (R,) * ndim_mesh


def spec_str(spec: Spec) -> str:
    """Compact text form, e.g. ``(Shard(0), Replicate())`` -> ``"S(0)R"``; ``Partial`` -> ``"P"``,
    ``EXPERT_ROWS`` -> ``"P(rows)"``."""
    return "".join(_TEXT.get(p, "P") if p.is_partial() else str(p) for p in spec)


def parse_spec(text: str) -> Spec:
    """Inverse of ``spec_str``; raises ValueError on anything else."""
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"bad sharding spec {text!r}: expected tokens like 'S(0)', 'R', 'P'")
        token = m.group(0)
        out.append(Shard(int(m.group(1))) if m.group(1) is not None else _PARSED.get(token, P))
        pos = m.end()
    return tuple(out)


def shard_factor(spec: Spec, dim: int, mesh_shape: Sequence[int]) -> int:
    """How many pieces ``dim`` is split into under ``spec`` (product of the sizes of axes sharding it)."""
    f = 1
    for axis, p in enumerate(spec):
        if p.is_shard() and p.dim == dim:
            f *= mesh_shape[axis]
    return f


def divides(spec: Spec, shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
    """True when every sharded dim of ``shape`` splits evenly under ``spec``."""
    for axis, p in enumerate(spec):
        if p.is_shard():
            if p.dim >= len(shape) or shape[p.dim] % shard_factor(spec, p.dim, mesh_shape):
                return False
    return True


def local_shape(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of one device's shard: each sharded dim divided by its shard factor (exact by invariant); an
    EXPERT_ROWS axis divides dim 0 too (an expectation: the real count is the routed rows, see above)."""
    return _local_shape(tuple(shape), tuple(spec), tuple(mesh_shape))


@functools.lru_cache(maxsize=1 << 16)
def _local_shape(shape: tuple[int, ...], spec: Spec, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    out = list(shape)
    for axis, p in enumerate(spec):
        if p.is_shard():
            out[p.dim] //= mesh_shape[axis]
        elif p == EXPERT_ROWS and out:  # expected rows of this device's experts (balanced routing), rounded up
            out[0] = -(-out[0] // mesh_shape[axis])
    return tuple(out)


def shard_fraction(spec: Spec, mesh_shape: Sequence[int]) -> float:
    """Fraction of the global tensor held by one device (1 for Replicate/Partial axes)."""
    f = 1
    for axis, p in enumerate(spec):
        if p.is_shard() or p == EXPERT_ROWS:
            f *= mesh_shape[axis]
    return 1.0 / f


def local_slice(t: torch.Tensor, spec: Spec, mesh_shape: Sequence[int], coord: Sequence[int]) -> torch.Tensor:
    """The shard of the full tensor ``t`` held by the device at mesh coordinate ``coord``.

    Partial axes keep the full value on coordinate 0 and zeros elsewhere (their sum is ``t``).
    """
    for axis, p in enumerate(spec):
        if p.is_shard():
            t = t.chunk(mesh_shape[axis], dim=p.dim)[coord[axis]]
        elif p.is_partial() and coord[axis] != 0:
            t = torch.zeros_like(t)
    return t


def is_replicated(spec: Spec) -> bool:
    return all(p.is_replicate() for p in spec)
