"""Pass 1, capture: nn.Module + example inputs -> ``ModelGraph`` (an fx graph of ATen ops).

Input:  an ``nn.Module`` and a tuple of example inputs (real tensors, or tensors on ``meta``).
Output: ``ModelGraph`` whose ``gm`` is the lifted training-IR graph from non-strict ``torch.export``:
  * one placeholder per parameter, buffer, lifted constant and user input, in the signature's order;
  * every call_function node carries ``meta["val"]`` (a fake tensor, or a tuple of them) with shapes
    and dtypes; runtime assertion nodes (``aten._assert_tensor_metadata`` and friends) are removed,
    since they pin global shapes that local shards do not have;
  * ``placeholders`` describes each placeholder (kind, fully qualified name, shape, dtype).

Why torch.export and not fx.symbolic_trace: symbolic_trace fails on Hugging Face GPT-2/Llama/BERT; non-strict
export captures them (DESIGN.md). A model export rejects gets one ``CaptureError`` naming the user line.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import sysconfig
import traceback

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind
from torch.fx import config as fx_config

from autopar.errors import CaptureError
from autopar.ir.graph import ModelGraph, PlaceholderInfo
from autopar.passes.capture_hops import inline_higher_order_ops
from autopar.passes.capture_moe import experts_as_op

_ASSERT_OPS = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
}


def capture(model: torch.nn.Module, example_inputs: tuple) -> ModelGraph:
    """Export ``model`` on ``example_inputs`` (non-strict) and return the cleaned ``ModelGraph``."""
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"autopar expects a torch.nn.Module, got {type(model).__name__}; wrap your "
                           f"function in a Module whose forward returns the loss")
    example_inputs = normalize_inputs(example_inputs)
    ep = _export(model, example_inputs, stack_traces=False)
    gm = ep.graph_module
    try:
        inline_higher_order_ops(gm, _trainable(ep))
    except CaptureError:  # export again with each op's stack trace, so that the error names the model line
        ep = _export(model, example_inputs, stack_traces=True)
        inline_higher_order_ops(ep.graph_module, _trainable(ep))
        raise
    _strip_assertions(gm)
    if _data_dependent_node(gm) is not None:
        _refuse_data_dependent_shapes(model, example_inputs)
    placeholders = _describe_placeholders(ep, gm)
    aliases = _param_aliases(model, ep)
    buffers = [k for k, _ in model.named_buffers()]
    signature = [(tuple(t.shape), str(t.dtype)) for t in example_inputs]
    return ModelGraph(gm=gm, placeholders=placeholders, out_spec=ep.call_spec.out_spec,
                      param_aliases=aliases, buffer_keys=buffers, constants=dict(ep.constants),
                      input_signature=signature)


def _data_dependent_node(gm: fx.GraphModule) -> fx.Node | None:
    """The first op whose output shape depends on tensor values (an unbacked symbol: nonzero, a boolean
    mask index, unique, ...); autopar plans fixed shapes, so no such op can be sharded or pipelined."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return next((n for n in gm.graph.nodes if n.op == "call_function"
                 and free_unbacked_symbols(n.meta.get("val"))), None)


def _refuse_data_dependent_shapes(model: torch.nn.Module, example_inputs: tuple) -> None:
    """CaptureError naming the op and the model line (exported again with stack traces to find it)."""
    from autopar.passes.capture_hops import model_line

    node = _data_dependent_node(_export(model, example_inputs, stack_traces=True).graph_module)
    op = str(node.target).removesuffix(".default")
    raise CaptureError(f"cannot plan {type(model).__name__}: {op}{model_line(node)} returns a tensor whose shape "
                       f"depends on the input's values, and autopar plans fixed shapes. Fix: keep the shape fixed, "
                       f"e.g. torch.where(mask, x, 0) and (x * mask).sum() / mask.sum() instead of x[mask], "
                       f"torch.nonzero_static(x, size=n) instead of nonzero, or do it outside forward")


def normalize_inputs(example_inputs) -> tuple:
    """Accept a tensor or a tuple/list of tensors; anything else is a clear error."""
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise CaptureError(f"example_inputs must be a tuple of tensors (the positional arguments of "
                           f"forward), got {type(example_inputs).__name__}")
    for i, t in enumerate(example_inputs):
        if not isinstance(t, torch.Tensor):
            raise CaptureError(f"example_inputs[{i}] is a {type(t).__name__}; autopar needs tensors as "
                               f"positional inputs (bind other arguments with functools.partial or in the Module)")
    return tuple(example_inputs)


def _trainable(ep: torch.export.ExportedProgram) -> set[str]:
    return {s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.PARAMETER}


def _export(model: torch.nn.Module, example_inputs: tuple, stack_traces: bool) -> torch.export.ExportedProgram:
    """torch.export non-strict, with torch's own multi-page error turned into one line + the user's line.

    ``stack_traces=False`` leaves ``meta["stack_trace"]`` unset: recording and symbolizing a Python stack
    per traced op is a fifth of export's time on an 8B-parameter Llama, and only error messages read it
    (``capture_hops.model_line``), so ``capture`` exports again with them on the error path alone."""
    quiet = io.StringIO()
    logger = logging.getLogger("torch")
    level, recorded = logger.level, getattr(fx_config, "do_not_emit_stack_traces", None)
    logger.setLevel(logging.ERROR)
    if recorded is not None:  # torch < 2.13 has no such switch and always records the stacks
        fx_config.do_not_emit_stack_traces = not stack_traces
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet), experts_as_op(model):
            return torch.export.export(model, example_inputs, strict=False)
    except Exception as e:  # torch.export raises many unrelated types; all mean "cannot capture"
        raise CaptureError(_describe_export_failure(model, e)) from None
    finally:
        logger.setLevel(level)
        if recorded is not None:
            fx_config.do_not_emit_stack_traces = recorded


def _describe_export_failure(model: torch.nn.Module, e: Exception) -> str:
    frame = _user_frame(e)
    where = f" at {frame.filename}:{frame.lineno} (`{(frame.line or '').strip()}`)" if frame else ""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    name = type(e).__name__
    if "data-dependent" in str(e) or "DataDependent" in name:
        cause = "Python control flow or a Python number depends on a tensor's values"
        fix = ("make it shape-only, use torch.where / torch.cond, or compute it outside forward "
               "and pass it in")
    elif _is_export_specific(e):
        cause = f"{name}: {first}"
        fix = "rewrite that construct so torch.export (non-strict) can trace it, or move it out of forward"
    else:  # the model itself raised on the example inputs
        cause = f"the model raised {name}: {first}"
        fix = ("check the example inputs' dtypes (token ids are int64), devices and shapes against what "
               "forward expects")
    return (f"cannot capture {type(model).__name__} with torch.export{where}: {cause}. Fix: {fix}.")


def _is_export_specific(e: BaseException) -> bool:
    """Errors torch.export raises about a construct it cannot trace (not errors of the model itself)."""
    from torch._dynamo import exc

    return isinstance(e, (exc.Unsupported, exc.UserError)) or "torch.export" in str(e)


def _user_frame(e: BaseException):
    """The innermost traceback frame outside torch and autopar: the user's model code."""
    packages = [sys.modules[name] for name in ("autopar", "autopar.passes", "autopar.cost_models")]  # loaded
    ours = [os.path.dirname(torch.__file__) + os.sep] + [d + os.sep for p in packages for d in p.__path__]
    stdlib, site = sysconfig.get_paths()["stdlib"] + os.sep, sysconfig.get_paths()["purelib"] + os.sep
    frames = traceback.extract_tb(e.__traceback__)
    frames = [f for f in frames if not f.filename.startswith(stdlib) or f.filename.startswith(site)]  # inspect.py
    user = [f for f in frames if not any(f.filename.startswith(d) for d in ours)
            and "site-packages/torch" not in f.filename and "<" not in f.filename]
    return user[-1] if user else None


def _strip_assertions(gm: fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _ASSERT_OPS and not node.users:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def _describe_placeholders(ep: torch.export.ExportedProgram, gm: fx.GraphModule) -> list[PlaceholderInfo]:
    kind_of = {InputKind.PARAMETER: "parameter", InputKind.BUFFER: "buffer",
               InputKind.CONSTANT_TENSOR: "constant", InputKind.USER_INPUT: "input"}
    specs = ep.graph_signature.input_specs
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(specs) == len(nodes), "export signature and graph placeholders disagree"
    out, user_index = [], 0
    for spec, node in zip(specs, nodes):
        kind = kind_of.get(spec.kind)
        if kind is None:
            raise CaptureError(f"unsupported graph input kind {spec.kind} for {node.name}")
        if kind == "input":
            fqn, user_index = f"input.{user_index}", user_index + 1
        else:
            fqn = spec.target
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise CaptureError(f"graph input {node.name} is a {type(val).__name__}, not a tensor; "
                               f"autopar takes tensor inputs only")
        out.append(PlaceholderInfo(node.name, kind, fqn, tuple(val.shape), val.dtype))
    return out


def _param_aliases(model: torch.nn.Module, ep: torch.export.ExportedProgram) -> dict[str, str]:
    """Every parameter key (tied duplicates included) -> the key whose placeholder the graph uses.

    Export may keep a placeholder per tied name but wire only one of them (HF GPT-2 keeps both
    ``wte.weight`` and ``lm_head.weight``); the used one is canonical, so every alias trains it.
    """
    specs = [s for s in ep.graph_signature.input_specs if s.kind == InputKind.PARAMETER]
    used = {n.name for n in ep.graph.nodes if n.op == "placeholder" and n.users}
    used_keys = {s.target for s in specs if s.arg.name in used}
    kept = {s.target for s in specs}
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    aliases = {}
    for names in groups.values():
        canonical = next((n for n in names if n in used_keys), next((n for n in names if n in kept), names[0]))
        aliases.update({n: canonical for n in names})
    return aliases
