"""The flat (one-tensor-in, one-tensor-out) all-gather and reduce-scatter of the torch that runs.

Invariant: ``all_gather_flat(out, shard, group=g)`` fills ``out`` with the group's shards concatenated on dim
0, and ``reduce_scatter_flat(out, flat, group=g)`` leaves in ``out`` this rank's dim-0 chunk of the group's sum.

torch 2.13 names them ``all_gather_single`` / ``reduce_scatter_single``; older releases (2.11 on the GPU images
we are lent) only have ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, same arguments. Every caller
takes them from here, so the runtime runs on both.
"""
from __future__ import annotations

import torch.distributed as dist

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
