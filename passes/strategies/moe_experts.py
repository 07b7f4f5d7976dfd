"""Sharding rules of the MoE experts op ``autopar::moe_experts(x, index, weights, w_in, w_out, ...)``.

The op is token-local: out[t] reads only x[t], index[t], weights[t] and the experts (``ir/moe_op.py``). Per
mesh axis of size W (inputs in the op's order; E experts, T tokens):

* tokens split, experts replicated:  x, index, weights Shard(0); w_in, w_out R  -> out Shard(0). No kernel:
  the op runs on each device's tokens (data parallelism of the layer).
* gather-based expert split:  x, index, weights R; w_in, w_out Shard(0) -> out Partial, kernel
  ``local_experts_op``: every device sees every token and computes only the assignments to its E/W experts;
  the sum over the axis is the output.
* all-to-all expert parallelism:  x, index, weights Shard(0); w_in, w_out Shard(0) -> out Shard(0), kernel
  ``expert_all_to_all`` (``runtime/expert_dispatch.py``): each token row travels to the device of each of its
  experts and back; a device computes only its experts' rows.
* tensor parallelism inside each expert (non-gated experts: a gated ``gate_up`` weight would split gate
  from up): the expert hidden dim split on w_in and w_out, x R -> out Partial (the second matmul
  contracts the split dim; the activation is elementwise on it).

The two expert-split kernels run inside one axis's group, so a strategy may use at most one of them on
one axis (``consistent``). With a capacity factor, every device's tokens must be whole routing groups
(the drop decision is per group): strategies that split the tokens into pieces of partial groups are
dropped.
"""
from __future__ import annotations

from torch.distributed.tensor import Shard

from autopar.ir.moe_op import OP_NAME
from autopar.ir.ops import OpView
from autopar.passes.strategies.base import AxisRule, Strategy
from autopar.passes.strategies.registry import register
from autopar.placement import P, R

S0 = Shard(0)
EXPERT_KERNELS = ("local_experts_op", "expert_all_to_all")


@register(OP_NAME)
def moe_experts_rule(view: OpView) -> list[AxisRule]:
    tokens, experts = view.in_shapes[0][0], view.in_shapes[3][0]
    rules = []
    if tokens > 1:
        rules.append(AxisRule((S0, S0, S0, R, R), S0))
    if experts > 1:
        rules.append(AxisRule((R, R, R, S0, S0), P, "local_experts_op"))
        if tokens > 1:
            rules.append(AxisRule((S0, S0, S0, S0, S0), S0, "expert_all_to_all"))
    if not view.arg(6):  # not gated: the expert hidden dim may be split
        transposed = view.arg(7)
        hidden_in, hidden_out = (2, 1) if transposed else (1, 2)
        if view.in_shapes[3][hidden_in] > 1:
            rules.append(AxisRule((R, R, R, Shard(hidden_in), Shard(hidden_out)), P))
    return rules


def consistent(view: OpView, strategy: Strategy, mesh_shape: tuple[int, ...]) -> bool:
    """Whether a combined strategy of the experts op can run (module docstring); other ops always can."""
    if str(view.target) != OP_NAME:
        return True
    if sum(1 for _, tag in strategy.kernels if tag in EXPERT_KERNELS) > 1:
        return False
    group_size = view.arg(9) if view.arg(8) is not None else 0
    if not group_size:
        return True
    parts = 1
    for axis, p in enumerate(strategy.in_specs[0]):
        if p.is_shard() and p.dim == 0:
            parts *= mesh_shape[axis]
    return (view.in_shapes[0][0] // parts) % group_size == 0
