"""ZeRO optimizer state in DCP checkpoints: flat bucket shards saved under each parameter's own key.

A ZeRO ≥ 1 bucket (``runtime.gradsync``) lays its parameters' local tensors end to end in one flat buffer
and a rank steps the slice [lo, hi) of it; the optimizer's state (exp_avg, exp_avg_sq) is that flat slice.
Saved as it is, it could be read back only by the same plan and world size. Here each parameter's part of
the slice, the flat range [max(a, lo), min(b, hi)) of its local tensor laid at [a, b), is cut into boxes
(row-major ranges are unions of at most 2·ndim − 1 rectangles: a partial first row, whole rows, a partial
last row, recursively), each placed at its global offset (the local tensor's offset under the plan's
placements plus the box's offset in it). DCP then sees ordinary chunks of the parameter-shaped state
``optim.<fqn>.<name>``, exactly as a ZeRO-0 plan writes them from DTensors, and reshards between any
plans: ZeRO to replicated, to tensor parallel, to another world size, and back.

``FlatShardPieces`` implements DCP's checkpointable protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``: what DTensor implements) rather than building a
``ShardedTensor``, whose constructor checks that its metadata covers the whole tensor, so it wants every
rank's shards (a collective, or the global layout that only the union of all ranks' boxes describes).
Each box is a view of the optimizer's flat state, so a load writes into it in place. A rank whose slice
holds none of a parameter contributes no chunk.
"""
from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The row-major flat range [start, end) of a tensor of ``shape`` as (offsets, sizes) rectangles, in
    order; each is contiguous in memory, so flat[start' : start' + numel] viewed as sizes is that box."""
    if start >= end:
        return []
    if len(shape) == 0:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (end - start,))]
    inner = math.prod(shape[1:])
    first_full, end_full = -(-start // inner), end // inner
    if first_full > end_full:  # inside one row
        row = start // inner
        return [((row, *o), (1, *s)) for o, s in boxes(shape[1:], start - row * inner, end - row * inner)]
    out = []
    if start < first_full * inner:
        row = first_full - 1
        out += [((row, *o), (1, *s)) for o, s in boxes(shape[1:], start - row * inner, inner)]
    if end_full > first_full:
        out.append(((first_full, *[0] * (len(shape) - 1)), (end_full - first_full, *shape[1:])))
    if end > end_full * inner:
        out += [((end_full, *o), (1, *s)) for o, s in boxes(shape[1:], 0, end - end_full * inner)]
    return out


def _flat_start(offsets: tuple[int, ...], shape: tuple[int, ...]) -> int:
    return sum(o * math.prod(shape[i + 1:]) for i, o in enumerate(offsets))


class FlatShardPieces(torch.Tensor):
    """This rank's rectangles of one parameter-shaped tensor, each a view of a flat shard (see module doc).

    A storage-less tensor of the global shape (as DTensor is: DCP looks tensors up only when they are
    ``torch.Tensor``s) that implements nothing but DCP's checkpointable protocol; no op runs on it."""

    @staticmethod
    def __new__(cls, global_shape, pieces: list[tuple[tuple[int, ...], torch.Tensor]], like: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(cls, torch.Size(global_shape), dtype=like.dtype,
                                                  device=like.device, requires_grad=False)
        out.pieces, out.properties = pieces, TensorProperties.create_from_tensor(like)
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} ran on a checkpoint's view of ZeRO shards, which only DCP reads")

    @property
    def global_shape(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, _obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=self._chunk(offsets, t), properties=self.properties,
                                                      size=self.global_shape))
                for offsets, t in self.pieces]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk(offsets, t) for offsets, t in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, t in self.pieces:
            if torch.Size(offsets) == index.offset:
                return t
        raise ValueError(f"no local piece of {index.fqn} at offset {tuple(index.offset)}")

    @staticmethod
    def _chunk(offsets, t: torch.Tensor) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.shape)


def bucket_entries(bucket, state: dict, infos: dict, dtensor_of) -> dict[str, dict]:
    """{fqn: {state name: FlatShardPieces | the shared scalar}} for the parameters of one ZeRO bucket.

    ``state``: the optimizer state of the bucket's shard; ``infos``: {placeholder: (fqn, global shape)} of
    the parameters to write; ``dtensor_of(name)``: the parameter's local tensor as a DTensor (its global
    offset under the plan's placements)."""
    out = {}
    for name, (p, a, b) in zip(bucket.names, bucket.offsets()):
        if name not in infos:
            continue
        fqn, global_shape = infos[name]
        dt = dtensor_of(name)
        local_shape, local_offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
        local_shape = tuple(local_shape)
        lo, hi = max(a, bucket.lo), min(b, bucket.hi)
        entry = {}
        for key, value in state.items():
            if not (isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == bucket.shard_size):
                entry[key] = value
                continue
            pieces = []
            for offsets, sizes in boxes(local_shape, lo - a, hi - a):
                at = a + _flat_start(offsets, local_shape) - bucket.lo
                view = value[at: at + math.prod(sizes)].view(sizes)
                pieces.append((tuple(o + g for o, g in zip(offsets, local_offset)), view))
            entry[key] = FlatShardPieces(global_shape, pieces, value)
        out[fqn] = entry
    return out
