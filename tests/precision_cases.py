"""Cases for tests/test_precision.py: every one runs in each rank of one 4-rank ``autopar.launch``.

zero "auto" cases plan with the memory halfway between ZeRO 2's and ZeRO 3's needs (``zero3_budget``), so the
planner's own choice puts parameters at level 3.

A case is (model, layout, precision, zero, sabotage). Layouts: "dp" (one 2×2 stage, parameters pinned
replicated, the batch split over both axes: every parameter's gradient goes through the bucketed sync; "dp-rc"
the same with every layer recomputed in backward), "tp" (one 2×2 stage: Megatron's tensor parallelism on axis
1, the batch and ZeRO on axis 0) and "pp" (2 stages × 2 devices, 4 microbatches, 1F1B). Each case trains 3
AdamW steps with ``pm.optimizer`` on
the sharded module, and the same on single-device copies: one under the same precision policy (autocast,
and ``torch.amp.GradScaler`` for fp16), one in fp32. It reports the loss and parameter errors against both,
the bytes of parameters, gradients and optimizer state this rank holds (counted from the tensors: distinct
storages), the plan's prediction of them, and the gradient sync's events.

Sabotage "sync": every bucket's all-reduce runs on a copy of its buffer, and every reduce-scatter on
zeros, so no rank gets the reduced gradients (the negative control of the bucketed, overlapped sync).
Sabotage "gather": every ZeRO-3 unit all-gather fills only this rank's shard, the rest stays zero (the
negative control of parameters sharded between uses). Sabotage "prefetch": every all-gather issued ahead of
its use sends another unit's shard (the negative control of the prefetch: the ops read what it gathered).
"""
import copy
import os
import shutil
import tempfile

import torch

import autopar
from autopar.runtime import gradsync, zero3
from tests.models import FACTORIES
from tests.parity import rel

LR, EPS, STEPS = 1e-3, 1e-6, 3
BUCKET_BYTES = 20000  # several buckets even for the small test models, so overlap is visible
PIPE = [{"layers": [0, 0], "submesh": [1, 2]}, {"layers": [1, 1], "submesh": [1, 2]}]
# Input nodes take forward's argument names: the zoo wrapper's forward(*inputs) gives inputs_0, inputs_1.
DP_PINS = {"gpt": ("idx", "targets"), "llama": ("input_ids", "labels"), "zoo_llama": ("inputs_0", "inputs_1")}
# Megatron's layout on mesh axis 1 (column-parallel q/k/v/gate/up, row-parallel o/down), batch over axis 0
TP_PINS = {"zoo_llama": {**{f"p_*_{w}_proj_weight": "RS(0)" for w in ("q", "k", "v", "gate", "up")},
                         "p_*_o_proj_weight": "RS(1)", "p_*_down_proj_weight": "RS(1)",
                         "inputs_0": "S(0)R", "inputs_1": "S(0)R"}}


def options(model_name: str, layout: str) -> dict:
    if layout in ("dp", "dp-rc"):  # dp-rc: every layer recomputes its activations in backward
        a, b = DP_PINS[model_name]
        rc = {"recompute": "full"} if layout == "dp-rc" else {}
        return {"stages": 1, "pin": {"p_*": "RR", a: "S(0)S(0)", b: "S(0)S(0)"}, **rc}
    if layout == "tp":
        return {"stages": 1, "pin": TP_PINS[model_name]}
    return {"stages": PIPE, "microbatches": 4, "layers": 2, "schedule": "1f1b"}


class _Reference:
    """A single-device copy trained under a precision policy (autocast; GradScaler for fp16)."""

    def __init__(self, model, precision: str):
        self.model = copy.deepcopy(model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, eps=EPS)
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        self.scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None

    def step(self, batch) -> float:
        with torch.autocast("cpu", dtype=self.dtype or torch.float32, enabled=self.dtype is not None):
            loss = self.model(*batch)
        if self.scaler is None:
            loss.backward()
            self.opt.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        self.opt.zero_grad()
        return loss.item()


def held_bytes(pm, opt) -> dict:
    """Bytes of distinct storages: parameters, gradients (incl. ZeRO shards'), optimizer state."""
    def total(tensors):
        seen = {}
        for t in tensors:
            if t is not None:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return float(sum(seen.values()))

    params = list(pm.runner.gm.parameters())
    buckets = pm.runner.gradsync.buckets
    shards = [b.shard for b in buckets if b.level >= 1]
    bucket_grads = [b.grad_flat if b.level <= 1 else b.grad_shard for b in buckets]  # held between steps
    return {"params": total(params + shards), "grads": total([p.grad for p in params + shards] + bucket_grads),
            "optimizer": total([v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)])}


def run_case(case) -> dict:
    model_name, layout, precision, zero, sabotage = case
    model, batch = FACTORIES[model_name]()
    refs = {"same": _Reference(model, precision), "fp32": _Reference(model, "fp32")}
    cluster = autopar.Cluster.local(4, mesh_shape=(2, 2))
    if zero == "auto":
        cluster = zero3_budget(model, batch, cluster, precision, options(model_name, layout))
    pm = autopar.compile(model, cluster, batch, precision=precision, zero=zero, bucket_bytes=BUCKET_BYTES,
                         **options(model_name, layout))
    opt = pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    loss_err = {"same": 0.0, "fp32": 0.0}
    for _ in range(STEPS):
        loss = pm.train_step(*batch).item()
        opt.step()
        opt.zero_grad()
        for key, ref in refs.items():
            ref_loss = ref.step(batch)
            loss_err[key] = max(loss_err[key], abs(loss - ref_loss) / abs(ref_loss))
    mine = pm.plan.stage_of_rank(torch.distributed.get_rank())
    held = held_bytes(pm, opt)  # before full_state_dict, which allocates nothing it keeps
    units = pm.runner.gradsync.units.units
    gathers = sum(u.gathers for u in units)  # ZeRO-3: all-gathers of units in 3 steps
    prefetched = dict(pm.runner.gradsync.units.prefetched)  # of them, issued ahead of their use
    peaks = {"step": pm.runner.gradsync.units.peak_bytes, "forward": _forward_peak(pm, batch)}
    full = pm.full_state_dict()
    ref_state = {k: r.model.state_dict() for k, r in refs.items()}
    param_err = {k: max(rel(full[n], v) for n, v in sd.items()) for k, sd in ref_state.items()}
    mixed_vs_fp32 = max(rel(ref_state["same"][n], v) for n, v in ref_state["fp32"].items())
    return {"loss": loss, "loss_err": loss_err, "param_err": param_err, "mixed_vs_fp32": mixed_vs_fp32,
            "held": held, "predicted": {k: mine.predicted[f"state_{k}"] for k in held},
            "events": list(pm.runner.gradsync.events), "zero": sorted(set(mine.zero.values())),
            "buckets": len(pm.runner.gradsync.buckets), "units": len(units), "gathers": gathers,
            "prefetched": prefetched, "prefetch_nodes": _count_children(pm, "zero3_prefetch_"),
            "leaf_dtypes": sorted({str(t.dtype) for u in units for t in u.leaves}),
            "gathered_peak": peaks, "predicted_transient": mine.predicted.get("zero3_transient", 0.0),
            "regions": _count_children(pm, "recompute_")}


def zero3_budget(model, batch, cluster, precision: str, plan_options: dict):
    """``cluster`` with the memory halfway between what the plan needs with every parameter at ZeRO 2 and at
    ZeRO 3: zero="auto" must then choose level 3 for some parameters (the "auto" cases)."""
    at = [autopar.plan(model, cluster, batch, precision=precision, zero=z, bucket_bytes=BUCKET_BYTES,
                       **plan_options).predicted["peak_memory"] for z in (2, 3)]
    assert at[1] < at[0], at
    return cluster.with_memory(sum(at) / 2)


def _count_children(pm, prefix: str) -> int:
    return sum(1 for name, _ in pm.runner.gm.named_children() if name.startswith(prefix))


def _forward_peak(pm, batch) -> float:
    """Most bytes of ZeRO-3 units gathered at once in one forward without gradients (every microbatch's)."""
    units = pm.runner.gradsync.units
    units.peak_bytes = units.gathered_bytes
    with torch.no_grad():
        pm(*batch)
    return float(units.peak_bytes)


def overflow_case(model_name: str = "gpt") -> dict:
    """fp16, ZeRO 1: an inf put into one rank's gradient at step 2 must make every rank skip that step and
    halve the scale; the parameters stay as they were."""
    model, batch = FACTORIES[model_name]()
    pm = autopar.compile(model, autopar.Cluster.local(4, mesh_shape=(2, 2)), batch, precision="fp16", zero=1,
                         bucket_bytes=BUCKET_BYTES, **options(model_name, "dp"))
    opt = pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    record = []
    for step in range(3):
        pm.train_step(*batch)
        if step == 1 and torch.distributed.get_rank() == 2:
            next(p for g in opt.param_groups for p in g["params"] if p.grad is not None).grad.view(-1)[0] = float("inf")
        before = {k: v.clone() for k, v in pm.state_dict().items()}
        scale, skipped = pm.runner.scaler.scale, pm.runner.scaler.skipped
        opt.step()
        stepped = pm.runner.scaler.skipped == skipped
        opt.zero_grad()
        unchanged = all(torch.equal(before[k], v) for k, v in pm.state_dict().items())
        record.append({"stepped": stepped, "scale_before": scale, "scale_after": pm.runner.scaler.scale,
                       "unchanged": unchanged})
    return {"steps": record}


def run_all(rank: int, cases: list) -> dict:
    out = {}
    for case in cases:
        undo = _sabotage(case[-1])
        try:
            out[case] = run_case(case)
        finally:
            undo()
    out["overflow"] = overflow_case()
    out["zero3_checkpoint"] = zero3_checkpoint_case(tempfile.gettempdir())
    return out


def zero3_checkpoint_case(scratch: str) -> dict:
    """ZeRO-3 and pm.save/load (model state): GPT dp at level 3 trains 2 steps and saves; a module compiled
    from other weights at level 3 (and one at level 0) loads it, and one more step with a fresh AdamW must
    give what the saving module gives. Negative control: at level 3 with the loaded values never folded into
    the shards (``Unit.absorb`` off) the step starts from the other weights' shards."""
    rank = torch.distributed.get_rank()
    box = [os.path.join(scratch, f"autopar-zero3-{os.getpid()}") if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    model, batch = FACTORIES["gpt"]()
    pm = _zero3_module(model, batch, 3)
    opt = pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    for _ in range(2):
        pm.train_step(*batch)
        opt.step()
        opt.zero_grad()
    pm.save(box[0])
    saved = pm.full_state_dict()
    local = pm.state_dict()  # copies: the units it gathered are freed by the next forward
    with torch.no_grad():
        pm(*batch)
    keys = {info.name: info.fqn for info in pm._graph.placeholders if info.fqn in saved}
    out = {"state_dict_err": max(rel(v, saved[keys[k.rsplit(".", 1)[-1]]]) for k, v in local.items()
                                 if k.rsplit(".", 1)[-1] in keys)}
    expected = _one_fresh_step(pm, batch)
    other, _ = FACTORIES["gpt"](seed=1)
    for name, level, absorb in (("z3", 3, zero3.Unit.absorb), ("z0", 0, zero3.Unit.absorb),
                                ("z3_no_absorb", 3, lambda unit: setattr(unit, "dirty", False))):
        original, zero3.Unit.absorb = zero3.Unit.absorb, absorb
        try:
            loaded = _zero3_module(other, batch, level)
            loaded.load(box[0])
            out[f"load_err_{name}"] = max(rel(v, saved[k]) for k, v in loaded.full_state_dict().items())
            after = _one_fresh_step(loaded, batch)
        finally:
            zero3.Unit.absorb = original
        out[f"step_err_{name}"] = max(rel(v, expected[k]) for k, v in after.items())
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(box[0], ignore_errors=True)
    return out


def _zero3_module(model, batch, level: int):
    return autopar.compile(model, autopar.Cluster.local(4, mesh_shape=(2, 2)), batch, zero=level,
                           bucket_bytes=BUCKET_BYTES, **options("gpt", "dp"))


def _one_fresh_step(pm, batch) -> dict:
    opt = pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    pm.train_step(*batch)
    opt.step()
    return pm.full_state_dict()


def _sabotage(kind):
    if kind == "gather":
        return _sabotage_gather()
    if kind == "prefetch":
        return _sabotage_prefetch()
    if kind != "sync":
        return lambda: None
    original = gradsync._start

    def broken(what, key, fn, *args, **kw):
        args = (args[0].clone(),) if what == "all_reduce" else (args[0], torch.zeros_like(args[1]))
        return original(what, key, fn, *args, **kw)

    gradsync._start = broken
    return lambda: setattr(gradsync, "_start", original)


def _sabotage_gather():
    """ZeRO-3's negative control: every unit all-gather leaves the other ranks' shards zero."""
    original = zero3.all_gather_flat

    def own_shard_only(out, shard, group=None, async_op=False):
        out.zero_()
        lo = torch.distributed.get_rank(group) * shard.numel()
        out[lo:lo + shard.numel()].copy_(shard)
        return _Done() if async_op else None

    zero3.all_gather_flat = own_shard_only
    return lambda: setattr(zero3, "all_gather_flat", original)


def _sabotage_prefetch():
    """ZeRO-3's prefetch negative control: every all-gather issued ahead of its use (forward and backward
    prefetch) sends the shard of the wrong unit (the next one, cut or zero-padded to this unit's shard)."""
    original = zero3.Unit.prefetch

    def wrong_unit(unit):
        other = unit.registry.units[(unit.index + 1) % len(unit.registry.units)].bucket.shard.detach()
        own = unit.bucket.shard
        fake = torch.zeros_like(own.detach())
        n = min(fake.numel(), other.numel())
        fake[:n] = other[:n]
        unit.bucket.shard = fake
        try:
            original(unit)
        finally:
            unit.bucket.shard = own

    zero3.Unit.prefetch = wrong_unit
    return lambda: setattr(zero3.Unit, "prefetch", original)


class _Done:
    """The work handle of a collective that completed when it was issued."""

    def wait(self, timeout=None) -> bool:
        return True
