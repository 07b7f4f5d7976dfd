"""``pm.step_stats()``: throughput, step time and MFU of the training steps a ``ParallelModule`` has run.

What is measured: wall-clock seconds between the starts of consecutive ``train_step`` calls on this rank
(``time.perf_counter``), so a step's interval holds everything the training loop does between two calls
(``train_step``, the optimizer step, zero_grad, loading the next batch, logging), as a training log's
step time does. The first ``warmup`` intervals (default 1: the first step compiles under compile=True,
and allocates everywhere) are left out; the step time is the mean of the rest (total / count: on a GPU the
host may run ahead of the device for a step or two, and a mean over the window still equals the device's
pace, where single intervals need not). The last ``WINDOW`` intervals are kept.

    tokens/s   = tokens per step / step time    (tokens: the elements of the first integer input of two or
                 more dims, e.g. input_ids [B, S]; a model without one reports samples/s: dim 0 of its first
                 tensor input)
    model FLOPs per step = microbatches × forward + backward FLOPs of the captured graph (one microbatch at
                 global shapes), counted once by ``torch.utils.flop_counter`` on meta tensors: the model's
                 FLOPs, not recompute's extra forward (the MFU convention)
    MFU        = model FLOPs per step / step time / (peak FLOP/s per device × devices), the peak of the
                 plan's cluster for the precision policy's compute dtype (float32 for fp32 plans).
"""
from __future__ import annotations

import collections
import time

import torch
import torch.utils._pytree as pytree

from autopar.errors import UsageError

WINDOW = 1000
_COMPUTE_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class StepClock:
    """The start times of the last ``WINDOW`` + 1 ``train_step`` calls."""

    def __init__(self):
        self.starts: collections.deque = collections.deque(maxlen=WINDOW + 1)
        self.calls = 0

    def tick(self) -> None:
        self.starts.append(time.perf_counter())
        self.calls += 1

    def intervals(self, warmup: int) -> list[float]:
        times = list(self.starts)
        gaps = [b - a for a, b in zip(times, times[1:])]
        skipped = max(0, warmup - (self.calls - len(times)))  # warm-up intervals still in the window
        return gaps[skipped:]


def model_flops(graph, microbatches: int) -> tuple[float, str]:
    """(forward + backward FLOPs of one training step of the whole model, how they were counted): the
    captured graph run once on meta tensors under ``torch.utils.flop_counter.FlopCounterMode``, backward
    from the floating outputs, times the microbatches. Where flop_counter cannot count the whole graph (an
    op whose formula refuses its shapes, e.g. grouped-query SDPA on torch 2.11): 3 × the forward FLOPs
    counted op by op, attention by its formula 4·B·H·Sq·Skv·D (backward = 2 × forward, the usual convention)."""
    from torch.utils.flop_counter import FlopCounterMode

    kinds = {p.name: p.kind for p in graph.placeholders}
    args = []
    for node in graph.gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        requires_grad = kinds.get(node.name) == "parameter"
        args.append(_meta(val, requires_grad) if isinstance(val, torch.Tensor) else val)
    try:
        with FlopCounterMode(display=False) as counter:
            outs = [o for o in pytree.tree_leaves(graph.gm(*args)) if isinstance(o, torch.Tensor) and o.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        return float(microbatches * counter.get_total_flops()), "flop_counter, forward + backward"
    except Exception as e:  # noqa: BLE001 - fall back to the per-op count, saying so
        forward = sum(_op_forward_flops(n) for n in graph.gm.graph.nodes if n.op == "call_function")
        return float(microbatches * 3 * forward), f"3 x forward per op (whole-graph count failed: {type(e).__name__})"


def _meta(val: torch.Tensor, requires_grad: bool = False) -> torch.Tensor:
    t = torch.empty(val.shape, dtype=val.dtype, device="meta")
    return t.requires_grad_(requires_grad and val.dtype.is_floating_point)


def _op_forward_flops(node) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    vals = [a.meta.get("val") for a in node.args if hasattr(a, "meta")]
    if "scaled_dot_product" in str(node.target) and len(vals) >= 3:
        (b, h, sq, d), skv = vals[0].shape[-4:], vals[1].shape[-2]
        return 4.0 * b * h * sq * skv * d
    try:
        args, kwargs = pytree.tree_map(lambda a: _meta(a.meta["val"]) if hasattr(a, "meta") and isinstance(
            a.meta.get("val"), torch.Tensor) else a, (node.args, node.kwargs))
        with FlopCounterMode(display=False) as counter:
            node.target(*args, **kwargs)
        return float(counter.get_total_flops())
    except Exception:  # noqa: BLE001 - an op meta tensors cannot run: counted as 0
        return 0.0


def work_per_step(inputs: list) -> tuple[str, int]:
    """("tokens", count) from the first integer input of 2+ dims, else ("samples", its batch size)."""
    for shape, dtype in inputs:
        integer = dtype.replace("torch.", "") in ("int64", "int32", "int16", "int8", "uint8")
        if len(shape) >= 2 and integer:
            return "tokens", int(torch.Size(shape).numel())
    first = next((shape for shape, _ in inputs if len(shape) >= 1), None)
    return "samples", int(first[0]) if first else 1


def peak_flops(plan) -> tuple[float, str]:
    """(peak FLOP/s per device, dtype name) of the plan's cluster for its compute dtype."""
    dtype = _COMPUTE_DTYPE.get(plan.precision, "float32")
    peaks = plan.cluster.get("peak_flops", {})
    value = peaks.get(dtype) or peaks.get("float32") or max(peaks.values(), default=0.0)
    return float(value), dtype


def step_stats(clock: StepClock, plan, flops: float, warmup: int = 1, counted: str = "given") -> dict:
    """The figures of the module docstring from ``clock``'s intervals; UsageError before there are any."""
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise UsageError(f"step_stats(warmup={warmup!r}): warmup is how many first intervals to leave out, an int >= 0")
    gaps = clock.intervals(warmup)
    if not gaps:
        raise UsageError(f"step_stats() measures between consecutive train_step calls: {clock.calls} call(s) so far, "
                         f"and {warmup} warm-up interval(s) are left out; run at least {warmup + 2} train_steps "
                         f"first (or pass warmup=0)")
    step_time = sum(gaps) / len(gaps)
    unit, work = work_per_step(plan.input_signature)
    peak, dtype = peak_flops(plan)
    devices = plan.num_devices
    achieved = flops / step_time
    return {"steps": len(gaps), "step_time": step_time, f"{unit}_per_step": work, f"{unit}_per_s": work / step_time,
            "model_flops": flops, "flops_counted": counted, "flops_per_s": achieved, "peak_flops": peak,
            "peak_dtype": dtype,
            "devices": devices, "mfu": achieved / (peak * devices) if peak > 0 else None,
            "measures": "wall-clock between the starts of consecutive train_step calls"}
