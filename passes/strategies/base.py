"""Vocabulary of the strategy rules: what a rule sees (``OpView``) and what it returns (``AxisRule``).

A rule describes the ways to split one op along *one* mesh axis. ``combine`` (in ``__init__``) takes the
product over the mesh axes to get 2-D ``Strategy`` objects. This works because every rule shards
the op's iteration space by one label per axis: two axes sharding the same tensor dim nest as DTensor
nests them (axis 0 outer), on inputs and output alike.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch
from torch.distributed.tensor.placement_types import Placement

from autopar.ir.ops import OpView
from autopar.placement import R, Spec, spec_str


@dataclasses.dataclass(frozen=True)
class AxisRule:
    """One way to split an op along one mesh axis.

    inputs: a placement per tensor input (in ``OpView.tensor_args`` order); output: the placement of
    the output (of every output, for multi-output ops). kernel: a tag naming the local rewrite codegen
    must apply when this rule is used on an axis (see ``KERNELS``), or None when the ATen op itself
    is correct on local shards.
    """

    inputs: tuple[Placement, ...]
    output: Placement
    kernel: str | None = None


# Local rewrites a rule may ask for, with what codegen does for axes of size W using them.
KERNELS = {
    "scale_additive": "the additive input (bias) is multiplied by 1/W before the op (output is Partial)",
    "mean_partial": "the op's output is multiplied by 1/W (a mean over a sharded dim becomes a Partial sum)",
    "vocab_embedding": "indices outside this rank's vocabulary rows read zero (output is Partial)",
    "ce_batch": "loss = local sum / global count of counted targets (output is Partial)",
    "ce_class": "softmax statistics are all-reduced over the class shards (vocab-parallel cross-entropy)",
    "local_experts": "a grouped expert matmul computes only its own experts' rows, zeros elsewhere (output is Partial)",
    "local_experts_op": "the MoE experts op computes only its own experts' assignments of every token (out Partial)",
    "expert_all_to_all": "the MoE experts op sends each token to its experts' devices and back (all-to-all)",
    "causal_context": "causal attention of a query chunk against whole k, v: prefix keys, offset mask, zig-zag balance",
}


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A full sharding of one node on the mesh: a spec per tensor input and the output spec.

    work_fraction: the share of the op's FLOPs one device performs (1 / product of the sizes of
    the axes whose rule splits the work; 1.0 when the op is replicated).
    kernels: (axis, tag) pairs for the local rewrites codegen must apply.
    """

    in_specs: tuple[Spec, ...]
    out_spec: Spec
    work_fraction: float = 1.0
    kernels: tuple[tuple[int, str], ...] = ()

    def __str__(self) -> str:
        ins = ",".join(spec_str(s) for s in self.in_specs)
        return f"{spec_str(self.out_spec)} <- ({ins})"


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def all_replicated_rule(view: OpView) -> AxisRule:
    return AxisRule(tuple(R for _ in range(view.n_in)), R)


def aten_ops(*names: str) -> list:
    """The ATen op packets with these names that exist in this torch build (older builds lack some)."""
    return [getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n)]


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1
