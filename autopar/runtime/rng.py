"""Dropout randomness under a plan: one stream the ranks share, own draws for sharded values, checkpointed.

Invariant: every rank of a stage draws from the same generator state, whatever the user seeded per rank
(``torch.manual_seed(seed + rank)`` is a common idiom). So a dropout on a replicated value draws the same
mask on every rank that holds it (as one device's model would: one mask), and replicated weights stay
equal. ``ModuleRng`` is that stream: seeded once at build from rank 0's generator (so a user's global seed
before ``compile`` still fixes the run), it replaces the default generator's state while the module runs
(``active``) and hands the user's state back after, so the user's own draws are untouched.

A dropout on a value sharded over some mesh axes must draw a different mask for each shard (Megatron's
RNG tracker keeps a separate model-parallel seed for that): ``dropout_own_draw`` takes one seed from the
shared stream (the same on every rank, so the stream stays aligned) and draws the mask from a generator
forked at that seed plus this rank's index among the shards (``own_draws`` rewrites such dropouts in the
generated modules from each op's output spec). A recomputed region replays the shared stream's state
(torch.utils.checkpoint preserves it), so its replay draws the same masks. Checkpoints carry every rank's
stream state (``state_dict``/``load_state_dict``, in the manifest).
"""
from __future__ import annotations

import base64
import contextlib

import torch
import torch.distributed as dist
import torch.fx as fx

from autopar.runtime import devices, faults

_MIX = 0x9E3779B97F4A7C15  # spreads shard indices over the seed space


class ModuleRng:
    """The generator state a ParallelModule's ranks share (see module docstring)."""

    def __init__(self, seed: int, device_type: str = "cpu"):
        self.cuda = device_type == "cuda" and torch.cuda.is_available()
        generator = torch.Generator().manual_seed(seed)
        self.state = generator.get_state()
        self.cuda_state = None
        if self.cuda:
            with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
                torch.cuda.manual_seed(seed)
                self.cuda_state = torch.cuda.get_rng_state()

    @classmethod
    def agreed(cls, device_type: str = "cpu") -> "ModuleRng":
        """Seeded from rank 0's default generator, broadcast to every rank (a collective)."""
        seed = devices.to_wire(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device="cpu"))
        faults.guard("broadcast", None, dist.broadcast, seed, src=0)
        return cls(int(seed.item()), device_type)

    @contextlib.contextmanager
    def active(self):
        user = torch.get_rng_state()
        user_cuda = torch.cuda.get_rng_state() if self.cuda else None
        torch.set_rng_state(self.state)
        if self.cuda:
            torch.cuda.set_rng_state(self.cuda_state)
        try:
            yield
        finally:
            self.state = torch.get_rng_state()
            torch.set_rng_state(user)
            if self.cuda:
                self.cuda_state = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(user_cuda)

    def state_dict(self) -> dict:
        out = {"cpu": base64.b64encode(self.state.numpy().tobytes()).decode()}
        if self.cuda_state is not None:
            out["cuda"] = base64.b64encode(self.cuda_state.numpy().tobytes()).decode()
        return out

    def load_state_dict(self, saved: dict) -> None:
        self.state = _bytes(saved["cpu"])
        if self.cuda and "cuda" in saved:
            self.cuda_state = _bytes(saved["cuda"])


def _bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def dropout_own_draw(x: torch.Tensor, p: float, train: bool, shard: int) -> torch.Tensor:
    """``aten.dropout`` with a mask of this shard's own (see module docstring)."""
    seed = int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device="cpu"))  # equal on every rank: aligned
    forked = torch.random.fork_rng(devices=[x.device], device_type="cuda") if x.device.type == "cuda" else \
        torch.random.fork_rng(devices=[])
    with forked:
        torch.manual_seed((seed + shard * _MIX) % 2 ** 63)
        return torch.ops.aten.dropout.default(x, p, train)


def own_draws(gm: fx.GraphModule, mesh_shape, coord) -> int:
    """Rewrite each dropout whose output is sharded (``meta["autopar_spec"]``, set by codegen) to draw its own
    mask: ``shard`` = 1 + this rank's index over the sharded axes. Returns how many were rewritten."""
    changed = 0
    for module in list(gm.modules()):
        if not isinstance(module, fx.GraphModule):
            continue
        here = 0
        for node in module.graph.nodes:
            spec = node.meta.get("autopar_spec")
            if node.op != "call_function" or node.target is not torch.ops.aten.dropout.default or spec is None:
                continue
            axes = [a for a, s in enumerate(spec) if type(s).__name__ == "Shard" and mesh_shape[a] > 1]
            if not axes:
                continue
            index = 0
            for a in axes:
                index = index * mesh_shape[a] + coord[a]
            node.target = dropout_own_draw
            node.args = (*node.args[:3], 1 + index)
            here += 1
        if here:
            module.recompile()
            changed += here
    return changed
