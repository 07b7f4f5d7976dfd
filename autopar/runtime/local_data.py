"""``data="local"``: each rank passes only its share of the batch, and the runtime feeds its stages from it.

Layout. The global batch of every tensor input (B rows on dim 0) is C *fine shares* of B/C rows, C the
least common multiple of the ways the plan splits dim 0 of an input anywhere (an input placement splitting
dim 0 over mesh axes a1..ak splits it into D = |a1|···|ak| blocks, nested as DTensor nests them). A rank's
share ``(k, c)`` (``pm.data_shard``) is fine shares [k·C/c, (k+1)·C/c), i.e. rows [k·B/c, (k+1)·B/c): the
largest c for which every block the rank reads lies in one share. So the global batch is the c shares
concatenated in index order, ranks reading the same blocks (tensor-parallel peers, the stages of one
replica) hold the same share, and a rank that reads no input may pass ``None``.

Microbatches. Microbatch m of M is the m-th of M equal chunks of every fine share, concatenated in share
order (under ``data="global"`` it is rows [m·B/M, (m+1)·B/M)): the step sees the same rows, grouped into
microbatches differently, so a loss averaging equal microbatches gives the same step. Block d of D of
microbatch m is then fine shares [d·C/D, (d+1)·C/D), chunk m: a slice of the rank's own share, no
communication. ``pm(...)`` puts the rows of its outputs back in global order (``restore_order``).

Agreement. Before a step every rank sends (its share, the shapes it passed, its index-range verdict, a
checksum of each fine share it holds) to every other through one gloo all-gather with the module's
timeout: shares that do not add up to the planned batch, peers that pass different rows for the same fine
share, or a bad index on any rank become the same ``InputError`` on every rank, before any collective of
the step, so no rank waits for one that stopped.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from autopar.errors import IndexRangeError, InputError, PlanError
from autopar.placement import parse_spec
from autopar.runtime import faults
from autopar.runtime.groups import coordinate


class LocalData:
    """This rank's view of the ``data="local"`` layout of ``plan`` (see the module docstring)."""

    def __init__(self, plan, graph, rank: int, group):
        self.plan, self.rank, self.group = plan, rank, group
        self.M = plan.microbatches
        self.inputs = {info.name: int(info.fqn.split(".")[1]) for info in graph.placeholders if info.kind == "input"}
        self.signature = plan.input_signature
        blocks = {r: _blocks_of_rank(plan, r, self.inputs) for r in _all_ranks(plan)}
        splits = {D for per_rank in blocks.values() for per_stage in per_rank.values() for _, D in per_stage.values()}
        self.C = math.lcm(*splits) if splits else 1
        self._check_divides()
        self.blocks = blocks[rank]  # {stage index: {input index: (d, D)}}
        shares = {r: _share(b, self.C) for r, b in blocks.items()}
        self.share = shares[rank] or _share_of_a_reader(plan, rank, shares)

    def _check_divides(self) -> None:
        for i, (shape, _) in enumerate(self.signature):
            if shape and shape[0] % (self.C * self.M):
                raise PlanError(f"data='local' splits input {i}'s {shape[0]} rows into {self.C} data shares of "
                                f"{self.M} microbatches each, which does not divide them; use a batch that is a "
                                f"multiple of {self.C * self.M}, or data='global'")

    # ---- what a runner feeds its stage -----------------------------------------------------------
    def microbatches(self, inputs: tuple, stage_index: int) -> list[tuple]:
        """M tuples: this rank's block of each input of stage ``stage_index`` for each microbatch (inputs
        the stage does not read: ``None``)."""
        blocks = self.blocks.get(stage_index, {})
        inputs = tuple(inputs) + (None,) * (len(self.signature) - len(inputs))  # a stage that reads none
        out = [[None] * len(inputs) for _ in range(self.M)]
        for i, x in enumerate(inputs):
            if i not in blocks:
                continue
            if not isinstance(x, torch.Tensor) or x.dim() == 0:
                for m in range(self.M):
                    out[m][i] = x
                continue
            lo, hi = self._relative(blocks[i])
            fine = x.reshape(self.C // self.share[1], self.M, -1, *x.shape[1:])
            for m in range(self.M):
                out[m][i] = fine[lo:hi, m].reshape(-1, *x.shape[1:])
        return [tuple(row) for row in out]

    def _relative(self, block: tuple[int, int]) -> tuple[int, int]:
        d, D = block
        start = self.share[0] * self.C // self.share[1]
        return d * self.C // D - start, (d + 1) * self.C // D - start

    def restore_order(self, value):
        """A joined output's rows from microbatch order back to global order (rows of a microbatch output
        that come in C equal groups: one per fine share); anything else as it is."""
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or self.M == 1 or self.C == 1 \
                or value.shape[0] % (self.M * self.C):
            return value
        return value.reshape(self.M, self.C, -1, *value.shape[1:]).transpose(0, 1).reshape(value.shape)

    # ---- the per-step agreement ------------------------------------------------------------------
    def local_signature(self) -> list:
        """The (shape, dtype) each input of this rank's share has."""
        k, c = self.share
        return [((shape[0] // c, *shape[1:]) if shape else tuple(shape), dtype) for shape, dtype in self.signature]

    def reads_input(self) -> bool:
        return any(self.blocks.values())

    def agree(self, inputs: tuple, other_error) -> None:
        """One all-gather: raise the same ``InputError`` on every rank if any rank's share is wrong (its
        shapes, or ``other_error()``: what else is wrong with well-shaped inputs, e.g. an index range)."""
        error = self._shape_error(inputs)
        if error is None and self.reads_input():
            error = other_error()
        mine = {"rank": self.rank, "share": self.share, "error": None if error is None else str(error),
                "index": isinstance(error, IndexRangeError), "sums": self._checksums(inputs) if error is None else {}}
        every = [None] * dist.get_world_size(self.group)
        faults.guard("all_gather_object", None, dist.all_gather_object, every, mine, group=self.group)
        problems = [f"rank {r['rank']} (share {r['share'][0]} of {r['share'][1]}): {r['error']}"
                    for r in every if r["error"]]
        problems += _disagreements(every)
        if problems:
            kind = IndexRangeError if any(r["index"] for r in every) else InputError
            raise kind("data='local': " + "; ".join(problems[:4]) + (" ..." if len(problems) > 4 else "")
                             + ". Each rank passes the rows pm.data_shard names, (index, count): rows "
                               "[index*B/count, (index+1)*B/count) of the global batch of B rows")

    def _shape_error(self, inputs: tuple) -> str | None:
        if not self.reads_input() and all(x is None for x in inputs):
            return None
        want = self.local_signature()
        got = [(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else (None, type(t).__name__)
               for t in inputs]
        if len(got) != len(want):
            return f"passed {len(got)} inputs, the plan has {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            if i not in self._read_inputs() and g[0] is None:
                continue  # an input this rank does not read may be None
            if tuple(g[0] or ()) != tuple(w[0]) or g[1] != w[1]:
                return (f"input {i} is {g[0]} {g[1]}, but its share of the planned batch "
                        f"{tuple(self.signature[i][0])} is {w[0]} {w[1]}")
        return None

    def _read_inputs(self) -> set[int]:
        return {i for per_stage in self.blocks.values() for i in per_stage}

    def _checksums(self, inputs: tuple) -> dict:
        """{(input, fine share): checksum} of the fine shares this rank passed (position-weighted, so a
        reordering of rows or values inside a share changes it too)."""
        sums = {}
        k, c = self.share
        per = self.C // c
        for i in sorted(self._read_inputs()):
            x = inputs[i]
            if not isinstance(x, torch.Tensor) or x.dim() == 0:
                continue
            flat = x.detach().reshape(per, -1).to(torch.float64)
            weights = torch.arange(1, flat.shape[1] + 1, dtype=torch.float64, device=flat.device)
            for j, (plain, weighted) in enumerate(zip(flat.sum(1).tolist(), (flat * weights).sum(1).tolist())):
                sums[i, k * per + j] = (plain, weighted)
        return sums


def _all_ranks(plan) -> list[int]:
    return sorted({r for s in plan.stages for r in s.ranks})


def _blocks_of_rank(plan, rank: int, inputs: dict[str, int]) -> dict[int, dict[int, tuple[int, int]]]:
    """{stage index: {input index: (block d, of D)}} for the stages ``rank`` runs and the inputs each reads."""
    out = {}
    for stage in plan.stages:
        if rank not in stage.ranks:
            continue
        coord = coordinate(np.asarray(stage.ranks).reshape(stage.mesh_shape), rank)
        out[stage.index] = {}
        for name, index in inputs.items():
            if name in stage.shardings:
                out[stage.index][index] = _block(parse_spec(stage.shardings[name].out), stage.mesh_shape, coord)
    return out


def _block(spec, mesh_shape, coord) -> tuple[int, int]:
    """(d, D): the block of dim 0 this coordinate holds, nested over the axes that shard dim 0 in order."""
    d, D = 0, 1
    for axis, placement in enumerate(spec):
        if placement.is_shard() and placement.dim == 0:
            d, D = d * mesh_shape[axis] + coord[axis], D * mesh_shape[axis]
    return d, D


def _share(blocks: dict, C: int) -> tuple[int, int] | None:
    """The largest count c (dividing C) whose share holds every block the rank reads; None if it reads none."""
    intervals = [(d * C // D, (d + 1) * C // D) for per_stage in blocks.values() for d, D in per_stage.values()]
    if not intervals:
        return None
    for c in sorted((c for c in range(1, C + 1) if C % c == 0), reverse=True):
        held = {lo * c // C for lo, _ in intervals} | {(hi - 1) * c // C for _, hi in intervals}
        if len(held) == 1:
            return held.pop(), c
    return 0, 1


def _share_of_a_reader(plan, rank: int, shares: dict) -> tuple[int, int]:
    """A rank that reads no input: the share of the rank at its position in the first stage that reads one."""
    stage = next(s for s in plan.stages if rank in s.ranks)
    position = list(stage.ranks).index(rank)
    for reader in plan.stages:
        if shares.get(reader.ranks[0]) is not None:
            return shares[reader.ranks[position % len(reader.ranks)]]
    return 0, 1


def _disagreements(every: list[dict]) -> list[str]:
    """Ranks that passed different rows for the same fine share of an input."""
    seen, out = {}, []
    for r in every:
        for key, value in r["sums"].items():
            if key in seen and seen[key][1] != value:
                out.append(f"ranks {seen[key][0]} and {r['rank']} passed different rows for input {key[0]}'s "
                           f"share (the peers of one share must pass the same rows)")
            seen.setdefault(key, (r["rank"], value))
    return out


def make_group(timeout):
    """The gloo group of every rank the agreement all-gathers over (a collective: call on every rank)."""
    return dist.new_group(backend="gloo", timeout=timeout)
