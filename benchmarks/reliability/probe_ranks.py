"""The probe's cases that need process launches: the training-loop idioms on 2 ranks (each compared with one
device), a save called on one rank, a module returned from launch (see ``probe.py``)."""
from __future__ import annotations

import copy
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from probe_support import error, mlp

import autopar
from autopar.errors import AutoparError, CommunicationError


# ---- cases on two ranks: the training-loop idioms (each compared with one device) ----------------------
def loop_cases(rank: int) -> list:
    out = []

    def case(name, fn):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out.append((name, "value", fn()))
        except Exception as e:  # noqa: BLE001 - returned for judging
            out.append((name, "error", (type(e).__name__, isinstance(e, (AutoparError, CommunicationError)),
                                        str(e).split("\n")[0][:200])))

    c2, tp = autopar.Cluster.local(2), autopar.Cluster.local(2, mesh_shape=(1, 2))

    def trained(cluster, steps, options, clip=None, accumulate=1, dropout=0.0, opt_builder=None):
        model, (x, y) = mlp(dropout)
        ref = copy.deepcopy(model)
        pm = autopar.compile(model, cluster, (x, y), **options)
        opt = (opt_builder or (lambda p: pm.optimizer(torch.optim.SGD, lr=0.1)))(pm)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for _ in range(steps):
            for k in range(accumulate):
                pm.train_step(x + k, y)
                ref(x + k, y).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(pm.parameters(), clip)
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        got, want = pm.full_state_dict(), ref.state_dict()
        return max((got[k] - want[k]).abs().max().item() for k in want)

    case("gradient accumulation, data parallel", lambda: trained(c2, 1, {"pin": {"p_*": "RR"}}, accumulate=2))
    case("gradient accumulation, ZeRO-2", lambda: trained(c2, 1, {"zero": 2}, accumulate=2))
    tensor_parallel = {"pin": {"p_*": "RS(0)"}, "stages": 1}
    case("gradient accumulation, tensor parallel", lambda: trained(tp, 1, tensor_parallel, accumulate=2))
    case("clip_grad_norm_, tensor parallel", lambda: trained(tp, 2, tensor_parallel, clip=0.05))
    case("clip_grad_norm_, ZeRO-2", lambda: trained(c2, 2, {"zero": 2}, clip=0.05))
    case("torch.optim.SGD(pm.parameters()) under ZeRO-2", lambda: trained(
        c2, 2, {"zero": 2}, opt_builder=lambda pm: torch.optim.SGD(pm.parameters(), lr=0.1)))

    def per_rank_seed():
        model, batch = mlp(dropout=0.3)
        pm = autopar.compile(model, tp, batch, **tensor_parallel)
        torch.manual_seed(1000 + rank)  # the common per-rank seeding idiom
        losses = [None, None]
        dist.all_gather_object(losses, pm.train_step(*batch).item())
        return abs(losses[0] - losses[1])
    case("dropout with per-rank seeds, tensor parallel (ranks agree)", per_rank_seed)

    def eval_mode():
        model, batch = mlp(dropout=0.5)
        ref = copy.deepcopy(model).eval()
        pm = autopar.compile(model, c2, batch)
        pm.eval()
        with torch.no_grad():
            return abs(pm(*batch).item() - ref(*batch).item())
    case("pm.eval() switches dropout off", eval_mode)

    def frozen():
        model, batch = mlp()
        model.fc1.requires_grad_(False)
        ref = copy.deepcopy(model)
        pm = autopar.compile(model, c2, batch)
        opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.1)
        pm.train_step(*batch)
        opt.step()
        ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
        ref(*batch).backward()
        ref_opt.step()
        got, want = pm.full_state_dict(), ref.state_dict()
        return max((got[k] - want[k]).abs().max().item() for k in want)
    case("frozen parameters", frozen)

    def scheduler():
        model, batch = mlp()
        pm = autopar.compile(model, c2, batch)
        opt = pm.optimizer(torch.optim.SGD, lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        pm.train_step(*batch)
        opt.step()
        sched.step()
        return abs(opt.param_groups[0]["lr"] - 0.05)
    case("LR scheduler on pm.optimizer", scheduler)
    return out if rank == 0 else []


def judge_loop(entry) -> tuple[str, str]:
    name, kind, value = entry
    if kind == "value":
        return ("works", "") if value <= 1e-5 else ("silent wrong", f"differs from one device by {value:.3g}")
    type_name, ours, text = value
    return ("wrong cause" if ours else "raw crash"), f"{type_name}: {text[:160]}"


def save_on_rank_0_only(rank: int, path: str) -> int:
    model, batch = mlp()
    pm = autopar.compile(model, autopar.Cluster.local(2), batch)
    pm.train_step(*batch)
    if rank == 0:
        pm.save(path)
    return rank


def returns_module(rank: int):
    return nn.Linear(2, 2)


def launch_cases() -> list:
    path = str(Path(tempfile.mkdtemp(prefix="autopar-probe-")) / "ckpt")
    return [
        ("launch", "pm.save on rank 0 only", lambda: autopar.launch(save_on_rank_0_only, 2, path, timeout=10),
         error("every rank must call", "rank 1")),
        ("launch", "fn returns a module", lambda: autopar.launch(returns_module, 1, timeout=60),
         error("returned a Linear", "plain data")),
    ]
