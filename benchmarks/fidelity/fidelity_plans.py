"""The plans ``cost_model_fidelity.py`` measures: hand-forced layouts of the GPT example and the planner's own.

Each ``PlanSpec`` is a 2-D mesh of the local ranks plus pins (``PlanOptions.pin``: node-name glob -> spec
text) that force a layout, and further options; the planner fills in everything not pinned. There is one set
per world size: ``PLANS_2`` (one rank per core on this 2-core machine: the main figure) and ``PLANS_4`` (4
ranks time-sharing 2 cores: the second figure). Layouts:

  dp*         data parallel: the batch split on every mesh axis, every parameter replicated;
  tp*         Megatron tensor parallel: q, k, v, fc column-parallel (weight and bias Shard(0)), o and
              proj row-parallel (weight Shard(1)); embeddings, norms and lm_head replicated;
  tpv*        the same with a vocabulary-parallel wte (Shard(0)); lm_head stays replicated;
  dp2-tp2     2-D: batch split on mesh axis 0, Megatron on axis 1 (Megatron's DP x TP);
  tp2-dp2     the transpose: Megatron on axis 0, batch on axis 1;
  rep*        every node replicated: each rank runs the whole step alone (no communication at all);
  *-rc        the same layout with every layer recomputed in backward (recompute="full");
  dp-z2/z3    data parallel with the optimizer state and gradients (z2), and the parameters too (z3),
              sharded over the ranks (ZeRO);
  auto-RxC    no pins, one stage on that mesh: the planner's intra-op choice;
  auto        no pins, no stage count: everything the planner chooses (stages, submeshes, microbatches);
  pp2-*       ``autopar.plan(..., stages=2, schedule="1f1b")``, the planner's microbatches or 16 (pp2-B16);
  pp2-v2      the two stages interleaved (``schedule="interleaved", virtual_stages=2``), 8 microbatches.

Forced layouts and auto-RxC pass ``stages=1`` (one stage on the cluster's mesh). ``auto`` and ``pp2-*``
are skipped, with a note, by a planner whose ``PlanOptions`` has no ``stages`` (there ``auto`` is auto-1xN).
"""
from __future__ import annotations

import dataclasses

import autopar
from examples.gpt import GPTConfig, make_gpt

# Big enough that a step takes hundreds of ms on 4 ranks of a 2-core machine, so per-op overheads do
# not swamp the roofline terms; small enough that 8 plans x 9 rounds finish in a few minutes.
CONFIG = GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, n_embd=256)
BATCH = 16

COLUMN = ("attn_q", "attn_k", "attn_v", "mlp_fc")
ROW = ("attn_o", "mlp_proj")
UNBIASED = ("attn_k",)  # examples.gpt's key projection has no bias (a pin matching nothing is an error)
INPUTS = ("idx", "targets")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanSpec:
    """name: row label; mesh: logical mesh of the ranks; pin: PlanOptions.pin or None (auto);
    stages: PlanOptions.stages (1: one stage on ``mesh``; None: the planner chooses); options: the rest."""

    name: str
    mesh: tuple[int, int]
    pin: dict[str, str] | None = None
    stages: int | None = 1
    options: dict = dataclasses.field(default_factory=dict)  # more PlanOptions (recompute, zero, microbatches)


def _spec(mesh, **dims_by_axis) -> str:
    """Spec text with Shard(dim) on the given axes (``a0=dim``, ``a1=dim``) and Replicate elsewhere."""
    out = []
    for axis in range(len(mesh)):
        dim = dims_by_axis.get(f"a{axis}")
        out.append(f"S({dim})" if dim is not None and mesh[axis] > 1 else "R")
    return "".join(out)


def data_parallel(mesh) -> dict[str, str]:
    split = "".join("S(0)" if n > 1 else "R" for n in mesh)
    return {"p_*": "R" * len(mesh), **{name: split for name in INPUTS}}


def megatron(mesh, tp_axis: int, dp_axis: int | None, vocab: bool = False) -> dict[str, str]:
    """Megatron pins with tensor parallelism on ``tp_axis`` and the batch split on ``dp_axis``."""
    t = f"a{tp_axis}"
    batch = _spec(mesh, **({f"a{dp_axis}": 0} if dp_axis is not None else {}))
    pins = {"p_*": "R" * len(mesh), **{name: batch for name in INPUTS}}
    for layer in COLUMN:
        pins[f"p_blocks_*_{layer}_weight"] = _spec(mesh, **{t: 0})
        if layer not in UNBIASED:
            pins[f"p_blocks_*_{layer}_bias"] = _spec(mesh, **{t: 0})
    for layer in ROW:
        pins[f"p_blocks_*_{layer}_weight"] = _spec(mesh, **{t: 1})
    if vocab:
        pins["p_wte_weight"] = _spec(mesh, **{t: 0})
    return pins


# The 4-rank set: layouts of 4 processes sharing 2 cores (the second figure, see cost_model_fidelity).
PLANS_4 = [
    PlanSpec(name="dp-1x4", mesh=(1, 4), pin=data_parallel((1, 4))),
    PlanSpec(name="dp-2x2", mesh=(2, 2), pin=data_parallel((2, 2))),
    PlanSpec(name="tp-1x4", mesh=(1, 4), pin=megatron((1, 4), tp_axis=1, dp_axis=None)),
    PlanSpec(name="tpv-1x4", mesh=(1, 4), pin=megatron((1, 4), tp_axis=1, dp_axis=None, vocab=True)),
    PlanSpec(name="dp2-tp2", mesh=(2, 2), pin=megatron((2, 2), tp_axis=1, dp_axis=0)),
    PlanSpec(name="tp2-dp2", mesh=(2, 2), pin=megatron((2, 2), tp_axis=0, dp_axis=1)),
    PlanSpec(name="rep-1x4", mesh=(1, 4), pin={"*": "RR"}),
    PlanSpec(name="auto-1x4", mesh=(1, 4)),
    PlanSpec(name="auto-2x2", mesh=(2, 2)),
    PlanSpec(name="auto", mesh=(1, 4), stages=None),
    PlanSpec(name="pp2-auto", mesh=(1, 4), stages=2, options={"schedule": "1f1b"}),
]

# The 2-rank set (one rank per core: the main figure): every layout of 2 devices and the memory levers a
# user turns on the same layouts (recompute, ZeRO 2 and 3), pipelines at two microbatch counts, and interleaved.
_MESH_2 = (1, 2)
PLANS_2 = [
    PlanSpec(name="dp", mesh=_MESH_2, pin=data_parallel(_MESH_2)),
    PlanSpec(name="tp", mesh=_MESH_2, pin=megatron(_MESH_2, tp_axis=1, dp_axis=None)),
    PlanSpec(name="tpv", mesh=_MESH_2, pin=megatron(_MESH_2, tp_axis=1, dp_axis=None, vocab=True)),
    PlanSpec(name="rep", mesh=_MESH_2, pin={"*": "RR"}),
    PlanSpec(name="dp-rc", mesh=_MESH_2, pin=data_parallel(_MESH_2), options={"recompute": "full"}),
    PlanSpec(name="tp-rc", mesh=_MESH_2, pin=megatron(_MESH_2, tp_axis=1, dp_axis=None),
             options={"recompute": "full"}),
    PlanSpec(name="dp-z2", mesh=_MESH_2, pin=data_parallel(_MESH_2), options={"zero": 2}),
    PlanSpec(name="dp-z3", mesh=_MESH_2, pin=data_parallel(_MESH_2), options={"zero": 3}),
    PlanSpec(name="auto-1x2", mesh=_MESH_2),
    PlanSpec(name="auto", mesh=_MESH_2, stages=None),
    PlanSpec(name="pp2-auto", mesh=_MESH_2, stages=2, options={"schedule": "1f1b"}),
    PlanSpec(name="pp2-B16", mesh=_MESH_2, stages=2, options={"microbatches": 16, "schedule": "1f1b"}),
    PlanSpec(name="pp2-v2", mesh=_MESH_2, stages=2,
             options={"microbatches": 8, "schedule": "interleaved", "virtual_stages": 2}),
]
PLANS_BY_WORLD = {2: PLANS_2, 4: PLANS_4}
PLANS = PLANS_4  # the set of earlier results (4 ranks)


def plans_for(world: int) -> list[PlanSpec]:
    if world not in PLANS_BY_WORLD:
        raise SystemExit(f"no fidelity plan set for {world} ranks; use one of {sorted(PLANS_BY_WORLD)}")
    return PLANS_BY_WORLD[world]


def takes_stages() -> bool:
    """Whether this planner's PlanOptions has ``stages`` (the pipeline planner)."""
    from autopar.planner.driver import PlanOptions

    return any(f.name == "stages" for f in dataclasses.fields(PlanOptions))


def make_plans(cluster: autopar.Cluster, names: list[str] | None = None) -> dict[str, autopar.Plan]:
    """{name: Plan} for the chosen specs (all of the cluster's world size by default) on ``cluster`` viewed
    as each spec's mesh."""
    model, batch = make_gpt(CONFIG, batch_size=BATCH)
    staged = takes_stages()
    plans = {}
    for spec in plans_for(cluster.num_devices):
        if names is not None and spec.name not in names:
            continue
        if not staged and spec.stages != 1:
            print(f"# {spec.name}: skipped, this planner's PlanOptions has no stages")
            continue
        options = ({"pin": spec.pin} if spec.pin else {}) | spec.options
        if staged:
            options["stages"] = spec.stages
        plans[spec.name] = autopar.plan(model, cluster.with_mesh(spec.mesh), batch, **options)
    return plans


def priced_compute(plan) -> float:
    """The busiest stage's predicted compute (kernels and host overhead) with the recompute replay: the extra
    forward of recomputed layers over all microbatches, which the plan's step time includes and its stages'
    "compute" field leaves out (``predicted["recompute"]`` is per microbatch)."""
    return max(float(s.predicted.get("compute", 0.0)) + plan.microbatches * float(s.predicted.get("recompute", 0.0))
               for s in plan.stages)
