"""Which rank of one mesh sends which piece of a tensor to which rank of another: shard-to-shard transfers.

A rank's *box* under a spec is the block of the full tensor it holds, one ``slice`` per tensor dim:
``Shard(d)`` axes cut dim d (nested shards follow DTensor: axis 0 splits first, each later axis splits the
piece it receives, as ``autopar.placement`` states), ``Replicate`` and ``Partial`` axes do not cut.

A transfer moves a value held in ``src_spec`` on the sending mesh to ``dst_spec`` on the receiving mesh.
The sender must hold real values, not summands: Partial axes are resolved (all-reduced) on the sending
mesh first (``resolved``). Then:

  * forward: each receiver gets, from one sender of every distinct sender box (replicas of a box take
    turns by the receiver's position, spreading the load), the intersection of that box with its own.
    Distinct sender boxes tile the tensor, so the pieces tile the receiver's box exactly once.
  * backward: the gradient of a receiver's box is whole on every replica of that box (the gradient
    convention of ``autopar.redistribute``: Replicate axes carry full gradients, a Partial's gradient
    is the full gradient of the sum), so one *designated* receiver per distinct box (coordinate 0 on
    every non-Shard axis) returns it; every sender rank gets, from each designated receiver, the
    intersection of their boxes, so each sender holds the whole gradient of its own box (again the
    convention: a replicated sender needs the full gradient).
  * a receiver on a Partial axis at coordinate ≠ 0 holds zeros and receives nothing.

At most one piece travels between two ranks per direction (two boxes intersect in one box), so a message
is named by (value, microbatch, direction) alone. What the cost model charges the link: the most bytes one
rank moves (``max_rank_bytes``) inside a node, the most bytes one node's NIC moves (``max_node_bytes``)
across nodes.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

import numpy as np
from torch.distributed.tensor import Shard

from autopar.placement import R, Spec

Box = tuple[slice, ...]


@dataclasses.dataclass(frozen=True)
class Piece:
    """``region`` (slices of the full tensor) travels from global rank ``sender`` to ``receiver``."""

    sender: int
    receiver: int
    region: Box

    def numel(self) -> int:
        return math.prod(s.stop - s.start for s in self.region)


def resolved(spec: Spec) -> Spec:
    """``spec`` with its Partial axes made Replicate: what a sender holds after reducing its summands."""
    return tuple(R if p.is_partial() else p for p in spec)


def wire_spec(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> Spec:
    """How a receiving stage gets a value it holds in ``spec``: each Replicate axis of size k > 1 becomes
    ``Shard(d)`` for the largest tensor dim d no axis shards yet whose size the split divides, so the k
    replicas each receive 1/k of the box and all-gather it inside their own stage afterwards (Megatron-LM's
    scatter/gather of cross-stage sends: the slow link carries each box once, not once per replica).
    An axis where no dim divides stays Replicate (its replicas each receive the whole box)."""
    out, factor = list(spec), [1] * len(shape)
    for axis, p in enumerate(spec):
        if p.is_shard():
            factor[p.dim] *= mesh_shape[axis]
    taken = {p.dim for p in spec if p.is_shard()}
    for axis, p in enumerate(spec):
        k = mesh_shape[axis]
        if not p.is_replicate() or k == 1:
            continue
        free = [d for d in range(len(shape)) if d not in taken and shape[d] % (factor[d] * k) == 0]
        if free:
            d = max(free, key=lambda d: (shape[d], -d))
            out[axis], factor[d] = Shard(d), factor[d] * k
            taken.add(d)
    return tuple(out)


def send_spec(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int], floating: bool = True) -> Spec:
    """What a sending stage sends from: its Partial axes reduced (``resolved``) and, for a value with a
    gradient, its Replicate axes split as ``wire_spec`` splits a receiver's, so each replica serves, and
    in backward receives the gradient of, only its slice; the split's backward all-gathers the gradient
    inside the sending stage (the gradient convention wants it whole on every replica)."""
    spec = resolved(spec)
    return wire_spec(shape, spec, mesh_shape) if floating else spec


def box(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int], coord: Sequence[int]) -> Box:
    """The block of the full tensor the device at ``coord`` holds (axis 0 splits a dim first)."""
    start, length = [0] * len(shape), list(shape)
    for axis, p in enumerate(spec):
        if p.is_shard():
            length[p.dim] //= mesh_shape[axis]
            start[p.dim] += coord[axis] * length[p.dim]
    return tuple(slice(a, a + n) for a, n in zip(start, length))


def intersect(a: Box, b: Box) -> Box | None:
    """The common block of two boxes, or None when they do not meet."""
    out = tuple(slice(max(x.start, y.start), min(x.stop, y.stop)) for x, y in zip(a, b))
    return out if all(s.start < s.stop for s in out) else None


def relative(region: Box, within: Box) -> Box:
    """``region`` as slices of the local tensor that holds ``within``."""
    return tuple(slice(r.start - w.start, r.stop - w.start) for r, w in zip(region, within))


def rank_boxes(shape: Sequence[int], spec: Spec, ranks: np.ndarray) -> dict[int, tuple[Box, bool]]:
    """Every rank of the mesh ``ranks`` (global ranks laid out in the mesh's shape) -> (its box, designated),
    designated meaning coordinate 0 on every axis that does not shard."""
    out = {}
    for coord in itertools.product(*(range(n) for n in ranks.shape)):
        lead = all(c == 0 for c, p in zip(coord, spec) if not p.is_shard())
        out[int(ranks[coord])] = (box(shape, spec, ranks.shape, coord), lead)
    return out


def _holds_value(spec: Spec, ranks: np.ndarray, rank: int) -> bool:
    coord = tuple(int(c[0]) for c in np.nonzero(ranks == rank))
    return all(c == 0 for c, p in zip(coord, spec) if p.is_partial())


def forward_pieces(shape, src_spec: Spec, src_ranks: np.ndarray, dst_spec: Spec, dst_ranks: np.ndarray) -> list[Piece]:
    """Pieces that give every receiver its box (``src_spec`` must have no Partial axis: see ``resolved``)."""
    if any(p.is_partial() for p in src_spec):
        raise ValueError("a sender cannot send summands: resolve its Partial axes first (``resolved``)")
    replicas: dict[tuple, tuple[Box, list[int]]] = {}  # keyed by bounds (slices are not hashable before 3.12)
    for rank, (b, _) in rank_boxes(shape, src_spec, src_ranks).items():
        replicas.setdefault(tuple((s.start, s.stop) for s in b), (b, []))[1].append(rank)
    pieces = []
    for pos, (receiver, (want, _)) in enumerate(rank_boxes(shape, dst_spec, dst_ranks).items()):
        if not _holds_value(dst_spec, dst_ranks, receiver):
            continue
        for have, senders in replicas.values():
            region = intersect(have, want)
            if region is not None:
                pieces.append(Piece(senders[pos % len(senders)], receiver, region))
    return pieces


def backward_pieces(shape, src_spec: Spec, src_ranks: np.ndarray, dst_spec: Spec, dst_ranks: np.ndarray) -> list[Piece]:
    """Gradient pieces: designated receivers -> every sender whose box meets theirs (``Piece.sender`` is the
    rank that sends the gradient, i.e. the receiver of the forward value)."""
    senders = rank_boxes(shape, src_spec, src_ranks)
    pieces = []
    for receiver, (want, lead) in rank_boxes(shape, dst_spec, dst_ranks).items():
        if not lead:
            continue
        for sender, (have, _) in senders.items():
            region = intersect(have, want)
            if region is not None:
                pieces.append(Piece(receiver, sender, region))
    return pieces


def max_rank_bytes(pieces: list[Piece], itemsize: int) -> float:
    """The most bytes any one rank sends or receives over the pieces (what bounds the transfer's time); a
    piece a rank keeps for itself (sender and receiver alike) crosses no link."""
    load: dict[tuple[str, int], int] = {}
    for p in pieces:
        if p.sender == p.receiver:
            continue
        for key in (("out", p.sender), ("in", p.receiver)):
            load[key] = load.get(key, 0) + p.numel()
    return float(max(load.values(), default=0) * itemsize)


def max_node_bytes(pieces: list[Piece], itemsize: int, devices_per_node: int) -> float:
    """The most bytes that leave or enter any one node (global rank r on node r div ``devices_per_node``):
    what bounds a transfer across nodes, whose NIC the node's ranks share."""
    load: dict[tuple[str, int], int] = {}
    for p in pieces:
        src, dst = p.sender // devices_per_node, p.receiver // devices_per_node
        if src == dst:
            continue
        for key in (("out", src), ("in", dst)):
            load[key] = load.get(key, 0) + p.numel()
    return float(max(load.values(), default=0) * itemsize)
