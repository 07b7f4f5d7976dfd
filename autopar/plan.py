"""``autopar.Plan``: everything codegen and the runtime need, as plain data with an exact JSON round-trip.

A plan is a list of stages (one without pipelining). Each stage owns a contiguous set of graph nodes, a
submesh of global ranks laid out as a logical 2-D mesh, and one ``NodeSharding`` per node: the output
spec, a spec per tensor input (what the op reads; codegen inserts the collectives in between) and the
local kernels. Specs are written as text ("S(0)R", see ``autopar.placement``).

A pipelined plan adds, per stage, the values it receives from earlier stages (``inputs``, with the spec
they arrive in) and the values it sends on (``outputs``); ``transfers`` lists every such send.

Invariants checked by ``Plan.validate``: every op of the graph has a sharding in exactly one stage
(placeholders appear in every stage that reads them); every spec has one placement per axis of its
stage's mesh, shards only dims its value has, and splits them evenly (dim size divisible by the product
of the sizes of the axes sharding it); input specs are as many as the node's tensor inputs; the stages'
ranks tile the cluster and each stage's submesh fits the cluster's machines; the graph fingerprint
matches the model the plan is applied to. (``autopar.passes.plan_check`` also checks each sharding
against the op's strategies; ``autopar.compile`` runs both.)
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from typing import Any

from autopar.errors import PlanError
from autopar.placement import divides, parse_spec

PLAN_VERSION = 1


@dataclasses.dataclass(frozen=True)
class NodeSharding:
    """out: output spec; ins: one spec per tensor input; kernels: [axis, tag] local rewrites."""

    out: str
    ins: tuple[str, ...] = ()
    kernels: tuple[tuple[int, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class Collective:
    """One communication step the plan inserts: on edge ``src -> dst`` (node names), in forward or backward."""

    src: str
    dst: str
    kind: str
    axis: int
    nbytes: float
    phase: str = "forward"
    seconds: float = 0.0


@dataclasses.dataclass
class Stage:
    """One pipeline stage (the whole model when there is no pipelining).

    ranks: global ranks of the submesh, row-major over ``mesh_shape``; submesh: its physical shape
    (nodes, devices per node); layers: [first, last] layer index (inclusive), or None.
    recompute: {layer index: "full" | "selective"} for the layers whose activations backward recomputes
    (absent layers keep theirs); codegen runs those regions under ``torch.utils.checkpoint``.
    predicted: seconds and bytes the cost model expects (keys: latency, compute, comm, memory, ...).
    """

    index: int
    ranks: list[int]
    mesh_shape: tuple[int, int]
    submesh: tuple[int, int]
    nodes: list[str]
    shardings: dict[str, NodeSharding]
    collectives: list[Collective] = dataclasses.field(default_factory=list)
    layers: tuple[int, int] | None = None
    predicted: dict[str, float] = dataclasses.field(default_factory=dict)
    inputs: dict[str, str] = dataclasses.field(default_factory=dict)   # from earlier stages: value -> spec
    outputs: list[str] = dataclasses.field(default_factory=list)       # values later stages read
    recompute: dict[int, str] = dataclasses.field(default_factory=dict)
    zero: dict[str, int] = dataclasses.field(default_factory=dict)     # parameter -> ZeRO level (absent: 0)


@dataclasses.dataclass
class Plan:
    """A parallelization plan (see module docstring). Compare plans with ``==``; save with ``to_json``."""

    model: str
    graph_fingerprint: str
    input_signature: list[tuple[tuple[int, ...], str]]
    cluster: dict[str, Any]
    stages: list[Stage]
    microbatches: int = 1
    schedule: str = "none"
    optimizer: str = "adamw"
    recompute: Any = "auto"  # the recompute option the plan was made with ("auto", "none", "full" or a dict)
    predicted: dict[str, float] = dataclasses.field(default_factory=dict)
    planner: dict[str, Any] = dataclasses.field(default_factory=dict)
    repeated_blocks: dict[str, list[list[str]]] = dataclasses.field(default_factory=dict)
    node_ops: dict[str, str] = dataclasses.field(default_factory=dict)
    node_layers: dict[str, int] = dataclasses.field(default_factory=dict)
    transfers: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    precision: str = "fp32"
    bucket_bytes: int = 25 * 2 ** 20
    # interleaved 1F1B: stages are v·pp model chunks, chunk s on the ranks of chunk s mod pp (1: one per device)
    virtual_stages: int = 1
    version: int = PLAN_VERSION
    # How long planning took, by phase: not part of the plan (not saved, not compared), so the same
    # inputs give byte-identical JSON.
    timings: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    # ---- lookups -------------------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return sum(len(s.ranks) for s in self.device_stages)

    @property
    def device_stages(self) -> list[Stage]:
        """The stages that tile the devices: all of them, or the first pp of an interleaved plan."""
        return self.stages[:len(self.stages) // max(1, self.virtual_stages)]

    def stage_of_rank(self, rank: int) -> Stage:
        return self.stages_of_rank(rank)[0]

    def stages_of_rank(self, rank: int) -> list[Stage]:
        """The stages (model chunks) ``rank`` runs: one, or v of an interleaved plan."""
        held = [stage for stage in self.stages if rank in stage.ranks]
        if not held:
            raise PlanError(f"rank {rank} is in no stage of this plan ({self.num_devices} devices)")
        return held

    def sharding(self, node: str) -> NodeSharding:
        for stage in self.stages:
            if node in stage.shardings:
                return stage.shardings[node]
        raise PlanError(f"node {node!r} has no sharding in this plan")

    # ---- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("timings")
        return d

    def to_json(self, path=None) -> str:
        """Deterministic JSON (sorted keys): equal plans give byte-identical text."""
        text = json.dumps(self.to_dict(), indent=1, sort_keys=True)
        if path is not None:
            from autopar.ir.text_files import write_json_text

            write_json_text(path, text + "\n", "plan file", PlanError, _looks_like_a_plan)
        return text

    def digest(self) -> str:
        """SHA-256 of the JSON text; ranks compare it before running a plan."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @staticmethod
    def from_json(source) -> "Plan":
        """Parse a plan from JSON text or a file path; any malformation is one PlanError."""
        if not isinstance(source, (str, bytes, os.PathLike)):
            raise PlanError(f"Plan.from_json takes JSON text or a file path, got a {type(source).__name__}"
                            + ("; for a dict, pass json.dumps(it)" if isinstance(source, dict) else ""))
        text = source.decode("utf-8", "replace") if isinstance(source, bytes) else str(source)
        if not text.lstrip().startswith(("{", "[")):
            text = _read_text(source)
        try:
            return _plan_from_dict(json.loads(text))
        except PlanError:
            raise
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlanError(f"malformed plan JSON ({type(e).__name__}: {e}); regenerate it with "
                            f"autopar.plan(...).to_json() or `autopar plan`") from None

    # ---- checks --------------------------------------------------------------------------------
    def validate(self, graph=None, world_size: int | None = None, cluster=None) -> None:
        """Check the invariants in the module docstring; raise PlanError naming the first violation."""
        if self.version != PLAN_VERSION:
            raise PlanError(f"plan version {self.version} is not supported (expected {PLAN_VERSION}); re-plan")
        ranks = sorted(r for s in self.device_stages for r in s.ranks)
        if ranks != list(range(len(ranks))):
            raise PlanError(f"plan stages must tile ranks 0..{len(ranks) - 1}, got {ranks}")
        self._validate_chunks()
        for s in self.stages:
            if math.prod(s.mesh_shape) != len(s.ranks):
                raise PlanError(f"stage {s.index}: mesh {s.mesh_shape} does not hold its {len(s.ranks)} ranks")
            bad = {layer: mode for layer, mode in s.recompute.items() if mode not in ("full", "selective")}
            if bad:
                raise PlanError(f"stage {s.index}: recompute modes {bad} are not 'full' or 'selective'; re-plan")
        for s in self.stages:
            for name, sh in s.shardings.items():
                try:
                    for text in (sh.out, *sh.ins):
                        parse_spec(text)
                except ValueError as e:
                    raise PlanError(f"stage {s.index}, node {name}: {e}; the plan file is corrupted, re-plan") from None
        if world_size is not None and world_size != len(ranks):
            raise PlanError(f"plan is for {len(ranks)} devices but the process group has {world_size} ranks; "
                            f"launch {len(ranks)} processes or re-plan for this cluster")
        if cluster is not None:
            self._validate_mesh(cluster)
        if graph is not None:
            self._validate_against(graph)

    def _validate_chunks(self) -> None:
        """Interleaved plans: v·pp stages, chunk s on the ranks and mesh of chunk s mod pp."""
        v, n = self.virtual_stages, len(self.stages)
        if v < 1 or n % v:
            raise PlanError(f"virtual_stages={v} does not divide the plan's {n} stages; re-plan")
        pp = n // v
        for s in self.stages[pp:]:
            twin = self.stages[s.index % pp]
            if s.ranks != twin.ranks or tuple(s.mesh_shape) != tuple(twin.mesh_shape):
                raise PlanError(f"stage {s.index} of an interleaved plan must run on the ranks and mesh of stage "
                                f"{twin.index} ({twin.ranks}, {twin.mesh_shape}); re-plan")

    def _validate_mesh(self, cluster) -> None:
        if cluster.num_devices != self.num_devices:
            raise PlanError(f"plan is for {self.num_devices} devices, cluster {cluster.name!r} has "
                            f"{cluster.num_devices}; re-plan for this cluster")
        for s in self.stages:
            nodes, per_node = s.submesh
            if nodes * per_node != len(s.ranks) or nodes > cluster.nodes or per_node > cluster.devices_per_node:
                raise PlanError(f"stage {s.index}: submesh {tuple(s.submesh)} (machines x devices) does not fit "
                                f"its {len(s.ranks)} ranks on cluster {cluster.name!r} ({cluster.nodes} x "
                                f"{cluster.devices_per_node}); re-plan for this cluster")

    def _validate_against(self, graph) -> None:
        fp = graph.fingerprint()
        if fp != self.graph_fingerprint:
            raise PlanError(f"this plan was made for another model or other input shapes (graph fingerprint "
                            f"{self.graph_fingerprint}, this model has {fp}); re-plan with autopar.plan(model, "
                            f"cluster, example_inputs)")
        ops = [n.name for n in graph.gm.graph.nodes if n.op in ("call_function", "output")]
        owned = [n for s in self.stages for n in s.shardings if n in set(ops)]
        missing = sorted(set(ops) - set(owned))
        if missing or len(owned) != len(set(owned)):
            raise PlanError(f"plan does not assign every op to exactly one stage (missing {missing[:5]}); re-plan")
        nodes = {n.name: n for n in graph.gm.graph.nodes}
        for s in self.stages:
            for name, sh in s.shardings.items():
                if name not in nodes:
                    raise PlanError(f"stage {s.index}: node {name!r} is not in the graph; re-plan")
                _check_node_specs(s, nodes[name], sh)


    # ---- presentation --------------------------------------------------------------------------
    def summary(self, max_rows: int = 60, glue: bool = False) -> str:
        """Per stage: time, memory, parameter layouts by block part, collectives, main ops; ``glue=True``
        also lists the glue ops (mask, position and shape arithmetic)."""
        from autopar.views.report import plan_summary

        return plan_summary(self, max_rows=max_rows, glue=glue)

    def __str__(self) -> str:
        return self.summary()


def _tensor_shape(value):
    return tuple(value.shape) if hasattr(value, "shape") and hasattr(value, "dtype") else None


def _tensor_inputs(node) -> list[tuple[str, Any]]:
    """(name, value read) of each tensor argument in pytree order, repeats kept: what ``ins`` lists
    (the planner's ``OpView.tensor_args``; a ``getitem`` reads the selected element)."""
    import operator

    import torch.utils._pytree as pytree

    flat, _ = pytree.tree_flatten((node.args, node.kwargs))
    out = []
    for a in flat:
        val = getattr(a, "meta", {}).get("val") if hasattr(a, "op") else None
        if isinstance(val, (tuple, list)):
            if not any(_tensor_shape(v) is not None for v in val):
                continue
            val = val[node.args[1]] if node.target is operator.getitem else None
        elif _tensor_shape(val) is None:
            continue
        out.append((a.name, val))
    return out


def _check_node_specs(stage: Stage, node, sh: NodeSharding) -> None:
    """Spec rank = mesh rank, shard dims that exist, even splits; as many input specs as tensor inputs."""
    inputs = _tensor_inputs(node) if node.op != "placeholder" else []
    if node.op != "placeholder" and len(sh.ins) != len(inputs):
        raise PlanError(f"stage {stage.index}, node {node.name}: {len(sh.ins)} input specs for {len(inputs)} "
                        f"tensor inputs; re-plan")
    value = node.meta.get("val")
    outs = value if isinstance(value, (tuple, list)) else [value]
    checked = [("output", sh.out, _tensor_shape(v)) for v in outs if node.op != "output"]
    checked += [(f"input {name}", text, _tensor_shape(v)) for (name, v), text in zip(inputs, sh.ins)]
    for what, text, shape in checked:
        spec = parse_spec(text)
        if len(spec) != len(stage.mesh_shape):
            raise PlanError(f"stage {stage.index}, node {node.name}: {what} spec {text!r} has {len(spec)} "
                            f"placements for a {len(stage.mesh_shape)}-axis mesh {tuple(stage.mesh_shape)}; re-plan")
        if shape is not None and not divides(spec, shape, stage.mesh_shape):
            raise PlanError(f"stage {stage.index}, node {node.name}: {what} spec {text!r} does not split shape "
                            f"{shape} evenly on mesh {tuple(stage.mesh_shape)} (a dim it does not have, or "
                            f"not divisible); re-plan")


def _tuple2(x) -> tuple[int, int]:
    return tuple(int(v) for v in x)


def _stage_from_dict(d: dict[str, Any]) -> Stage:
    shardings = {k: NodeSharding(v["out"], tuple(v["ins"]), tuple((int(a), str(t)) for a, t in v["kernels"]))
                 for k, v in d["shardings"].items()}
    collectives = [Collective(**c) for c in d.get("collectives", [])]
    layers = tuple(d["layers"]) if d.get("layers") is not None else None
    return Stage(index=int(d["index"]), ranks=[int(r) for r in d["ranks"]], mesh_shape=_tuple2(d["mesh_shape"]),
                 submesh=_tuple2(d["submesh"]), nodes=list(d["nodes"]), shardings=shardings,
                 collectives=collectives, layers=layers, predicted=dict(d.get("predicted", {})),
                 inputs=dict(d.get("inputs", {})), outputs=list(d.get("outputs", [])),
                 recompute={int(k): str(v) for k, v in d.get("recompute", {}).items()},
                 zero={k: int(v) for k, v in d.get("zero", {}).items()})


def _looks_like_a_plan(text: str) -> bool:
    try:
        d = json.loads(text)
    except ValueError:
        return False
    return isinstance(d, dict) and "version" in d and "stages" in d


def _read_text(source) -> str:
    from autopar.ir.text_files import read_json_text

    return read_json_text(source, "plan file", PlanError, "give a plan written by Plan.to_json or `autopar plan --out`")


def _plan_from_dict(d: dict[str, Any]) -> Plan:
    from autopar.errors import ClusterError
    from autopar.hardware.cluster import Cluster
    from autopar.plan_schema import check_plan_dict

    check_plan_dict(d)
    try:
        Cluster.from_dict(d["cluster"])
    except ClusterError as e:
        raise PlanError(f"malformed plan JSON: its cluster is invalid ({e})") from None
    plan = Plan(
        model=d["model"], graph_fingerprint=d["graph_fingerprint"],
        input_signature=[(tuple(int(x) for x in shape), str(dtype)) for shape, dtype in d["input_signature"]],
        cluster=d["cluster"], stages=[_stage_from_dict(s) for s in d["stages"]],
        microbatches=int(d.get("microbatches", 1)), schedule=d.get("schedule", "none"),
        optimizer=d.get("optimizer", "adamw"), recompute=d.get("recompute", "auto"),
        predicted=dict(d.get("predicted", {})),
        planner=dict(d.get("planner", {})), repeated_blocks=d.get("repeated_blocks", {}),
        node_ops=d.get("node_ops", {}), node_layers={k: int(v) for k, v in d.get("node_layers", {}).items()},
        transfers=list(d.get("transfers", [])), version=int(d.get("version", PLAN_VERSION)),
        precision=str(d.get("precision", "fp32")), bucket_bytes=int(d.get("bucket_bytes", 25 * 2 ** 20)),
        virtual_stages=int(d.get("virtual_stages", 1)))
    plan.validate()
    return plan
