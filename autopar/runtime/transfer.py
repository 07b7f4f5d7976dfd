"""Moving a value from one pipeline stage to a later one, on another submesh, and its gradient back.

Forward: the sender stage gathers the value whole on each of its ranks (inside its mesh, differentiably;
see ``PipelineRunner``), then each receiver rank gets exactly its shard (in the spec the receiving stage
planned for) from one sender rank: receiver i of the receiving stage is served by sender i mod n_send.
The slow link between stages carries each receiver's shard once.

Backward: a receiver's gradient is the gradient of its shard (Replicate axes carry full gradients,
see ``autopar.redistribute``), so only one receiver per distinct shard — coordinate 0 on every
Replicate axis — sends it back to its sender. Each sender rank adds the shards it receives into a zero
tensor of the value's full shape; the sender stage then sums those over its ranks (different ranks got
different shards) and gets the whole gradient, which flows back through the gather.

Every message has a tag that names the route, the microbatch and the direction, so messages between the
same two ranks never mix; sends are asynchronous (``isend``) so two stages sending to each other at once
cannot deadlock, and receives wait, each bounded by the process group's timeout.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

from autopar.placement import local_shape, parse_spec
from autopar.runtime import faults
from autopar.runtime.groups import coordinate

FORWARD, BACKWARD = 0, 1


@dataclasses.dataclass
class Route:
    """One value from stage ``src`` to stage ``dst`` (both ``plan.Stage``); ``index`` numbers routes."""

    index: int
    value: str
    src: object
    dst: object
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self):
        self.dst_spec = parse_spec(self.dst.inputs[self.value])
        self.dst_mesh = np.asarray(self.dst.ranks).reshape(self.dst.mesh_shape)

    def tag(self, microbatch: int, direction: int) -> int:
        return ((self.index * 4096) + microbatch) * 2 + direction

    def sender_of(self, receiver: int) -> int:
        return self.src.ranks[self.dst.ranks.index(receiver) % len(self.src.ranks)]

    def receivers_of(self, sender: int) -> list[int]:
        return [r for r in self.dst.ranks if self.sender_of(r) == sender]

    def designated(self, receiver: int) -> bool:
        """The one receiver per distinct shard that returns its gradient."""
        coord = coordinate(self.dst_mesh, receiver)
        return all(c == 0 for c, p in zip(coord, self.dst_spec) if not p.is_shard())

    def region(self, receiver: int) -> tuple[slice, ...]:
        """The receiver's shard as slices of the full value (nested shards: axis 0 outermost)."""
        coord = coordinate(self.dst_mesh, receiver)
        start = [0] * len(self.shape)
        length = list(self.shape)
        for axis, p in enumerate(self.dst_spec):
            if p.is_shard():
                length[p.dim] //= self.dst.mesh_shape[axis]
                start[p.dim] += coord[axis] * length[p.dim]
        return tuple(slice(a, a + n) for a, n in zip(start, length))

    def local_shape(self) -> tuple[int, ...]:
        return local_shape(self.shape, self.dst_spec, self.dst.mesh_shape)


def _wait(work, what: str, route: Route) -> None:
    """Wait for a receive; a dead or stuck peer becomes a CommunicationError naming it."""
    faults.guard(f"{what} of {route.value} from stage {route.src.index}", None, work.wait)


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.uint8) if t.dtype == torch.bool else t.contiguous()


def send_forward(full: torch.Tensor, route: Route, microbatch: int, me: int, pending: list) -> None:
    """Send each receiver served by this rank its shard of ``full`` (non-blocking; kept in ``pending``)."""
    for receiver in route.receivers_of(me):
        piece = _wire(full[route.region(receiver)])
        pending.append((dist.isend(piece, receiver, tag=route.tag(microbatch, FORWARD)), piece))


def recv_forward(route: Route, microbatch: int, me: int) -> torch.Tensor:
    """This rank's shard of the value, in the receiving stage's spec."""
    wire_dtype = torch.uint8 if route.dtype == torch.bool else route.dtype
    buf = torch.empty(route.local_shape(), dtype=wire_dtype)
    _wait(dist.irecv(buf, route.sender_of(me), tag=route.tag(microbatch, FORWARD)), "recv (forward)", route)
    return buf.to(torch.bool) if route.dtype == torch.bool else buf


def send_backward(grad: torch.Tensor | None, route: Route, microbatch: int, me: int, pending: list) -> None:
    """Return the gradient of this receiver's shard to its sender, if this receiver is designated."""
    if not route.designated(me):
        return
    g = (grad if grad is not None else torch.zeros(route.local_shape(), dtype=route.dtype)).contiguous()
    pending.append((dist.isend(g, route.sender_of(me), tag=route.tag(microbatch, BACKWARD)), g))


def recv_backward(route: Route, microbatch: int, me: int, into: torch.Tensor) -> None:
    """Add the gradient shards of the designated receivers this rank serves into ``into`` (full shape)."""
    for receiver in route.receivers_of(me):
        if not route.designated(receiver):
            continue
        buf = torch.empty(route.local_shape(), dtype=route.dtype)
        _wait(dist.irecv(buf, receiver, tag=route.tag(microbatch, BACKWARD)), "recv (backward)", route)
        into[route.region(receiver)] += buf
