"""Planner options (``PlanOptions``, accepted by ``autopar.plan`` and ``autopar.compile`` as keywords), the
checks that make a bad option one clear ``PlanError`` before any planning, and the microbatch split they imply.

Invariant: every field is checked when a ``PlanOptions`` is made (``_check_fields``: type and range, one
``OptionError`` naming the option, the value and the valid values); an unknown name is refused with the
closest known one (``plan_options``); globs (``pin``, ``zero``, ``recompute``) that match nothing in the
model and more stages than devices are refused once the graph is known (``check_against_graph``).
"""
from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import math
import warnings

from autopar.cost_models.experts import check_expert_routing, check_routing_against_graph
from autopar.cost_models.memory import OPTIMIZER_STATE_BYTES, TrainingSpec, zero_levels
from autopar.errors import OptionError, PlanError
from autopar.ir.buffer_writes import written_buffers
from autopar.ir.graph import ModelGraph
from autopar.ir.precision import resolve as resolve_precision
from autopar.passes.interleave import check_schedule
from autopar.passes.recompute import check_policy
from autopar.placement import parse_spec

SCHEDULES = ("1f1b", "gpipe", "interleaved", "auto")
MAX_MICROBATCHES = 512


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """Planner settings.

    optimizer: training optimizer, for memory (see cost_models.memory.OPTIMIZER_STATE_BYTES).
    time_limit: seconds each ILP may take; the best solution found by then is used.
    pin: {node-name glob: spec text}: fix those nodes' output specs (e.g. {"idx": "S(0)R", "p_*": "RR"}
      forces data parallelism); the planner fills in everything else. See ``apply_pins``.
    stages: None lets the DP choose; an int forces that many stages (1: one stage on the cluster's
      ``mesh_shape``, no DP); a list of {"layers": [first, last], "submesh": [nodes, devices per node],
      "mesh": [a, b] (optional logical mesh)} fixes the stages and the planner fills in the rest.
    microbatches: B; None lets the planner choose among powers of two that divide the batch.
    schedule: "auto" (default: 1F1B or interleaved, whichever the schedule simulator predicts faster within
      memory; see ``passes.interleave``), "1f1b", "gpipe" or "interleaved" (Megatron's interleaved 1F1B:
      each device holds ``virtual_stages`` model chunks, round robin). The plan records "1f1b",
      "gpipe" or "interleaved" and ``virtual_stages``.
    virtual_stages: model chunks per device for "interleaved"/"auto"; None lets the planner choose. A manual
      stage list for "interleaved" lists all pp·v chunks (chunk j on the submesh of chunk j mod pp).
    layers: how many layers the DP cuts the model into (default: one per repeated block, at most 16).
    debug: check each pass's output invariants after it runs (slower; see ``autopar.planner.invariants``).
    recompute: "auto" (the stage DP chooses, per stage, which layers recompute their activations in
      backward), "none", "full", or {layer glob: "none" | "full" | "selective" | "auto"}; see
      ``passes.recompute``. The plan records the choice per stage (``Stage.recompute``).
    precision: "fp32" (default), "bf16" or "fp16", or an ``autopar.ir.precision.PrecisionPolicy``.
    zero: weight-update sharding over each parameter's data-parallel axes: "auto" (default: the ILP
      chooses level 0 or 2 per parameter, see ``passes.intra_op_zero``), 0, 1, 2, 3 for every parameter, or
      {parameter-fqn glob: level} (forced where a glob matches, chosen elsewhere; see ``cost_models.memory``).
    bucket_bytes: gradient sync bucket size (DDP's bucket_cap_mb), bytes.
    offload: CPU offload, a memory lever (``cost_models.offload``): "none" (default), "auto" (optimizer
      offload chosen per pipeline stage by the stage DP; with stages=1 or a manual stage list, the faster
      feasible plan of with and without it on every stage: ``planner.offload_choice``), or
      {"optimizer": bool, "activations": bool} to force it: optimizer state and fp32 master weights in host
      memory with the step on the host (ZeRO-Offload), and/or activations saved for backward kept in host
      memory (``torch.autograd.graph.save_on_cpu``). The plan records what it uses in ``plan.planner["offload"]``.
    expert_routing: None (uniform routing) or a measured routing histogram of the MoE layers, one number per
      expert (shares or token counts; normalized), used by the pricing of expert parallelism
      (``cost_models.experts``: tokens that cross devices, the busiest expert shard's work). The plan records
      the shares in ``plan.planner["expert_routing"]``.
    """

    optimizer: str = "adamw"
    time_limit: float = 60.0
    pin: dict[str, str] | None = None
    stages: int | list | None = None
    microbatches: int | None = None
    schedule: str = "auto"
    virtual_stages: int | None = None
    layers: int | None = None
    debug: bool = False
    recompute: str | dict = "auto"
    precision: object = "fp32"
    zero: object = "auto"
    bucket_bytes: int = 25 * 2 ** 20
    offload: object = "none"
    expert_routing: object = None

    def __post_init__(self):
        _check_fields(self)
        check_expert_routing(self.expert_routing)
        resolve_precision(self.precision)
        check_zero(self.zero)
        check_policy(self.recompute)
        check_schedule(self.schedule, self.virtual_stages, self.stages)


ZERO_LEVELS = (0, 1, 2, 3)


def plan_options(options: dict, also: tuple[str, ...] = ()) -> PlanOptions:
    """``PlanOptions(**options)``; an unknown name is one OptionError naming the closest known option
    (``also``: the calling function's own keywords, listed as known)."""
    known = [f.name for f in dataclasses.fields(PlanOptions)]
    for name in options:
        if name in ("memory_per_device", "mesh_shape", "nodes", "device_type"):
            raise OptionError(f"{name} is an argument of the cluster, not a planner option: describe it there, e.g. "
                              f"autopar.Cluster.local(n, {name}=...) or Cluster.preset(name, nodes=...)")
        if name not in known:
            close = difflib.get_close_matches(name, known + list(also), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise OptionError(f"unknown option {name!r}{hint}; the planner options are {known}"
                              + (f", and {list(also)}" if also else ""))
    return PlanOptions(**options)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


_VALID = {
    "optimizer": f"one of {sorted(OPTIMIZER_STATE_BYTES)}",
    "time_limit": "a positive number of seconds",
    "pin": "None or a dict {node-name glob: spec text}, e.g. {'p_*': 'RR'}",
    "stages": "None (the planner chooses), a positive int, or a list of {'layers': [first, last], "
              "'submesh': [nodes, devices per node]}",
    "microbatches": "None (the planner chooses) or a positive int",
    "schedule": f"one of {list(SCHEDULES)}",
    "layers": "None (one per repeated block) or a positive int",
    "debug": "True or False",
    "bucket_bytes": "a positive number of bytes, e.g. 25 * 2**20",
    "offload": "'none', 'auto' or a dict with 'optimizer' and/or 'activations' set to True or False",
}
_CHECKS = {
    "optimizer": lambda v: isinstance(v, str) and v in OPTIMIZER_STATE_BYTES,
    "time_limit": lambda v: _is_number(v) and v > 0,
    "pin": lambda v: v is None or (isinstance(v, dict) and all(isinstance(k, str) and isinstance(s, str)
                                                                for k, s in v.items())),
    "stages": lambda v: v is None or _is_count(v) or (isinstance(v, (list, tuple)) and len(v) > 0
                                                      and all(isinstance(e, dict) for e in v)),
    "microbatches": lambda v: v is None or _is_count(v),
    "schedule": lambda v: isinstance(v, str) and v in SCHEDULES,
    "layers": lambda v: v is None or _is_count(v),
    "debug": lambda v: isinstance(v, bool),
    "bucket_bytes": lambda v: _is_number(v) and v > 0,
    "offload": lambda v: v in ("none", "auto") if isinstance(v, str) else (
        isinstance(v, dict) and len(v) > 0 and set(v) <= {"optimizer", "activations"}
        and all(isinstance(x, bool) for x in v.values())),
}


def offloaded(options: PlanOptions) -> dict[str, bool]:
    """What a forced ``offload`` moves to host memory: {"optimizer": bool, "activations": bool} ("none" and
    "auto" force nothing; the driver resolves "auto" by planning both ways)."""
    forced = options.offload if isinstance(options.offload, dict) else {}
    return {"optimizer": bool(forced.get("optimizer")), "activations": bool(forced.get("activations"))}


def _check_fields(options: PlanOptions) -> None:
    """One OptionError for the first field whose value has the wrong type or range (``_VALID``)."""
    for name, valid in _CHECKS.items():
        value = getattr(options, name)
        if not valid(value):
            raise OptionError(f"{name}={value!r} is not a valid value of option {name!r}; use {_VALID[name]}")
    for glob, spec in (options.pin or {}).items():
        try:
            parse_spec(spec)
        except ValueError as e:
            raise OptionError(f"pin={{{glob!r}: {spec!r}}}: {e}; a spec has one entry per mesh axis, e.g. 'S(0)R' "
                              f"(dim 0 split over axis 0) or 'RR' (replicated)") from None


def check_against_graph(graph: ModelGraph, num_devices: int, options: PlanOptions) -> None:
    """OptionError for a ``pin`` or ``zero`` glob that matches nothing in ``graph``, or for more stages than
    devices (each stage needs a device of its own). ``recompute`` globs: ``passes.recompute.layer_modes``."""
    names = [n.name for n in graph.gm.graph.nodes]
    check_routing_against_graph(graph, check_expert_routing(options.expert_routing))
    for glob in options.pin or {}:
        if not any(fnmatch.fnmatchcase(name, glob) for name in names):
            raise OptionError(f"pin glob {glob!r} matches no node of the graph; node names look like "
                              f"{_examples(names)} (parameters 'p_<fqn with _>', inputs by forward's argument "
                              f"names; see plan.summary() or autopar show)")
    if isinstance(options.zero, dict):
        params = [(p.fqn, p.name) for p in graph.placeholders if p.kind == "parameter"]
        for glob in options.zero:
            if not any(fnmatch.fnmatch(fqn, glob) or fnmatch.fnmatch(name, glob) for fqn, name in params):
                raise OptionError(f"zero glob {glob!r} matches no parameter; parameter names look like "
                                  f"{_examples([fqn for fqn, _ in params])}")
    if isinstance(options.stages, int) and options.stages > num_devices:
        raise OptionError(f"stages={options.stages} needs at least {options.stages} devices (one per pipeline "
                          f"stage), but the cluster has {num_devices}; use stages between 1 and {num_devices}, or "
                          f"stages=None to let the planner choose")


def _examples(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")


def check_zero(zero) -> None:
    """``zero``: "auto", a level, or {glob: level}; PlanError otherwise."""
    levels = list(zero.values()) if isinstance(zero, dict) else [zero]
    if zero == "auto" or (levels and all(isinstance(v, int) and not isinstance(v, bool) and v in ZERO_LEVELS
                                         for v in levels)):
        return
    raise OptionError(f"zero={zero!r} is not a ZeRO setting; use 'auto', one of {list(ZERO_LEVELS)} or "
                    f"{{parameter-fqn glob: level}} (1: optimizer state sharded, 2: and gradients, 3: and "
                    f"parameters between uses)")


def training_spec(graph: ModelGraph, options: PlanOptions) -> TrainingSpec:
    """The memory model's view of ``options``: optimizer, forced ZeRO levels, autocast's weight copies."""
    policy = resolve_precision(options.precision)
    names = {p.name: p.fqn for p in graph.placeholders if p.kind == "parameter"}
    copy = policy.compute_dtype.itemsize if policy.compute_dtype is not None else 0
    return TrainingSpec(optimizer=options.optimizer, zero=tuple(sorted(zero_levels(options.zero, names).items())),
                        zero_search=not isinstance(options.zero, int), compute_itemsize=copy,
                        bucket_bytes=float(options.bucket_bytes), host_optimizer=offloaded(options)["optimizer"],
                        host_activations=offloaded(options)["activations"],
                        expert_routing=check_expert_routing(options.expert_routing))


def microbatch_candidates(graph: ModelGraph, options: PlanOptions) -> list[int]:
    """The user's B, or powers of two up to 512 that split the batch (dim 0 of the first input); only 1 for a
    model that writes buffers in forward (``ir.buffer_writes``), unless the user gives B, with a warning."""
    if options.schedule not in SCHEDULES:
        raise PlanError(f"schedule {options.schedule!r} is not known; use one of {list(SCHEDULES)}")
    batch = graph.input_signature[0][0][0] if graph.input_signature and graph.input_signature[0][0] else 1
    if options.microbatches is not None:
        if not isinstance(options.microbatches, int) or options.microbatches < 1 or batch % options.microbatches:
            raise PlanError(f"microbatches={options.microbatches!r} does not split the batch of {batch} evenly; "
                            f"choose a divisor of {batch}")
        if options.microbatches > 1 and written_buffers(graph):
            warnings.warn(f"microbatches={options.microbatches}: the model writes buffers in forward "
                          f"({written_buffers(graph)[:3]}), which then update once per microbatch "
                          f"({options.microbatches} times per step, on smaller batches), unlike one device",
                          stacklevel=2)
        return [options.microbatches]
    if written_buffers(graph):
        warnings.warn(f"the model writes buffers in forward ({written_buffers(graph)[:3]}): planned with one "
                      f"microbatch so they update once per step as on one device (pass microbatches=N to allow "
                      f"pipelining them; they then update N times per step)", stacklevel=2)
        return [1]
    return [b for b in (2 ** k for k in range(10)) if b <= min(batch, MAX_MICROBATCHES) and batch % b == 0]


def first_microbatch(example_inputs, microbatches: int) -> tuple:
    """The first of ``microbatches`` equal slices of every input along dim 0 (the runtime's split)."""
    from autopar.passes.capture import normalize_inputs

    example_inputs = normalize_inputs(example_inputs)
    if microbatches == 1:
        return example_inputs
    for i, t in enumerate(example_inputs):
        if t.dim() == 0 or t.shape[0] % microbatches:
            raise PlanError(f"input {i} has shape {tuple(t.shape)}: its dim 0 does not split into "
                            f"{microbatches} microbatches; pass a batch divisible by {microbatches} or re-plan")
    return tuple(t.chunk(microbatches, dim=0)[0] for t in example_inputs)
