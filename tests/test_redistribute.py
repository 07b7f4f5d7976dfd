"""Redistribution steps, checked by simulating every device of a 2×2 mesh in one process (no process group).

For every pair of specs, start from the true local shards of a random tensor (random summands for
Partial axes), apply the steps with simulated collectives, and compare with the true local shards of
the destination spec. This checks the step planner's ordering rules for nested shards exhaustively.
"""
import itertools

import pytest
import torch
from torch.distributed.tensor import Shard

from autopar.placement import P, R, divides, local_slice, spec_str
from autopar.redistribute import grad_partial_axes, redistribute_steps

MESH = (2, 2)
COORDS = list(itertools.product(range(MESH[0]), range(MESH[1])))
PLACEMENTS = [R, P, Shard(0), Shard(1), Shard(2)]
SHAPE = (4, 8, 6)


def _group(coord, axis):
    return [c for c in COORDS if all(c[b] == coord[b] for b in range(2) if b != axis)]


def _initial_locals(full, spec):
    locals_ = {}
    for c in COORDS:
        t = full
        for axis, p in enumerate(spec):
            if isinstance(p, Shard):
                t = t.chunk(MESH[axis], dim=p.dim)[c[axis]]
        locals_[c] = t.clone()
    for axis, p in enumerate(spec):  # split Partial axes into random summands
        if p.is_partial():
            for c in COORDS:
                if c[axis] == 0:
                    group = _group(c, axis)
                    noise = [torch.randn_like(locals_[c]) for _ in group[1:]]
                    locals_[c] = locals_[c] - sum(noise)
                    for g, n in zip(group[1:], noise):
                        locals_[g] = n
    return locals_


def _apply(step, locals_):
    new = {}
    for c in COORDS:
        group = [locals_[g] for g in _group(c, step.axis)]
        k, m = c[step.axis], MESH[step.axis]
        if step.kind == "all_gather":
            new[c] = torch.cat(group, dim=step.dim)
        elif step.kind == "split":
            new[c] = locals_[c].chunk(m, dim=step.dim)[k]
        elif step.kind == "all_reduce":
            new[c] = sum(group)
        elif step.kind == "reduce_scatter":
            new[c] = sum(group).chunk(m, dim=step.dim)[k]
        elif step.kind == "all_to_all":
            new[c] = torch.cat([g.chunk(m, dim=step.dim2)[k] for g in group], dim=step.dim)
        elif step.kind == "to_partial":
            new[c] = locals_[c] / m
        elif step.kind == "sync_grad":
            new[c] = locals_[c]
        else:
            raise AssertionError(step.kind)
    return new


def _materialize_partials(locals_, spec):
    out = dict(locals_)
    for axis, p in enumerate(spec):
        if p.is_partial():
            out = {c: sum(out[g] for g in _group(c, axis)) for c in COORDS}
    return out


SPECS = [s for s in itertools.product(PLACEMENTS, repeat=2) if divides(s, SHAPE, MESH)]


@pytest.mark.parametrize("src", SPECS, ids=spec_str)
def test_every_redistribution_is_exact(src):
    torch.manual_seed(0)
    full = torch.randn(SHAPE, dtype=torch.float64)
    for dst in SPECS:
        locals_ = _initial_locals(full, src)
        for step in redistribute_steps(src, dst):
            locals_ = _apply(step, locals_)
        got = _materialize_partials(locals_, dst)
        want_spec = tuple(R if p.is_partial() else p for p in dst)
        for c in COORDS:
            want = local_slice(full, want_spec, MESH, c)
            assert got[c].shape == want.shape, f"{spec_str(src)}->{spec_str(dst)} at {c}"
            torch.testing.assert_close(got[c], want, msg=f"{spec_str(src)}->{spec_str(dst)} at {c}")


def test_simulator_catches_a_wrong_step():
    """Negative control: dropping the all-gather from S(0)R -> RR must be detected."""
    full = torch.randn(SHAPE, dtype=torch.float64)
    src, dst = (Shard(0), R), (R, R)
    steps = redistribute_steps(src, dst)
    assert [s.kind for s in steps] == ["all_gather"]
    locals_ = _initial_locals(full, src)  # no step applied
    assert locals_[(0, 0)].shape != local_slice(full, dst, MESH, (0, 0)).shape


def test_nested_shard_is_unnested_before_the_outer_axis_changes():
    steps = redistribute_steps((R, Shard(0)), (Shard(0), Shard(0)))
    assert [(s.kind, s.axis) for s in steps] == [("all_gather", 1), ("split", 0), ("split", 1)]


def test_partial_gradient_marks_the_gather_for_reduce_scatter():
    steps = redistribute_steps((Shard(0), R), (R, R), grad_partial_axes=(0,))
    assert steps[0].kind == "all_gather" and steps[0].rs_backward
    steps = redistribute_steps((R, R), (R, R), grad_partial_axes=(1,))
    assert [(s.kind, s.axis) for s in steps] == [("sync_grad", 1)]


def test_grad_partial_axes():
    assert grad_partial_axes((R, R), (Shard(0), R)) == (0,)
    assert grad_partial_axes((R, Shard(1)), (P, Shard(1))) == (0,)
    assert grad_partial_axes((Shard(0), R), (Shard(0), R)) == ()
