"""Moving a value from one pipeline stage to a later one, shard to shard, and its gradient back.

Forward: the sending stage reduces the value's Partial axes inside its mesh (differentiably; see
``PipelineRunner``) but keeps its shards; then each receiver rank gets exactly its box, in the spec the
receiving stage planned for, as the pieces ``autopar.ir.shard_boxes.forward_pieces`` lists: from every
distinct sender box that meets its own, one replica sends the intersection. No rank ever gathers the
whole value, and the link between stages carries each receiver's box once.

Backward: one designated receiver per distinct box returns the gradient of each intersection to every
sender rank whose box meets it (``backward_pieces``), so each sender rank assembles the whole gradient
of its own box (Replicate axes carry full gradients, see ``autopar.redistribute``) without a collective.

Senders that replicate the value over an axis each send only a slice of it (``shard_boxes.send_spec``),
so in backward each gets its slice's gradient and the stage all-gathers it (the split's backward);
receivers that replicate the value over an axis each get a slice of it (``shard_boxes.wire_spec``) and
all-gather it inside their stage (``PipelineRunner``), so the link between stages carries each box once.

A piece whose sender and receiver are the same rank (a stage sending to a later model chunk on the same
devices, as interleaved pipelines do) is handed over through ``mailbox`` instead of the network.

Every message has a tag that names the route, the microbatch and the direction; two boxes meet in one
box, so at most one message per tag travels between two ranks. Sends are asynchronous (``isend``) so two
stages sending to each other at once cannot deadlock; receives wait, each bounded by the process group's
timeout (``faults.guard``).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

from autopar.ir.shard_boxes import backward_pieces, box, forward_pieces, relative, send_spec, wire_spec
from autopar.placement import local_shape, parse_spec
from autopar.runtime import devices, faults
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
        floating = self.dtype.is_floating_point
        self.src_spec = send_spec(self.shape, parse_spec(self.src.shardings[self.value].out), self.src.mesh_shape,
                                  floating)
        self.dst_spec = parse_spec(self.dst.inputs[self.value])
        self.wire = wire_spec(self.shape, self.dst_spec, self.dst.mesh_shape) if floating else self.dst_spec
        self.src_mesh = np.asarray(self.src.ranks).reshape(self.src.mesh_shape)
        self.dst_mesh = np.asarray(self.dst.ranks).reshape(self.dst.mesh_shape)
        self.forward = forward_pieces(self.shape, self.src_spec, self.src_mesh, self.wire, self.dst_mesh)
        self.backward = (backward_pieces(self.shape, self.src_spec, self.src_mesh, self.wire, self.dst_mesh)
                         if floating else [])

    def tag(self, microbatch: int, direction: int) -> int:
        return ((self.index * 4096) + microbatch) * 2 + direction

    def src_box(self, rank: int):
        return box(self.shape, self.src_spec, self.src.mesh_shape, coordinate(self.src_mesh, rank))

    def dst_box(self, rank: int):
        return box(self.shape, self.wire, self.dst.mesh_shape, coordinate(self.dst_mesh, rank))

    def local_shape(self) -> tuple[int, ...]:
        """The receiver's piece as it arrives (``wire``; the receiving stage all-gathers it to ``dst_spec``)."""
        return local_shape(self.shape, self.wire, self.dst.mesh_shape)

    def src_local_shape(self) -> tuple[int, ...]:
        return local_shape(self.shape, self.src_spec, self.src.mesh_shape)


def _wait(work, what: str, route: Route) -> None:
    """Wait for a receive; a dead or stuck peer becomes a CommunicationError naming it."""
    faults.guard(f"{what} of {route.value} from stage {route.src.index}", None, work.wait)


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype == torch.bool else dtype


def _send(pieces, local, mine, route, tag, me, pending, mailbox) -> None:
    for p in pieces:
        if p.sender != me:
            continue
        part = local[relative(p.region, mine)]
        part = (part.to(torch.uint8) if part.dtype == torch.bool else part).contiguous()
        if p.receiver == me:
            mailbox[(tag, me)] = part.clone()
        else:
            part = devices.to_wire(part)  # NCCL sends GPU memory, gloo CPU memory
            pending.append((dist.isend(part, p.receiver, tag=tag), part))


def _receive(pieces, route, tag, me, mailbox, what: str) -> list:
    """[(piece, tensor)] of every piece addressed to ``me``: receives posted together, then waited on."""
    posted = []
    for p in pieces:
        if p.receiver != me:
            continue
        if p.sender == me:
            posted.append((p, mailbox.pop((tag, me)), None))
            continue
        buf = torch.empty([s.stop - s.start for s in p.region], dtype=_wire_dtype(route.dtype),
                          device=devices.wire_device())
        posted.append((p, buf, dist.irecv(buf, p.sender, tag=tag)))
    for _, _, work in posted:
        if work is not None:
            _wait(work, what, route)
    return [(p, buf) for p, buf, _ in posted]


def send_forward(local: torch.Tensor, route: Route, microbatch: int, me: int, pending: list, mailbox: dict) -> None:
    """Send every receiver the pieces of its box this rank serves (non-blocking; kept in ``pending``)."""
    _send(route.forward, local, route.src_box(me), route, route.tag(microbatch, FORWARD), me, pending, mailbox)


def recv_forward(route: Route, microbatch: int, me: int, mailbox: dict,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """This rank's box of the value on ``device`` (the rank's), in the receiving stage's spec (zeros on a
    Partial axis' coordinate ≠ 0)."""
    out = torch.zeros(route.local_shape(), dtype=_wire_dtype(route.dtype), device=device)
    mine = route.dst_box(me)
    tag = route.tag(microbatch, FORWARD)
    for p, buf in _receive(route.forward, route, tag, me, mailbox, "recv (forward)"):
        out[relative(p.region, mine)] = buf.to(out.device)
    return out.to(torch.bool) if route.dtype == torch.bool else out


def send_backward(grad: torch.Tensor | None, route: Route, microbatch: int, me: int, pending: list,
                  mailbox: dict) -> None:
    """Return the gradient of this receiver's box to the senders, if this receiver is designated."""
    g = grad if grad is not None else torch.zeros(route.local_shape(), dtype=route.dtype,
                                                  device=devices.wire_device())
    _send(route.backward, g, route.dst_box(me), route, route.tag(microbatch, BACKWARD), me, pending, mailbox)


def recv_backward(route: Route, microbatch: int, me: int, into: torch.Tensor, mailbox: dict) -> None:
    """Add the gradient pieces of this sender's box into ``into`` (this rank's local shape)."""
    mine = route.src_box(me)
    tag = route.tag(microbatch, BACKWARD)
    for p, buf in _receive(route.backward, route, tag, me, mailbox, "recv (backward)"):
        into[relative(p.region, mine)] += buf.to(into.device)
