"""Shard-to-shard transfer plans (autopar.ir.shard_boxes): each receiver's box is tiled exactly once by its
pieces, the gradient pieces give every sender the whole gradient of its box, and the per-rank bytes the cost
model charges. Replayed on real tensors: a sender holds ``placement.local_slice`` of a random tensor."""
import itertools

import numpy as np
import pytest
import torch

from autopar.ir.shard_boxes import (
    backward_pieces,
    box,
    forward_pieces,
    intersect,
    max_node_bytes,
    max_rank_bytes,
    relative,
    resolved,
    wire_spec,
)
from autopar.placement import local_slice, parse_spec

SHAPE = (8, 4, 6)
# (src spec, src mesh, dst spec, dst mesh); ranks 0.. for the sender, then on for the receiver
PAIRS = [
    ("S(0)", (2,), "S(0)", (2,)),            # DP2 -> DP2
    ("S(2)", (2,), "S(0)", (2,)),            # TP2 -> DP2
    ("S(0)", (2,), "R", (1,)),               # 2 ranks -> 1
    ("R", (2,), "S(0)", (4,)),               # replicas share the serving
    ("S(0)S(0)", (2, 2), "S(0)", (4,)),      # nested shards -> one axis
    ("S(0)S(2)", (2, 2), "S(2)S(0)", (2, 2)),
    ("S(1)R", (2, 2), "S(0)S(1)", (2, 2)),
    ("S(0)", (2,), "PS(0)", (2, 2)),         # a Partial receiver: coordinate 0 holds the value
]


def _meshes(src_mesh, dst_mesh):
    n = int(np.prod(src_mesh))
    return np.arange(n).reshape(src_mesh), np.arange(n, n + int(np.prod(dst_mesh))).reshape(dst_mesh)


def _coords(mesh):
    return {int(mesh[c]): c for c in itertools.product(*(range(k) for k in mesh.shape))}


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}{p[1]}->{p[2]}{p[3]}")
def test_forward_pieces_rebuild_every_receivers_shard(pair):
    src, dst = parse_spec(pair[0]), parse_spec(pair[2])
    src_ranks, dst_ranks = _meshes(pair[1], pair[3])
    full = torch.randn(SHAPE)
    held = {r: local_slice(full, src, src_ranks.shape, c) for r, c in _coords(src_ranks).items()}
    got = {r: torch.zeros_like(local_slice(full, dst, dst_ranks.shape, c)) for r, c in _coords(dst_ranks).items()}
    covered = {r: torch.zeros_like(t) for r, t in got.items()}
    for p in forward_pieces(SHAPE, src, src_ranks, dst, dst_ranks):
        mine = box(SHAPE, src, src_ranks.shape, _coords(src_ranks)[p.sender])
        want = box(SHAPE, dst, dst_ranks.shape, _coords(dst_ranks)[p.receiver])
        got[p.receiver][relative(p.region, want)] = held[p.sender][relative(p.region, mine)]
        covered[p.receiver][relative(p.region, want)] += 1
    for r, c in _coords(dst_ranks).items():
        assert torch.equal(got[r], local_slice(full, dst, dst_ranks.shape, c)), (pair, r)
        holds = all(k == 0 for k, q in zip(c, dst) if q.is_partial())
        assert torch.all(covered[r] == int(holds)), "each element of a receiver's box arrives exactly once"


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}{p[1]}->{p[2]}{p[3]}")
def test_backward_pieces_give_each_sender_its_whole_gradient(pair):
    src, dst = parse_spec(pair[0]), parse_spec(pair[2])
    src_ranks, dst_ranks = _meshes(pair[1], pair[3])
    grad = torch.randn(SHAPE)
    # the convention: a receiver's gradient is the full gradient of its box, on every replica of it
    at_receiver = {r: local_slice(grad, resolved(dst), dst_ranks.shape, c) for r, c in _coords(dst_ranks).items()}
    into = {r: torch.zeros_like(local_slice(grad, src, src_ranks.shape, c)) for r, c in _coords(src_ranks).items()}
    for p in backward_pieces(SHAPE, src, src_ranks, dst, dst_ranks):
        theirs = box(SHAPE, dst, dst_ranks.shape, _coords(dst_ranks)[p.sender])
        mine = box(SHAPE, src, src_ranks.shape, _coords(src_ranks)[p.receiver])
        into[p.receiver][relative(p.region, mine)] += at_receiver[p.sender][relative(p.region, theirs)]
    for r, c in _coords(src_ranks).items():
        assert torch.equal(into[r], local_slice(grad, src, src_ranks.shape, c)), (pair, r)


def test_replicas_share_the_sending():
    src_ranks, dst_ranks = _meshes((2,), (4,))
    pieces = forward_pieces(SHAPE, parse_spec("R"), src_ranks, parse_spec("S(0)"), dst_ranks)
    assert sorted(p.sender for p in pieces) == [0, 0, 1, 1]


def test_per_rank_bytes_are_the_slices_not_the_gathered_tensor():
    """DP2 -> DP2 moves half the tensor per rank; TP2 (last dim) -> DP2 sends each receiver two quarters
    (one per sender), so each rank still moves half; 2 ranks -> 1 receives the whole tensor on one rank."""
    whole = float(np.prod(SHAPE) * 4)
    for (src, src_mesh, dst, dst_mesh), share in zip(PAIRS[:3], (0.5, 0.5, 1.0)):
        src_ranks, dst_ranks = _meshes(src_mesh, dst_mesh)
        pieces = forward_pieces(SHAPE, parse_spec(src), src_ranks, parse_spec(dst), dst_ranks)
        assert max_rank_bytes(pieces, 4) == share * whole, (src, dst)


def test_pieces_a_rank_keeps_cost_nothing():
    ranks = np.arange(2)
    pieces = forward_pieces(SHAPE, parse_spec("S(0)"), ranks, parse_spec("S(0)"), ranks)
    assert all(p.sender == p.receiver for p in pieces) and max_rank_bytes(pieces, 4) == 0.0


def test_intersect_and_partial_senders():
    assert intersect((slice(0, 4), slice(2, 6)), (slice(3, 8), slice(0, 3))) == (slice(3, 4), slice(2, 3))
    assert intersect((slice(0, 4),), (slice(4, 8),)) is None
    with pytest.raises(ValueError, match="resolve"):
        forward_pieces(SHAPE, parse_spec("P"), np.arange(2), parse_spec("R"), np.arange(2, 3))
    assert resolved(parse_spec("PS(1)")) == parse_spec("RS(1)")


def test_node_bytes_count_what_crosses_each_nic():
    """8 ranks of node 0 (S(0)) to 8 ranks of node 1 (S(0)): each rank moves 1/8, the NIC the whole tensor;
    two stages inside one node cross no NIC."""
    src_ranks, dst_ranks = _meshes((8,), (8,))
    pieces = forward_pieces(SHAPE, parse_spec("S(0)"), src_ranks, parse_spec("S(0)"), dst_ranks)
    whole = float(np.prod(SHAPE) * 4)
    assert max_rank_bytes(pieces, 4) == whole / 8
    assert max_node_bytes(pieces, 4, 8) == whole
    assert max_node_bytes(pieces, 4, 16) == 0.0


def test_replicating_receivers_take_slices_of_the_widest_free_dim():
    """Megatron's scatter/gather: k replicas each receive 1/k (then all-gather inside their stage); a dim
    already sharded, or one the split does not divide, is not used; no such dim leaves the axis Replicate."""
    assert wire_spec(SHAPE, parse_spec("RR"), (1, 2)) == parse_spec("RS(0)")
    assert wire_spec(SHAPE, parse_spec("S(2)R"), (2, 2)) == parse_spec("S(2)S(0)")
    assert wire_spec(SHAPE, parse_spec("R"), (3,)) == parse_spec("S(2)")
    assert wire_spec(SHAPE, parse_spec("R"), (5,)) == parse_spec("R")
    assert wire_spec(SHAPE, parse_spec("P"), (2,)) == parse_spec("P")
    src_ranks, dst_ranks = _meshes((8,), (8,))
    whole = float(np.prod(SHAPE) * 4)
    plain = forward_pieces(SHAPE, parse_spec("S(0)"), src_ranks, parse_spec("R"), dst_ranks)
    wired = forward_pieces(SHAPE, parse_spec("S(0)"), src_ranks, wire_spec(SHAPE, parse_spec("R"), (8,)), dst_ranks)
    assert max_node_bytes(plain, 4, 8) == 8 * whole and max_node_bytes(wired, 4, 8) == whole
