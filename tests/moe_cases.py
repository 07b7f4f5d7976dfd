"""The all-to-all expert dispatch kernel alone, against the op on one device, inside the shared parity launch.

A case is ("dispatch", mesh, routing, sabotage) with mesh (1, W): every rank builds the same global tokens and
experts (seeded), keeps its block of T/W tokens and E/W experts, and runs ``expert_all_to_all`` in a group of
the W ranks; the reference is ``experts_math`` on all tokens with all experts. Routing "skewed": rank r's
tokens go only to experts of ranks ≤ r (rank 0 sends nothing across, the last expert of the last rank gets
no token from anyone, uneven splits everywhere); "capacity": uniform routing with capacity factor 0.5 in
groups of 4 tokens (drops). Results: relative errors of the output and of the gradients of x, weights,
w_in, w_out (each rank's own block).
"""
import torch
import torch.distributed as dist

from autopar.ir.moe_op import experts_math
from autopar.runtime import expert_dispatch, groups

TOKENS, K, HIDDEN, INNER, EXPERTS_PER_RANK = 16, 2, 8, 12, 2


def _global_inputs(world: int, routing: str):
    g = torch.Generator().manual_seed(7)
    tokens, experts = TOKENS * world, EXPERTS_PER_RANK * world
    x = torch.randn(tokens, HIDDEN, generator=g)
    weights = torch.rand(tokens, K, generator=g)
    w_in = torch.randn(experts, HIDDEN, 2 * INNER, generator=g) * 0.3
    w_out = torch.randn(experts, INNER, HIDDEN, generator=g) * 0.3
    if routing == "skewed":  # rank r's tokens: experts of ranks 0..r only, never the very last expert
        owner = torch.arange(tokens) // TOKENS
        reach = (owner + 1) * EXPERTS_PER_RANK - (owner == world - 1).long()
        index = (torch.rand(tokens, K, generator=g) * reach.unsqueeze(1)).long()
    else:
        index = torch.randint(0, experts, (tokens, K), generator=g)
    return x, index, weights, w_in, w_out


def run_dispatch_case(mesh: tuple, routing: str) -> dict:
    world, rank = mesh[1], dist.get_rank()
    base = groups.build_groups([groups.mesh_ranks(0, tuple(mesh))])
    key = groups.group_key(base, 1)
    x, index, weights, w_in, w_out = _global_inputs(world, routing)
    capacity = (0.5, 4) if routing == "capacity" else (None, 0)
    attrs = ("silu", True, True) + capacity
    leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in (x, index, weights, w_in, w_out)]
    ref = experts_math(*leaves, *attrs)
    torch.manual_seed(1)
    probe = torch.randn_like(ref)
    (ref * probe).sum().backward()
    mine, experts = slice(rank * TOKENS, (rank + 1) * TOKENS), slice(rank * EXPERTS_PER_RANK,
                                                                      (rank + 1) * EXPERTS_PER_RANK)
    local = [t[mine] for t in (x, index, weights)] + [t[experts] for t in (w_in, w_out)]
    local = [t.clone().requires_grad_(t.is_floating_point()) for t in local]
    out = expert_dispatch.expert_all_to_all(*local, group=key, n_experts=EXPERTS_PER_RANK * world,
                                            activation="silu", gated=True, transposed=True,
                                            capacity_factor=capacity[0], group_size=capacity[1])
    (out * probe[mine]).sum().backward()
    errors = {"out": _rel(out, ref[mine])}
    for name, i, part in (("x", 0, mine), ("weights", 2, mine), ("w_in", 3, experts), ("w_out", 4, experts)):
        errors[name] = _rel(local[i].grad, leaves[i].grad[part])
    empty = [int((index[mine] // EXPERTS_PER_RANK == d).sum()) for d in range(world)]
    return {"errors": errors, "rows_sent_per_rank": empty}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / (b.detach().norm() + 1e-30))
