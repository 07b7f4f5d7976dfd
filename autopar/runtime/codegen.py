"""Codegen: (graph, one stage of a Plan, this rank's mesh coordinate) -> a local-shard GraphModule.

It lives in the runtime, not in passes/: it reads only the Plan and the IR, and its output calls the
runtime's collectives and kernels, so the runtime can build a rank's module without the planner.

Input:  ``ModelGraph``; a ``Stage`` whose ``shardings`` cover the nodes to emit; the rank's coordinate in
        the stage mesh; a ``runtime.tensor_source`` source, asked for this rank's shard of each parameter/buffer.
Output: ``fx.GraphModule`` whose forward takes the stage inputs and returns the stage outputs:
  * parameters and buffers are attributes holding this rank's shard (named like their placeholders), their
    values still to be filled in (``gm.meta["pending_values"]``, ``fill_pending``) once the gradient sync
    has laid out ZeRO-3 buckets, which take only this rank's slice (a rank never holds a full copy);
  * user inputs arrive whole (every rank passes the global batch) and are sliced locally, no comm
    (under data="local" they arrive split along dim 0 already: ``local_data``);
  * before each op, each tensor input is moved from its producer's spec to the spec the op reads by
    the steps of ``autopar.redistribute`` (collectives from ``autopar.runtime.collectives``);
  * shape arguments (view, reshape, expand, unflatten) are rewritten to local shapes;
  * rule kernels are applied (bias scaled by 1/W, mean scaled by 1/W, vocab-parallel embedding and
    cross-entropy, expert-parallel grouped matmul replaced by ``autopar.runtime.kernels``, the MoE experts
    op by its expert-parallel kernels in ``autopar.runtime.expert_dispatch``).
Each emitted op node records in ``meta["dtype"]`` the dtype its output has under the precision policy (the
captured value's, relabelled by ``ir.precision.apply_to_graph``). The generated code is plain Python
(``gm.code``) and autograd differentiates it as usual.
"""
from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.errors import PlanError
from autopar.ir.buckets import deferrable_syncs
from autopar.ir.expert_rows import rows_source
from autopar.ir.ops import OpView
from autopar.placement import EXPERT_ROWS, P, R, Spec, local_shape, parse_spec
from autopar.redistribute import grad_partial_axes, redistribute_steps
from autopar.runtime import collectives as C
from autopar.runtime import context_parallel as CP
from autopar.runtime import expert_dispatch as ED
from autopar.runtime import kernels as K
from autopar.runtime.groups import group_key
from autopar.runtime.recompute_regions import outline_recompute

aten = torch.ops.aten

SHAPE_ARG = {aten.view: 1, aten.reshape: 1, aten._unsafe_view: 1, aten.expand: 1}


def shard_input(x: torch.Tensor, pieces: tuple) -> torch.Tensor:
    """This rank's block of a whole input: ``pieces`` = ((dim, parts, index), ...) applied in order."""
    for dim, parts, index in pieces:
        x = x.chunk(parts, dim=dim)[index]
    return x.contiguous()


class _Emitter:
    def __init__(self, graph, stage, coord, mesh_index: int, requires_grad: set[str], defer: bool,
                 local_batch: bool = False, device: torch.device | str = "cpu"):
        self.graph, self.stage, self.coord, self.mesh_index = graph, stage, coord, mesh_index
        self.device = torch.device(device)  # where this rank's shards live (``runtime.devices.rank_device``)
        self.local_batch = local_batch  # data="local": inputs arrive already split along dim 0
        self.mesh_shape = tuple(stage.mesh_shape)
        self.requires_grad = requires_grad
        self.new = fx.Graph()
        self.env: dict[str, fx.Node] = {}
        self.moved: dict[tuple, fx.Node] = {}  # one redistribution per (value, target spec, grad axes)
        self.specs: dict[str, Spec] = {}
        self.root = torch.nn.Module()
        self.pending: dict[str, functools.partial] = {}  # placeholder -> its value, not yet filled in
        self.deferred = self._deferrable_syncs() if defer else {}

    def _deferrable_syncs(self) -> dict[str, tuple[int, ...]]:
        """Parameters whose gradient sync the runner does once per step (``ir.buckets.deferrable_syncs``)."""
        return deferrable_syncs(self.graph, self.stage, self.requires_grad)

    def group(self, axis: int) -> str:
        return group_key(self.mesh_index, axis)

    # ---- values --------------------------------------------------------------------------------
    def spec_of(self, name: str) -> Spec:
        if name not in self.specs:
            self.specs[name] = parse_spec(self.stage.shardings[name].out)
        return self.specs[name]

    def redistribute(self, value: fx.Node, src: Spec, dst: Spec, grad_axes=()) -> fx.Node:
        for step in redistribute_steps(src, dst, grad_axes):
            value = self.new.call_function(*C.step_call(step, self.group(step.axis), value))
        return value

    # ---- placeholders --------------------------------------------------------------------------
    def emit_placeholder(self, node: fx.Node, tensors) -> None:
        info = self.graph.placeholder(node.name)
        spec = self.spec_of(node.name)
        if info.kind == "input":
            x = self.new.placeholder(node.name)
            pieces = tuple((p.dim, self.mesh_shape[a], self.coord[a]) for a, p in enumerate(spec)
                           if p.is_shard() and not (self.local_batch and p.dim == 0))
            self.env[node.name] = self.new.call_function(shard_input, (x, pieces)) if pieces else x
            return
        if not node.users:
            return  # e.g. the unused placeholder of a tied weight; full_state_dict reads its alias
        # the value is filled after the gradient sync is set up (a ZeRO-3 parameter: only this rank's shard of
        # it, ``gradsync.Bucket``): until then the tensor's storage is allocated but never touched
        local = torch.empty(local_shape(tuple(info.shape), spec, self.mesh_shape), dtype=tensors.dtype(info.fqn),
                            device=self.device)
        self.pending[node.name] = functools.partial(tensors.local, info.fqn, spec, self.mesh_shape, self.coord)
        if info.kind == "parameter":
            grad = tensors.requires_grad(info.fqn)
            self.root.register_parameter(node.name, torch.nn.Parameter(local, requires_grad=grad))
        else:
            self.root.register_buffer(node.name, local)
        self.env[node.name] = self.new.get_attr(node.name)

    def emit_external_input(self, name: str, spec: Spec) -> None:
        """A value computed by an earlier stage arrives as a placeholder already in ``spec``."""
        self.env[name] = self.new.placeholder(name)
        self.specs[name] = spec

    # ---- ops -----------------------------------------------------------------------------------
    def emit_call(self, node: fx.Node) -> None:
        sharding = self.stage.shardings[node.name]
        out_spec = self.spec_of(node.name)
        view = OpView(node)
        ins = [parse_spec(s) for s in sharding.ins]
        if len(ins) != view.n_in:
            raise PlanError(f"plan gives {len(ins)} input specs for {node.name}, which has {view.n_in} tensor "
                            f"inputs; the plan does not match this model: re-plan")
        local_args = [self._input(node, arg, dst, out_spec) for arg, dst in zip(view.tensor_args, ins)]
        if node.target is operator.getitem:
            self.env[node.name] = local_args[0]
            return
        kernels = [(int(a), t) for a, t in sharding.kernels]
        args, kwargs = _substitute(node, view, local_args)
        args = self._localize_shapes(node, out_spec, args)
        target, args, kwargs = self._apply_kernels(node, view, ins, kernels, target=node.target, args=args,
                                                   kwargs=kwargs)
        out = self.new.call_function(target, tuple(args), kwargs)
        out.meta["dtype"] = _first_dtype(node.meta.get("val"))  # under the precision policy (zero3_graph reads it)
        out.meta["autopar_spec"] = out_spec  # this rank's layout of the value (``rng.own_draws`` reads it)
        self.env[node.name] = self._post_kernels(out, kernels)

    def _input(self, node: fx.Node, arg: fx.Node, dst: Spec, out_spec: Spec) -> fx.Node:
        """The local value ``node`` reads from ``arg``. Readers that need the same move share one:
        collectives are linear, so one backward all-reduce of the summed gradient replaces several."""
        if arg.name in self.deferred:
            return self.env[arg.name]
        needs_grad = arg.name in self.requires_grad and node.name in self.requires_grad
        grad_axes = grad_partial_axes(dst, out_spec) if needs_grad and node.op != "output" else ()
        item = node.args[1] if node.target is operator.getitem else None
        key = (arg.name, item, dst, grad_axes)
        if key not in self.moved:
            value = self.env[arg.name]
            if item is not None:
                value = self.new.call_function(operator.getitem, (value, item))
            value, src = self._pad_expert_rows(arg, value, self.spec_of(arg.name), dst)
            self.moved[key] = self.redistribute(value, src, dst, grad_axes)
        return self.moved[key]

    def _pad_expert_rows(self, arg: fx.Node, value: fx.Node, src: Spec, dst: Spec) -> tuple[fx.Node, Spec]:
        """An EXPERT_ROWS value read as anything else is first padded back to all rows (a plain Partial):
        its rows start at the offset of the first expert its grouped matmul holds here."""
        leaving = [a for a, p in enumerate(src) if p == EXPERT_ROWS and dst[a] != EXPERT_ROWS]
        if not leaving:
            return value, src
        source = rows_source(arg)
        if source is None:
            raise PlanError(f"{arg.name} is laid out by experts' rows but comes from no grouped expert matmul")
        w_spec = parse_spec(self.stage.shardings[source.name].ins[1])
        first = _chunk_offset(w_spec, 0, source.args[1].meta["val"].shape[0], self.mesh_shape, self.coord)
        offs = source.args[2]
        offs_value = self.redistribute(self.env[offs.name], self.spec_of(offs.name), (R,) * len(src))
        val = arg.meta["val"]
        total = (val[0] if isinstance(val, (tuple, list)) else val).shape[0]  # a split's pieces keep all rows
        padded = self.new.call_function(K.pad_expert_rows, (value, offs_value, first, total))
        return padded, tuple(P if a in leaving else p for a, p in enumerate(src))

    def _localize_shapes(self, node: fx.Node, out_spec: Spec, args: list) -> list:
        packet = getattr(node.target, "overloadpacket", None)
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return args
        local = list(local_shape(tuple(val.shape), out_spec, self.mesh_shape))
        if packet in SHAPE_ARG:
            args[SHAPE_ARG[packet]] = local
        elif packet is aten.unflatten:
            dim = args[1] % len(node.args[0].meta["val"].shape)
            args[2] = local[dim:dim + len(args[2])]
        return args

    def _apply_kernels(self, node, view, ins, kernels, target, args, kwargs):
        if not kernels:
            return target, args, kwargs
        tags = {t for _, t in kernels}
        axes = lambda tag: [a for a, t in kernels if t == tag]  # noqa: E731
        if "scale_additive" in tags:
            w = _prod(self.mesh_shape[a] for a in axes("scale_additive"))
            pos = 0 if node.target.overloadpacket in (aten.addmm, aten.baddbmm) else 2
            args[pos] = self.new.call_function(aten.mul.Tensor, (args[pos], 1.0 / w))
        if "vocab_embedding" in tags:
            start = _chunk_offset(ins[0], 0, view.in_shapes[0][0], self.mesh_shape, self.coord)
            return K.vocab_parallel_embedding, [args[0], args[1], start], {}
        if "ce_batch" in tags or "ce_class" in tags:
            return self._loss_kernel(node, view, ins, axes, args)
        if "causal_context" in tags:
            (axis,) = axes("causal_context")
            return CP.causal_context_attention, list(args[:3]), dict(
                group=self.group(axis), dropout_p=view.kwarg("dropout_p", 0.0), scale=view.kwarg("scale"),
                enable_gqa=view.kwarg("enable_gqa", False))
        if "expert_all_to_all" in tags or "local_experts_op" in tags:
            return self._experts_kernel(view, ins, axes, args)
        if "local_experts" in tags:
            first = _chunk_offset(ins[1], 0, view.in_shapes[1][0], self.mesh_shape, self.coord)
            native = node.target is aten._grouped_mm.default
            x_rows, pad = EXPERT_ROWS in ins[0], EXPERT_ROWS not in self.spec_of(node.name)
            return K.local_experts_grouped_mm, [args[0], args[1], args[2], first, native, x_rows, pad,
                                                view.in_shapes[0][0]], {}
        return target, args, kwargs

    def _experts_kernel(self, view, ins, axes, args):
        """The MoE experts op split by experts on one axis (``runtime/expert_dispatch``)."""
        activation, gated, transposed, capacity_factor, group_size = args[5:10]
        n_experts = view.in_shapes[3][0]
        attrs = dict(n_experts=n_experts, activation=activation, gated=gated, transposed=transposed,
                     capacity_factor=capacity_factor, group_size=group_size)
        if axes("expert_all_to_all"):
            (axis,) = axes("expert_all_to_all")
            return ED.expert_all_to_all, list(args[:5]), dict(attrs, group=self.group(axis))
        first = _chunk_offset(ins[3], 0, n_experts, self.mesh_shape, self.coord)
        return ED.local_experts_op, list(args[:5]), dict(attrs, first=first)

    def _loss_kernel(self, node, view, ins, axes, args):
        common = dict(reduction=view.kwarg("reduction", 1), ignore_index=view.kwarg("ignore_index", -100),
                      batch_groups=tuple(self.group(a) for a in axes("ce_batch")))
        logits, target = args[0], args[1]
        if node.target.overloadpacket is aten.cross_entropy_loss:
            classes = axes("ce_class")
            start = _chunk_offset(ins[0], 1, view.in_shapes[0][1], self.mesh_shape, self.coord) if classes else 0
            return K.sharded_cross_entropy, [logits, target], dict(
                common, class_groups=tuple(self.group(a) for a in classes), class_start=start)
        return K.sharded_nll_loss, [logits, target], common

    def _post_kernels(self, out: fx.Node, kernels) -> fx.Node:
        mean_axes = [a for a, t in kernels if t == "mean_partial"]
        if mean_axes:
            out = self.new.call_function(aten.mul.Tensor, (out, 1.0 / _prod(self.mesh_shape[a] for a in mean_axes)))
        return out

    def graph_outputs(self, node: fx.Node) -> list:
        """The model's flat outputs, whole on every rank."""
        outs = []
        for value in pytree.tree_leaves(node.args[0]):
            if isinstance(value, fx.Node):
                full = (R,) * len(self.mesh_shape)
                outs.append(self.redistribute(self.env[value.name], self.spec_of(value.name), full))
            else:
                outs.append(value)
        return outs


def _substitute(node: fx.Node, view: OpView, local_args: list) -> tuple[list, dict]:
    """Replace the node's tensor arguments, in OpView order, by their local (redistributed) values."""
    it = iter(local_args)
    tensor_ids = {id(a) for a in view.tensor_args}

    def swap(a):
        return next(it) if isinstance(a, fx.Node) and id(a) in tensor_ids else a

    args, kwargs = pytree.tree_map(swap, (list(node.args), dict(node.kwargs)))
    return list(args), kwargs


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _chunk_offset(spec: Spec, dim: int, size: int, mesh_shape, coord) -> int:
    """Index of this rank's first element along ``dim`` under ``spec`` (nested shards, axis 0 outermost)."""
    start, length = 0, size
    for axis, p in enumerate(spec):
        if p.is_shard() and p.dim == dim:
            length //= mesh_shape[axis]
            start += coord[axis] * length
    return start


def generate_stage_module(graph, stage, coord, mesh_index: int, tensors,
                          requires_grad: set[str], defer_param_sync: bool = True,
                          recompute: dict[str, object] | None = None, local_batch: bool = False,
                          device: torch.device | str = "cpu") -> fx.GraphModule:
    """Emit the local-shard GraphModule of ``stage`` for the rank at ``coord`` (see module docstring).

    Signature: every user input (whole), then the values received from earlier stages, in
    ``sorted(stage.inputs)`` order, each already in its receive spec. Returns: the values later stages
    read (``stage.outputs``, local, in the producer's spec), then — on the stage that owns the graph's
    output — the model's flat outputs, whole. ``gm.meta["deferred_syncs"]``: {parameter: mesh axes}
    whose gradient all-reduce the runner does once per step (see ``_deferrable_syncs``).

    ``recompute``: {op name: region key} (``recompute.region_keys``); every node emitted for such an op,
    its input redistributions included, is tagged, and ``recompute_regions.outline_recompute`` runs each
    run of tagged nodes under ``torch.utils.checkpoint``.

    ``local_batch`` (data="local"): user inputs arrive as this rank's block of dim 0 (``local_data``), so
    only their splits of other dims are taken here. ``device``: where the shards are allocated (the rank's)."""
    em = _Emitter(graph, stage, coord, mesh_index, requires_grad, defer_param_sync, local_batch, device)
    owned = set(stage.shardings)
    for info in graph.placeholders:
        if info.kind == "input":
            node = graph.gm.graph.find_nodes(op="placeholder", target=info.name)[0]
            if info.name in owned:
                em.emit_placeholder(node, tensors)
            else:
                em.new.placeholder(info.name)  # read by another stage
    for name in sorted(stage.inputs):
        em.emit_external_input(name, parse_spec(stage.inputs[name]))
    returns = []
    for node in graph.gm.graph.nodes:
        if node.name not in owned or (node.op == "placeholder" and graph.placeholder(node.name).kind == "input"):
            continue
        if node.op == "placeholder":
            em.emit_placeholder(node, tensors)
        elif node.op == "call_function":
            mark = next(iter(reversed(em.new.nodes)), None)
            em.emit_call(node)
            if recompute and node.name in recompute:
                _tag_since(em.new, mark, recompute[node.name])
        elif node.op == "output":
            returns = em.graph_outputs(node)
    em.new.output(tuple([em.env[name] for name in stage.outputs] + returns))
    em.new.lint()
    gm = fx.GraphModule(em.root, em.new, class_name=f"Stage{stage.index}Rank")
    if recompute:
        outline_recompute(gm)
    gm.meta["deferred_syncs"] = em.deferred
    gm.meta["pending_values"] = em.pending  # filled by ``fill_pending`` (or, ZeRO-3, by its bucket)
    return gm


def _first_dtype(val) -> torch.dtype | None:
    """The dtype of a captured node's (first) tensor output, as the precision policy relabelled it."""
    if isinstance(val, (tuple, list)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    return val.dtype if isinstance(val, torch.Tensor) else None


def _tag_since(graph: fx.Graph, mark: fx.Node | None, key) -> None:
    """Tag the call_function nodes emitted after ``mark`` (the graph's last node before them)."""
    node = mark.next if mark is not None else next(iter(graph.nodes), None)
    while node is not None and node.op != "root":
        if node.op == "call_function":
            node.meta["recompute"] = key
        node = node.next


def fill_pending(gm: fx.GraphModule) -> None:
    """Fill in every parameter/buffer value codegen left pending, one at a time, in place (a ZeRO ≥ 1
    parameter is a view of its bucket's flat buffer by now, so the bucket gets the value too)."""
    pending = gm.meta.get("pending_values", {})
    with torch.no_grad():
        for name in list(pending):
            getattr(gm, name).copy_(pending.pop(name)())
