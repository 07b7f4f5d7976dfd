"""Cases for tests/test_precision.py: every one runs in each rank of one 4-rank ``autopar.launch``.

A case is (model, layout, precision, zero, sabotage). Layouts: "dp" (one 2×2 stage, parameters pinned
replicated, the batch split over both axes: every parameter's gradient goes through the bucketed sync),
"tp" (one 2×2 stage: Megatron's tensor parallelism on axis 1, the batch and ZeRO on axis 0) and "pp"
(2 stages × 2 devices, 4 microbatches, 1F1B). Each case trains 3 AdamW steps with ``pm.optimizer`` on
the sharded module, and the same on single-device copies: one under the same precision policy (autocast,
and ``torch.amp.GradScaler`` for fp16), one in fp32. It reports the loss and parameter errors against both,
the bytes of parameters, gradients and optimizer state this rank holds (counted from the tensors: distinct
storages), the plan's prediction of them, and the gradient sync's events.

Sabotage "sync": every bucket's all-reduce runs on a copy of its buffer, and every reduce-scatter on
zeros, so no rank gets the reduced gradients (the negative control of the bucketed, overlapped sync).
"""
import copy

import torch

import autopar
from autopar.runtime import gradsync
from tests.models import FACTORIES
from tests.parity import rel

LR, EPS, STEPS = 1e-3, 1e-6, 3
BUCKET_BYTES = 20000  # several buckets even for the small test models, so overlap is visible
PIPE = [{"layers": [0, 0], "submesh": [1, 2]}, {"layers": [1, 1], "submesh": [1, 2]}]
DP_PINS = {"gpt": ("idx", "targets"), "zoo_llama": ("input_ids", "labels")}
# Megatron's layout on mesh axis 1 (column-parallel q/k/v/gate/up, row-parallel o/down), batch over axis 0
TP_PINS = {"zoo_llama": {**{f"p_*_{w}_proj_weight": "RS(0)" for w in ("q", "k", "v", "gate", "up")},
                         "p_*_o_proj_weight": "RS(1)", "p_*_down_proj_weight": "RS(1)",
                         "input_ids": "S(0)R", "labels": "S(0)R"}}


def options(model_name: str, layout: str) -> dict:
    if layout == "dp":
        a, b = DP_PINS[model_name]
        return {"stages": 1, "pin": {"p_*": "RR", a: "S(0)S(0)", b: "S(0)S(0)"}}
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
    return {"params": total(params), "grads": total([p.grad for p in params + opt.targets]),
            "optimizer": total([v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)])}


def run_case(case) -> dict:
    model_name, layout, precision, zero, sabotage = case
    model, batch = FACTORIES[model_name]()
    refs = {"same": _Reference(model, precision), "fp32": _Reference(model, "fp32")}
    cluster = autopar.Cluster.local(4, mesh_shape=(2, 2))
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
    full = pm.full_state_dict()
    ref_state = {k: r.model.state_dict() for k, r in refs.items()}
    param_err = {k: max(rel(full[n], v) for n, v in sd.items()) for k, sd in ref_state.items()}
    mixed_vs_fp32 = max(rel(ref_state["same"][n], v) for n, v in ref_state["fp32"].items())
    return {"loss": loss, "loss_err": loss_err, "param_err": param_err, "mixed_vs_fp32": mixed_vs_fp32,
            "held": held, "predicted": {k: mine.predicted[f"state_{k}"] for k in held},
            "events": list(pm.runner.gradsync.events), "zero": sorted(set(mine.zero.values())),
            "buckets": len(pm.runner.gradsync.buckets)}


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
            next(p for p in opt.targets if p.grad is not None).grad.view(-1)[0] = float("inf")
        before = {k: v.clone() for k, v in pm.state_dict().items()}
        scale = pm.runner.scaler.scale
        stepped = opt.step()
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
    return out


def _sabotage(kind):
    if kind != "sync":
        return lambda: None
    original = gradsync._start

    def broken(what, key, fn, *args, **kw):
        args = (args[0].clone(),) if what == "all_reduce" else (args[0], torch.zeros_like(args[1]))
        return original(what, key, fn, *args, **kw)

    gradsync._start = broken
    return lambda: setattr(gradsync, "_start", original)
