"""Parity harness: train a model sharded on a local gloo cluster and on one device, and compare.

Layouts: "auto" (one stage on the cluster's mesh, memory squeezed so the plan must shard), "dp" (one
stage, pinned data parallel), and pipelines: "pp2x2" (2 stages × 2 devices), "pp4x1" (4 × 1), "pp1+3"
(stages on 1 and 3 devices), each with a schedule ("1f1b" or "gpipe") and 4 (or 2) microbatches.

``tests/parity_launch.run_cases`` runs in every rank of one ``autopar.launch``; each case (``run_case``)
compiles a model for a mesh and a layout, takes 3 AdamW steps on both the sharded module and a single-device
copy, and reports the largest relative loss error over the steps and the largest relative parameter error
(‖a−b‖/‖b‖ per tensor) over
the parameters whose gradient is not zero up to round-off (``_with_gradient``): a zero-gradient parameter
only decays, and the round-off noise a sharded run gives such a gradient is not a parity signal. Likewise
single elements whose gradient at some step is the round-off of a cancellation (``_cancelled_elements``) are
left out, at most 1e-3 of all elements (beyond that every element is compared).

AdamW uses eps=1e-6 (a common setting): GPT-2's fused QKV bias has a key slice whose gradient is
analytically zero (softmax ignores a per-query constant). Its round-off noise differs with the reduction
order of any sharding, and eps=1e-8 turns that noise into full-size updates, which no parallel run can
reproduce; with eps=1e-6 such noise moves nothing.
"""
import copy
import pickle

import torch
import torch.distributed as dist

import autopar
from autopar.passes.capture import capture
from autopar.planner.driver import PlanOptions, memory_bounds
from autopar.runtime.compiled import compile_failures
from tests.models import FACTORIES
from tests.parity_sabotage import count_collectives

LR, EPS, STEPS = 1e-3, 1e-6, 3


def layout_options(layout: str, model_name: str, cluster, model, batch, recompute="none") -> tuple:
    """(cluster, plan options) for a layout: "auto" squeezes memory (with ``recompute``'s forced layers
    recomputing) so the plan must shard (ZeRO held out: it would buy the memory without sharding a tensor,
    and these suites step a torch optimizer over ``pm.parameters()``; tests/test_precision.py covers ZeRO);
    "dp" pins the batch split on every axis and replicated parameters;
    "ep" pins MoE expert weights split by expert and the grouped matmuls' and the expert activation's
    outputs to their experts' rows (EXPERT_ROWS: expert parallelism, the expert MLP without communication)."""
    if layout == "dp":
        replicated = "R" * len(cluster.mesh_shape)
        split = "".join("S(0)" if size > 1 else "R" for size in cluster.mesh_shape)
        return cluster, {"stages": 1, "pin": {"p_*": replicated, batch_pin_name(model_name, 0): split,
                                              batch_pin_name(model_name, 1): split}}
    if layout == "ep":  # expert parallel: every MoE expert weight split by experts on the widest axis
        axis = max(range(len(cluster.mesh_shape)), key=lambda a: cluster.mesh_shape[a])
        spec = "".join("S(0)" if a == axis else "R" for a in range(len(cluster.mesh_shape)))
        rows = "".join("P(rows)" if a == axis else "R" for a in range(len(cluster.mesh_shape)))
        return cluster, {"stages": 1, "pin": {"p_*experts*": spec, "grouped_mm_fallback*": rows, "silu*": rows}}
    if layout in EXPERT_SPLITS:
        return cluster, {"stages": 1, "pin": expert_split_pins(layout, cluster.mesh_shape, model_name)}
    if layout == "cp":
        return cluster, {"stages": 1, "pin": context_parallel_pins(model_name, cluster.mesh_shape)}
    if layout == "sp":
        return cluster, {"stages": 1, "pin": SEQUENCE_PARALLEL_GPT}
    floor, replicated = memory_bounds(capture(model, batch), cluster, PlanOptions(recompute=recompute, zero=0))
    return cluster.with_memory(floor + 0.3 * (replicated - floor)), {"stages": 1, "zero": 0}


PIPELINES = {
    "pp2x2": [{"layers": [0, 0], "submesh": [1, 2]}, {"layers": [1, 1], "submesh": [1, 2]}],
    "pp4x1": [{"layers": [k, k], "submesh": [1, 1]} for k in range(4)],
    "pp1+3": [{"layers": [0, 0], "submesh": [1, 1]}, {"layers": [1, 1], "submesh": [1, 3]}],
    "pp2x1": [{"layers": [k, k], "submesh": [1, 1]} for k in range(2)],
}


# Pipelines whose cross-stage values change sharding on the way (shard-to-shard transfers), pinned on the
# GPT example: (stages, pins). DP stages split the batch and replicate weights; the TP stage splits its MLP
# Megatron-style (fc by output rows, proj by input columns), so its output arrives Partial and is reduced
# before the send; "dp2>tp2" sends to a stage that replicates its input (each receiver gets half and the
# two all-gather it: ``shard_boxes.wire_spec``); "dp2>1+1" sends the batch halves of two ranks to one rank.
SHARD_TO_SHARD = {
    "dp2>dp2": (PIPELINES["pp2x2"], {"idx": "RS(0)", "targets": "RS(0)", "p_*": "RR"}),
    "tp2>dp2": (PIPELINES["pp2x2"], {"idx": "RR", "targets": "RS(0)", "p_blocks_0_mlp_fc_*": "RS(0)",
                                     "p_blocks_0_mlp_proj_weight": "RS(1)", "p_blocks_1_*": "RR", "p_lm_head*": "RR"}),
    "dp2>tp2": (PIPELINES["pp2x2"], {"idx": "RS(0)", "targets": "RR", "p_blocks_0_*": "RR", "p_wte*": "RR",
                                     "p_wpe*": "RR", "p_blocks_1_mlp_fc_*": "RS(0)",
                                     "p_blocks_1_mlp_proj_weight": "RS(1)"}),
    "dp2>1+1": ([{"layers": [0, 0], "submesh": [1, 2]}, {"layers": [1, 1], "submesh": [1, 1]},
                 {"layers": [2, 2], "submesh": [1, 1]}], {"p_*": "RR"}),
}
# Interleaved 1F1B: pp devices groups × v model chunks, chunk j on the submesh of chunk j mod pp.
INTERLEAVED = {
    "pp2x2v2": ([{"layers": [k, k], "submesh": [1, 2]} for k in range(4)], 2),
    "pp4x1v2": ([{"layers": [k, k], "submesh": [1, 1]} for k in range(8)], 2),
    "pp2x1v2": ([{"layers": [k, k], "submesh": [1, 1]} for k in range(4)], 2),
}


def pipeline_options(layout: str, cluster, model, batch, recompute="none", model_name: str = "") -> tuple:
    """("pp2x2-1f1b" ...) -> (cluster, options): manual stages, 4 microbatches, and for two-device stages a
    memory budget under which they must shard: 0.85 × the largest stage's memory in the plan made without a
    budget (where every stage replicates, data parallel being the cheapest on 2 CPU ranks). A fixed fraction
    of the whole model's memory would depend on the schedule (GPipe keeps 4 microbatches' activations,
    1F1B 2 or 1) and on the memory model, and leave no window that both forces and admits sharding."""
    shape, schedule = layout.split("-")
    if shape in INTERLEAVED:
        stages, v = INTERLEAVED[shape]
        return cluster, {"stages": stages, "schedule": schedule, "virtual_stages": v, "microbatches": 4,
                         "layers": len(stages)}
    if shape in SHARD_TO_SHARD:
        stages, pin = SHARD_TO_SHARD[shape]
        return cluster, {"stages": stages, "schedule": schedule, "microbatches": 4, "layers": len(stages), "pin": pin}
    if shape.endswith("a2a"):  # every stage's experts split by all-to-all on its own mesh
        stages = PIPELINES[shape.removesuffix("a2a")]
        return cluster, {"stages": stages, "schedule": schedule, "microbatches": 2, "layers": len(stages),
                         "zero": 0, "pin": expert_split_pins("a2a", tuple(stages[0]["submesh"]), model_name)}
    if shape == "pp2auto":  # the stage DP's own 2 stages, under a budget that only stage 0's offload meets
        options = {"stages": 2, "schedule": schedule, "microbatches": 2, "layers": 2, "zero": 0}
        free = autopar.plan(model, cluster, batch, **options, recompute=recompute)
        budget = sum(s.predicted["memory"] for s in free.stages) / 2  # between the two stages' needs
        return cluster.with_memory(budget), {**options, "offload": "auto"}
    stages = PIPELINES[shape]
    options = {"stages": stages, "schedule": schedule, "microbatches": 4, "layers": len(stages), "zero": 0}
    if shape == "pp2x2":  # ZeRO held out as in layout_options
        free = autopar.plan(model, cluster, batch, **options, recompute=recompute)
        cluster = cluster.with_memory(0.85 * max(s.predicted["memory"] for s in free.stages))
    return cluster, options


# Megatron's sequence parallelism on the GPT example: tensor-parallel blocks (q, k, v, fc by output rows; o, proj
# by input columns) with the residual stream between them split over the sequence.
SEQUENCE_PARALLEL_GPT = {"add_*": "RS(1)", "p_blocks_*_mlp_fc_*": "RS(0)", "p_blocks_*_mlp_proj_weight": "RS(1)",
                         "p_blocks_*_attn_[qkv]_*": "RS(0)", "p_blocks_*_attn_o_weight": "RS(1)"}


def context_parallel_pins(model_name: str, mesh_shape) -> dict[str, str]:
    """Context parallelism on the last mesh axis (data parallel on the first where it has devices): the tokens
    and every attention split over the sequence, parameters replicated; the rest is the planner's choice."""
    batch = "S(0)" if mesh_shape[0] > 1 else "R"
    return {batch_pin_name(model_name, 0): batch + "S(1)", "scaled_dot_product_attention*": batch + "S(2)",
            "p_*": "RR"}


EXPERT_SPLITS = {"a2a": "S(0)", "gather": "P", "etp": "P", "tokens": "S(0)"}  # the experts op's output there


def expert_split_pins(layout: str, mesh_shape, model_name: str) -> dict[str, str]:
    """The MoE experts op split on the last axis of more than one device: by experts, dispatching by
    all-to-all ("a2a": tokens split, out Shard(0)) or by the gathered tokens ("gather": out Partial); inside
    each expert ("etp", the GShard example's non-gated experts: hidden dim split, out Partial); or by tokens
    with the experts replicated ("tokens"). Another axis of more than one device splits the op's tokens
    (data parallel)."""
    axis = max(a for a, size in enumerate(mesh_shape) if size > 1)

    def on_axis(placement: str) -> str:
        return "".join(placement if a == axis else "R" for a in range(len(mesh_shape)))

    out = "".join(EXPERT_SPLITS[layout] if a == axis else "S(0)" if size > 1 else "R"
                  for a, size in enumerate(mesh_shape))
    if layout == "etp":
        return {"p_*ffn_w_in": on_axis("S(2)"), "p_*ffn_w_out": on_axis("S(1)"), "moe_experts*": out}
    weights = "p_*ffn_w_*" if model_name.startswith("moe_example") else "p_*experts_*"
    return {weights: on_axis("R" if layout == "tokens" else "S(0)"), "moe_experts*": out}


def batch_pin_name(model_name: str, i: int) -> str:
    names = {"mlp": ["x", "y"], "gpt": ["idx", "targets"], "hf_gpt2": ["input_ids", "labels"]}
    return names.get(model_name.split("_")[0], names["hf_gpt2"])[i]


def train_one_device(model, batches) -> tuple[list[float], dict]:
    """The single-device reference: AdamW(LR, EPS) over ``batches`` in order; (losses, final state dict)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for batch in batches:
        loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, copy.deepcopy(model.state_dict())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / (b.double().norm() + 1e-30))


def recompute_option(text: str):
    """The recompute option a layout's ":rc-" suffix names: "full", "none", or a layer glob to recompute."""
    return text if text in ("full", "none", "auto") else {text: "full"}


def run_case(model_name: str, mesh, layout: str, world: int) -> dict:
    """One case. A layout may carry flags after ":": "rc-<full | layer glob>" recomputes those layers in
    backward; "z<level>" forces that ZeRO level (the optimizer then comes from ``pm.optimizer``); "offopt" and
    "offact" offload the optimizer (stepped on host copies, from ``pm.optimizer``) and the activations; "ckpt"
    saves module and optimizer after step 2 and loads them into a module compiled from perturbed weights
    with a fresh optimizer, which takes step 3 ("ckpt-noopt": loads the module only, a negative control);
    "c" runs every generated module under torch.compile (``compile=True``) and records the graphs dynamo
    compiled by the end of each step ("graphs": a later step that compiles again is a recompile); "nograd"
    then runs the module once under torch.no_grad() and appends the count after it."""
    model, batch = FACTORIES[model_name]()
    reference = copy.deepcopy(model)
    cluster = autopar.Cluster.local(world, mesh_shape=mesh)
    layout, *flags = layout.split(":")
    rc = next((f[3:] for f in flags if f.startswith("rc-")), "")
    recompute = recompute_option(rc) if rc else "none"
    zero = next((int(f[1:]) for f in flags if f[:1] == "z" and f[1:].isdigit()), None)
    if layout.startswith("pp") or layout.split("-")[0] in SHARD_TO_SHARD:  # pipelines (interleaved: "pp...v2")
        def options_of_case():
            return pipeline_options(layout, cluster, model, batch, recompute, model_name)
    else:
        def options_of_case():
            return layout_options(layout, model_name, cluster, model, batch, recompute)
    key = (model_name, tuple(mesh), world, layout, rc)  # a negative control reuses its case's budget
    cluster, options = on_rank_zero(lambda: _remembered(key, options_of_case))
    options = {**options, "zero": zero} if zero is not None else options
    offload = {kind: True for kind, flag in (("optimizer", "offopt"), ("activations", "offact")) if flag in flags}
    options = {**options, "offload": offload} if offload else options
    compiled = "c" in flags
    if compiled:
        _inductor_in_a_fresh_cache()
    graphs_before = _dynamo_graphs()
    pm = autopar.compile(model, cluster, batch, **options, recompute=recompute, compile=compiled)
    opt = _optimizer(pm, zero or offload.get("optimizer") or "offload" in pm.plan.planner)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, eps=EPS)
    loss_err, moved, cancelled = 0.0, set(), {}
    counted = count_collectives()
    graphs = []
    for step in range(STEPS):
        if step == STEPS - 1 and any(f.startswith("ckpt") for f in flags):
            pm, opt = _round_trip(pm, opt, model_name, cluster, batch, {**options, "recompute": recompute}, zero,
                                  with_optimizer="ckpt" in flags)
        loss = pm.train_step(*batch)
        opt.step()
        opt.zero_grad()
        ref_loss = reference(*batch)
        ref_loss.backward()
        moved |= _with_gradient(reference)
        cancelled = _cancelled_elements(reference, cancelled)
        ref_opt.step()
        ref_opt.zero_grad()
        loss_err = max(loss_err, abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
        graphs.append(_dynamo_graphs() - graphs_before)
    comm_calls = counted()
    if "nograd" in flags:  # the recompile count's negative control: a no-grad call is another graph for dynamo
        with torch.no_grad():
            pm(*batch)
        graphs.append(_dynamo_graphs() - graphs_before)
    forward_err = None
    if pm.plan.virtual_stages > 1:  # inference through the chunks, after training: the trained model's loss
        with torch.no_grad():
            forward_err = abs(pm(*batch).item() - reference(*batch).item()) / abs(reference(*batch).item())
    full = pm.full_state_dict()
    kept = _compared_elements(cancelled)
    errors = {k: rel(full[k][kept[k]], v[kept[k]]) for k, v in reference.state_dict().items() if k in moved}
    worst = max(errors, key=errors.get)
    stages = pm.plan.stages
    return {"loss_err": loss_err, "param_err": errors[worst], "worst_param": worst, "loss": loss.item(),
            "compared_params": len(errors), "cancelled_elements": sum(int((~m).sum()) for m in kept.values()),
            "zero_grad_params": sorted(set(dict(reference.named_parameters())) - moved),
            "collectives": sum(len(s.collectives) for s in stages) + len(pm.plan.transfers),
            "collective_kinds": sorted({(c.kind, c.phase) for s in stages for c in s.collectives}),
            "sharded_params": sum(1 for s in stages for n, sh in s.shardings.items()
                                  if n.startswith("p_") and "S" in sh.out),
            "stages": [(s.submesh, s.mesh_shape, len(s.ranks)) for s in stages],
            "kernels": sorted({t for s in stages for sh in s.shardings.values() for _, t in sh.kernels}),
            "transfer_specs": [(_resolved_text(stages[t["src"]].shardings[t["value"]].out),
                                stages[t["dst"]].inputs[t["value"]]) for t in pm.plan.transfers],
            "microbatches": pm.plan.microbatches, "schedule": pm.plan.schedule,
            "virtual_stages": pm.plan.virtual_stages, "forward_err": forward_err,
            "wires": [t.get("wire") for t in pm.plan.transfers], "comm_calls": comm_calls[0],
            "replayed_comm_calls": comm_calls[1],
            "recompute": [s.recompute for s in stages], "regions": pm.code.count("recompute_"),
            "offload": pm.plan.planner.get("offload", {}),
            "zero": sorted({lvl for s in stages for lvl in s.zero.values()}),
            "graphs": graphs, "compile_failures": compile_failures(pm.runner),
            "keys_match": list(full) == list(reference.state_dict()),
            "shapes_match": all(full[k].shape == v.shape for k, v in reference.state_dict().items())}


def _dynamo_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (dynamo's own count)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


_INDUCTOR_DIR: list = []


def _inductor_in_a_fresh_cache() -> None:
    """Inductor's caches in a temporary directory of this process (removed at exit), compiling in-process:
    no run reuses an earlier run's kernels, and 2 cores shared by the ranks need no compile worker pools."""
    import atexit
    import os
    import shutil
    import tempfile

    import torch._inductor.config

    if not _INDUCTOR_DIR:
        _INDUCTOR_DIR.append(tempfile.mkdtemp(prefix="autopar-inductor-"))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_DIR[0]
        atexit.register(shutil.rmtree, _INDUCTOR_DIR[0], True)
    torch._inductor.config.compile_threads = 1


def _optimizer(pm, zero: int | None):
    """AdamW(LR, EPS) over the module; built by the module when ZeRO shards its state (``pm.optimizer``)."""
    if zero:
        return pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    return torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)


def _round_trip(pm, opt, model_name: str, cluster, batch, options: dict, zero, with_optimizer: bool) -> tuple:
    """pm.save (module and optimizer) into a directory all ranks share, then a module compiled from other
    weights (every parameter + 1) loads it, with a fresh optimizer that loads the saved state or not."""
    import os
    import shutil
    import tempfile

    rank = torch.distributed.get_rank()
    box = [tempfile.mkdtemp(prefix="autopar-parity-") if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    pm.save(box[0], opt)
    other, _ = FACTORIES[model_name]()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    loaded = autopar.compile(other, cluster, batch, **options)
    loaded_opt = _optimizer(loaded, zero)
    loaded.load(box[0], loaded_opt if with_optimizer else None)
    torch.distributed.barrier()
    if rank == 0 and os.path.isdir(box[0]):
        shutil.rmtree(box[0], ignore_errors=True)
    return loaded, loaded_opt


_OPTIONS: dict[tuple, bytes] = {}  # rank 0's (cluster, options) per case key, pickled: each use gets a copy


def _remembered(key: tuple, compute: callable):
    """``compute()``, computed once per key in this process; each call gets its own copy."""
    if key not in _OPTIONS:
        _OPTIONS[key] = pickle.dumps(compute())
    return pickle.loads(_OPTIONS[key])


def on_rank_zero(fn: callable):
    """``fn()`` computed on rank 0 and broadcast to every rank. For a case's memory budget and plan options:
    they are deterministic, so every rank computing them (a capture and an ILP, or a whole plan) would only
    give the same answer ``world`` times over on a machine whose cores the rest of the suite shares."""
    box = [fn() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _resolved_text(spec: str) -> str:
    """A sender's spec as it sends (Partial axes reduced first)."""
    return spec.replace("P", "R")


def _with_gradient(model) -> set[str]:
    """Parameters whose gradient is not zero up to fp32 round-off: norm above 1e-6 of the largest one. An
    attention key bias has an analytically zero gradient (softmax ignores a per-query constant); its
    round-off noise differs with any reduction order, and from a zero init that noise is all the tensor holds."""
    norms = {k: float(p.grad.norm()) for k, p in model.named_parameters() if p.grad is not None}
    top = max(norms.values(), default=0.0)
    return {k for k, n in norms.items() if n > 1e-6 * top}


def _cancelled_elements(model, seen: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``seen`` or'ed with the elements whose gradient this step is round-off of a cancellation: |g| nonzero
    and at most 1e-6 of the tensor's largest |g|. AdamW divides such a gradient by eps (lr/eps = 1000 here), so the
    round-off a different reduction order gives it (inductor's, a sharded sum's) becomes an update difference
    of ~1e-6 that no exact run can avoid."""
    out = dict(seen)
    for k, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.detach().abs()
            tiny = (g > 0) & (g <= 1e-6 * g.max())  # an exact zero (a token not in the batch) moves nothing
            out[k] = out[k] | tiny if k in out else tiny
    return out


def _compared_elements(cancelled: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{param: elements to compare}: all but the cancelled ones, unless those are more than 1e-3 of all
    elements (then all: a broken run must not hide behind many "cancelled" elements)."""
    total = sum(m.numel() for m in cancelled.values())
    dropped = sum(int(m.sum()) for m in cancelled.values())
    keep_all = dropped > 1e-3 * max(total, 1)
    return {k: torch.ones_like(m) if keep_all else ~m for k, m in cancelled.items()}
