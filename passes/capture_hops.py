"""Capture helper: inline the higher-order ops non-strict ``torch.export`` emits for ordinary model code.

Export keeps a region of ``forward`` that changes a global mode as one call of a higher-order op whose
body is a ``get_attr`` submodule; no later pass plans through such a call, so capture inlines them:

* ``wrap_with_set_grad_enabled(False, body, *xs)`` (code under ``torch.no_grad()``, e.g. the rotary
  embeddings of Llama, Mistral, Qwen2, Gemma, GPT-NeoX, Mixtral, Qwen2-MoE): inlining is exact for
  training when the region's outputs need no gradient with respect to its inputs, which is the case when
  no output depends on a parameter (position ids and frequency buffers need none). An output that does
  depend on a parameter gets an ``aten.detach`` after it, so its gradient is exactly zero, as under
  ``no_grad``: the inlined graph computes the same values and the same gradients as the region.
* ``wrap_with_set_grad_enabled(True, ...)``: autopar's graph always runs with gradients enabled, so the
  body runs unchanged.
* ``wrap_with_autocast(device, dtype, enabled=False, ...)``: autopar runs the graph without autocast
  (the ``precision`` option casts explicitly), so a region that switches autocast off runs unchanged.
* ``wrap_with_autocast(..., enabled=True, ...)`` and any other higher-order op (``cond``, ``while_loop``,
  ``map``, ``invoke_subgraph``, ...): one ``CaptureError`` naming the op, the model line it came from and
  the fix. Never a ``KeyError`` later.

Regions nest (Llama's no_grad region holds an autocast-off region): inlining repeats until none is left.
"""
from __future__ import annotations

import operator
import os
import re

import torch
import torch.fx as fx

from autopar.errors import CaptureError

_INLINE_FIXES = {
    "wrap_with_autocast": "remove the torch.autocast(enabled=True) region from forward and pass "
                          "precision='bf16' (or 'fp16') to autopar, which casts the whole model consistently",
}


def inline_higher_order_ops(gm: fx.GraphModule, trainable: set[str]) -> int:
    """Inline every supported higher-order op of ``gm`` in place (see module docstring); returns how many.
    The caller recompiles ``gm`` (capture does once, after its last edit: code generation for an 8B
    Llama's graph is a tenth of a CPU second each time).

    ``trainable``: names of the placeholders that carry parameters (what a no_grad output is checked
    against)."""
    count = 0
    while True:
        hops = [n for n in gm.graph.nodes if n.op == "call_function" and _is_hop(n.target)]
        if not hops:
            break
        for node in hops:
            _inline(gm, node, trainable)
            count += 1
    if count:
        _drop_unused_submodules(gm)
        gm.graph.lint()
    return count


def _is_hop(target) -> bool:
    return isinstance(target, torch._ops.HigherOrderOperator)


def _region(node: fx.Node, gm: fx.GraphModule) -> tuple[fx.Node, list, bool]:
    """(body get_attr node, operands, whether outputs are cut from autograd) of a supported region."""
    name = node.target.__name__
    if name == "wrap_with_set_grad_enabled":
        enabled, body, *operands = node.args
        return body, operands, not enabled
    if name == "wrap_with_autocast" and not node.args[2]:
        _device, _dtype, _enabled, _cache, body, *operands = node.args
        return body, operands, False
    raise CaptureError(_unsupported(node, gm))


def _unsupported(node: fx.Node, gm: fx.GraphModule) -> str:
    name = node.target.__name__
    detail = f"{name}{tuple(a for a in node.args if not isinstance(a, fx.Node))}"
    fix = _INLINE_FIXES.get(name, "rewrite that region without it (plain tensor ops, torch.where instead of "
                                  "torch.cond), or move it out of forward")
    return f"cannot capture the model: autopar does not support {detail}{_region_line(node, gm)}. Fix: {fix}."


def _region_line(node: fx.Node, gm: fx.GraphModule) -> str:
    """The model line of the region: the op's own stack trace, else the first traced op inside its body."""
    bodies = [getattr(gm, a.target) for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"]
    for candidate in [node] + [n for body in bodies if isinstance(body, fx.GraphModule) for n in body.graph.nodes]:
        line = model_line(candidate)
        if line:
            return line
    return ""


def model_line(node: fx.Node) -> str:
    """' at file:line (`code`)' of the innermost frame of the node's stack trace outside torch (the model's
    code), or ''."""
    lines = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines() if line.strip()]
    frames = [(line[5:], lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else "")
              for i, line in enumerate(lines) if line.startswith("File ")]
    outside = [f for f in frames if f"{os.sep}torch{os.sep}" not in f[0]]
    if not (outside or frames):
        return ""
    where, code = (outside or frames)[-1]
    parsed = re.match(r'"(.*)", line (\d+)', where)
    where = f"{parsed.group(1)}:{parsed.group(2)}" if parsed else where
    return f" at {where}" + (f" (`{code}`)" if code else "")


def _inline(gm: fx.GraphModule, node: fx.Node, trainable: set[str]) -> None:
    body_node, operands, cut_grad = _region(node, gm)
    body: fx.GraphModule = getattr(gm, body_node.target)
    env: dict[fx.Node, fx.Node] = {}
    placeholders = iter(operands)
    outputs = ()
    with gm.graph.inserting_before(node):
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                env[inner] = next(placeholders)
            elif inner.op == "output":
                outputs = inner.args[0]
            elif inner.op == "get_attr":
                env[inner] = _copy_attribute(gm, body, inner)
            else:
                env[inner] = gm.graph.node_copy(inner, lambda a: env[a])
        results = [env[o] if isinstance(o, fx.Node) else o for o in outputs]
        if cut_grad:
            results = [_detached(gm.graph, r) if _depends_on(r, trainable) else r for r in results]
    for user in list(node.users):
        assert user.target is operator.getitem, f"unexpected use of a {node.target.__name__} result: {user}"
        user.replace_all_uses_with(results[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)


def _copy_attribute(gm: fx.GraphModule, body: fx.GraphModule, inner: fx.Node) -> fx.Node:
    """A nested region's body (or a constant) moved up to ``gm`` under a fresh name."""
    value = getattr(body, inner.target)
    name, k = f"{inner.target}_inlined", 0
    while hasattr(gm, name):
        k += 1
        name = f"{inner.target}_inlined{k}"
    if isinstance(value, torch.nn.Module):
        gm.add_submodule(name, value)
    else:
        setattr(gm, name, value)
    new = gm.graph.get_attr(name)
    new.meta = dict(inner.meta)
    return new


def _depends_on(node, trainable: set[str]) -> bool:
    """Whether ``node`` is computed from a placeholder named in ``trainable``."""
    if not isinstance(node, fx.Node):
        return False
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and n.name in trainable:
            return True
        stack.extend(n.all_input_nodes)
    return False


def _detached(graph: fx.Graph, value: fx.Node) -> fx.Node:
    out = graph.call_function(torch.ops.aten.detach.default, (value,))
    out.meta = dict(value.meta)
    return out


def _drop_unused_submodules(gm: fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:
            target = node.target
            gm.graph.erase_node(node)
            if isinstance(getattr(gm, target, None), torch.nn.Module):
                delattr(gm, target)
