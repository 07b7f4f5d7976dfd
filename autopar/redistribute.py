"""How a tensor moves from one spec to another: a list of one-axis steps, shared by cost model and codegen.

Forward steps (``kind``) and what their backward does to the gradient:

    kind            forward (on one mesh axis)          backward
    all_gather      Shard(d) -> Replicate               slice own chunk (no comm); reduce_scatter if
                                                        the consumer returns a Partial gradient
    split           Replicate -> Shard(d), local slice  all_gather
    all_reduce      Partial -> Replicate                identity; all_reduce if the consumer returns
                                                        a Partial gradient
    reduce_scatter  Partial -> Shard(d)                 all_gather
    all_to_all      Shard(d) -> Shard(d2)               all_to_all back
    to_partial      Replicate -> Partial, scale by 1/W  identity (the gradient of a Partial is replicated,
                                                        so the W paths of weight 1/W sum to it locally)
    sync_grad       Replicate -> Replicate (identity)   all_reduce (Megatron's f)
    unreachable     anything else -> EXPERT_ROWS        (never run: priced out, see below)

``EXPERT_ROWS`` (a Partial with disjoint row support) is a Partial, so it becomes ``Partial`` with no step
and leaves by the Partial steps. Nothing becomes it: only an expert-parallel grouped matmul makes one, so
a move into it from anything else is an ``unreachable`` step, which the cost model prices at
``UNREACHABLE_SECONDS`` so the planner never picks it and codegen refuses it.

Gradient convention (the invariant that makes the backward column right): the gradient arriving at a
Replicate tensor is the full gradient on every device; at a Shard, the gradient's shard; at a Partial,
the full gradient of the sum. A consumer whose *output* is not Replicate on an axis where its input
is Replicate computes only a summand of that input's gradient: it returns a Partial gradient, and
``grad_partial_axes`` marks those axes so the steps reduce it (``rs_backward`` / ``ar_backward`` /
``sync_grad``).

Ordering: axes that must change are first un-sharded from the last axis to the first (direct
all_to_all / reduce_scatter when no other axis shards the dims involved, else via Replicate), then
re-sharded from the first axis to the last, so nested shards keep DTensor's order (axis 0 outermost).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

from autopar.placement import EXPERT_ROWS, P, R, Spec


@dataclasses.dataclass(frozen=True)
class Step:
    kind: str
    axis: int
    dim: int | None = None          # tensor dim gathered / split / scattered (source dim for all_to_all)
    dim2: int | None = None         # target dim of an all_to_all
    rs_backward: bool = False       # all_gather whose backward reduce-scatters a Partial gradient
    ar_backward: bool = False       # all_reduce whose backward all-reduces a Partial gradient


def _shards(p, d: int) -> bool:
    return p.is_shard() and p.dim == d


def redistribute_steps(src: Spec, dst: Spec, grad_partial_axes: Sequence[int] = ()) -> list[Step]:
    """Steps taking a tensor from ``src`` to ``dst`` (see module docstring for the ordering rules)."""
    return list(_steps(tuple(src), tuple(dst), tuple(grad_partial_axes)))


@functools.lru_cache(maxsize=65536)
def _steps(src: Spec, dst: Spec, grad_partial_axes: tuple[int, ...]) -> tuple[Step, ...]:
    """Memoized: the planner asks for the same few spec pairs millions of times."""
    n = len(src)
    cur = list(src)
    steps: list[Step] = []
    changing = [a for a in range(n) if cur[a] != dst[a]]
    for a in reversed(range(n)):
        needs_unnest = cur[a].is_shard() and any(
            b < a and (_shards(cur[b], cur[a].dim) or _shards(dst[b], cur[a].dim)) for b in changing)
        if cur[a] == dst[a] and not needs_unnest:
            continue
        if cur[a] == EXPERT_ROWS and dst[a] == P:
            cur[a] = P  # a relabel: disjoint summands are summands
            continue
        others = [cur[b] for b in range(n) if b != a] + [dst[b] for b in range(n) if b != a]
        if cur[a].is_shard():
            d = cur[a].dim
            target = dst[a]
            if (target.is_shard() and target.dim != d and not needs_unnest
                    and not any(_shards(o, d) or _shards(o, target.dim) for o in others)):
                steps.append(Step("all_to_all", a, d, target.dim))
                cur[a] = target
            else:
                steps.append(Step("all_gather", a, d))
                cur[a] = R
        elif cur[a].is_partial():
            target = dst[a]
            if target.is_shard() and not any(_shards(o, target.dim) for o in others):
                steps.append(Step("reduce_scatter", a, target.dim))
                cur[a] = target
            else:
                steps.append(Step("all_reduce", a))
                cur[a] = R
    for a in range(n):
        if cur[a] == dst[a]:
            continue
        if dst[a] == EXPERT_ROWS:
            steps.append(Step("unreachable", a))
            cur[a] = dst[a]
            continue
        assert cur[a].is_replicate(), f"redistribute {src}->{dst}: axis {a} left at {cur[a]}"
        steps.append(Step("split", a, dst[a].dim) if dst[a].is_shard() else Step("to_partial", a))
        cur[a] = dst[a]
    return tuple(_mark_grad_partial(steps, dst, grad_partial_axes))


def _mark_grad_partial(steps: list[Step], dst: Spec, axes: Sequence[int]) -> list[Step]:
    """Make the backward reduce a Partial gradient on ``axes`` (each must be Replicate in ``dst``)."""
    out = list(steps)
    for a in axes:
        assert dst[a].is_replicate(), "a Partial gradient only arises at a Replicate input"
        last = max((i for i, s in enumerate(out) if s.axis == a), default=None)
        if last is not None and out[last].kind == "all_gather":
            out[last] = dataclasses.replace(out[last], rs_backward=True)
        elif last is not None and out[last].kind == "all_reduce":
            out[last] = dataclasses.replace(out[last], ar_backward=True)
        else:
            out.append(Step("sync_grad", a))
    return out


def grad_partial_axes(in_spec: Spec, out_spec: Spec) -> tuple[int, ...]:
    """Axes where a consumer takes a Replicate input but produces a non-Replicate output."""
    return tuple(a for a in range(len(in_spec)) if in_spec[a].is_replicate() and not out_spec[a].is_replicate())


__all__ = ["Step", "redistribute_steps", "grad_partial_axes", "P", "R"]
