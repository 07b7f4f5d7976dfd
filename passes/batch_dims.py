"""Pass: which dim of each tensor carries the batch, and the graph at a microbatch.

Input:  ``ModelGraph`` captured at the global batch N.
Output: ``batch_dims(graph)`` -> {node name: dim or None}; ``rescale(graph, B)`` -> a ModelGraph whose
        ``meta["val"]`` shapes, and whose op arguments that hold the batch size, are those of one of B
        microbatches: when ``rescale_is_exact(graph)``, the very graph a capture at N/B gives.

A user input's batch dim is dim 0. The analysis walks the graph once and runs every op on fake tensors
at a probe batch N/p (p: N's smallest prime factor), with the inputs' dim 0 cut to N/p:

* an op's size arguments that hold the batch are rewritten for the probe: the element of a shape list
  (``view``, ``reshape``, ``expand``, factories) at the output dim that carries the batch, the end of an
  ``arange`` or of a full ``slice`` along a batch dim. Which output dim carries the batch comes from the
  op's sharding rule (the dim "every batch-carrying input split on its batch dim" maps to). An op the batch
  does not reach yet that builds a dim of size N from a constant (HF masks and position ids start from
  ``arange(batch)`` or ``expand(x, [batch, -1])``) is a batch source: that dim carries the batch;
* a node's batch dim is the one dim whose size the probe cut by p (None when its shape did not change).

The walk is exact when every op ran, every changed shape changed in one dim by exactly p, and wherever a
rule names the batch dim the probe changed that dim. Shapes are then linear in the batch, so ``rescale``
divides those dims and rewrites those arguments for any B dividing them, with no re-capture. Otherwise
(an op the fake tensors reject, a dim of size N that is not the batch, a ``select`` of one sample)
``rescale_is_exact`` is False, the dims fall back to the rules' propagation (what pricing needs), and
the driver captures the model again at the chosen microbatch for the graph it plans stages on.
"""
from __future__ import annotations

import contextlib
import copy
import logging

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Shard

from autopar.ir.ops import SIGNATURE_KEY, OpView
from autopar.passes.strategies import rule_for
from autopar.passes.strategies.base import all_replicated_rule
from autopar.placement import R

aten = torch.ops.aten
_ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
_MAX_CONSTANTS = 3  # batch-sized sizes read as constants before the walk gives up (see _probe_resolving_sources)


def batch_dims(graph) -> dict[str, int | None]:
    """{node name: its batch dim, or None} (see the module docstring)."""
    return _analysis(graph)[0]


def rescale_is_exact(graph) -> bool:
    """Whether ``rescale(graph, B)`` is exactly the graph a capture at the microbatch gives."""
    return _analysis(graph)[2]


def _analysis(graph) -> tuple[dict[str, int | None], dict[str, list], bool]:
    """(batch dims, size-argument sites per node, exact), cached on the graph."""
    cached = getattr(graph, "_batch_analysis", None)
    if cached is not None:
        return cached
    batch = graph.input_signature[0][0][0] if graph.input_signature and graph.input_signature[0][0] else 1
    probe = next((p for p in range(2, batch + 1) if batch % p == 0), None)
    result = _probe_resolving_sources(graph, batch, probe) if probe else None
    graph._batch_analysis = result or (_rule_dims(graph), {}, probe is None)
    return graph._batch_analysis


def _probe_resolving_sources(graph, batch: int, probe: int):
    """The walk, retried with a batch source read as a constant when the walk fails downstream of it (an
    ``arange(seq_len)`` where the sequence is as long as the batch): at most ``_MAX_CONSTANTS`` such reads,
    and each one kept only when the walk with it read as a source fails (the other reads fixed), so an
    answer is the one reading of those sizes whose shapes are consistent; otherwise None (not exact)."""
    constants: list[tuple] = []
    failed_with: set[frozenset] = set()
    while True:
        result = _probe(graph, batch, probe, frozenset(constants))
        if result[0] is not None:
            break
        failed_with.add(frozenset(constants))
        suspects = [key for key in result[1] if key not in constants]
        if not suspects or len(constants) == _MAX_CONSTANTS:
            return None
        constants.append(suspects[-1])
    for key in constants:  # each constant read must be forced: as a source, the walk fails
        others = frozenset(k for k in constants if k != key)
        if others not in failed_with and _probe(graph, batch, probe, others)[0] is not None:
            return None
    return result[0]


def _rule_dims(graph) -> dict[str, int | None]:
    """Batch dims by the sharding rules alone (the fallback of an inexact walk)."""
    out: dict[str, int | None] = {}
    for node in graph.gm.graph.nodes:
        if node.op == "placeholder":
            out[node.name] = _input_dim(graph, node)
        elif node.op == "call_function":
            out[node.name] = _rule_dim(node, out)
    return out


def _input_dim(graph, node: fx.Node) -> int | None:
    info = graph.placeholder(node.name)
    return 0 if info.kind == "input" and len(info.shape) > 0 else None


def _probe(graph, batch: int, probe: int, constants: frozenset = frozenset()):
    """The walk of the module docstring: ((dims, sites, True), []) when exact, else (None, the op keys of
    the batch sources upstream of the op that failed, in graph order). Identical ops (the same op on inputs
    of the same shapes, dtypes and batch dims: every repeated layer after the first) are run once; an op
    whose key is in ``constants`` is no batch source (its batch-sized sizes are constants)."""
    dims: dict[str, int | None] = {}
    sites: dict[str, list] = {}
    env: dict[fx.Node, object] = {}
    seen: dict[tuple, tuple] = {}
    source_keys: dict[fx.Node, tuple] = {}  # the batch sources met, by node: their op keys
    sizes = {batch}  # the sizes of every batch dim so far (the sizes a batch source may build)
    with _quiet_fake_tensors(), FakeTensorMode(allow_non_fake_inputs=True):
        for node in graph.gm.graph.nodes:
            if node.op == "placeholder":
                dims[node.name] = _input_dim(graph, node)
                env[node] = _fake_like(node.meta["val"], dims[node.name], probe)
            elif node.op == "get_attr":
                env[node] = getattr(graph.gm, node.target)
            elif node.op == "call_function":
                key = _op_key(node, dims, sizes)
                if key not in seen:
                    seen[key] = _run(node, dims, env, sizes, probe, key in constants)
                if seen[key] is None:
                    return None, _sources_upstream(node, source_keys)
                found, dims[node.name], env[node] = seen[key]
                if found:
                    sites[node.name] = found
                    if not any(dims.get(a.name) is not None for a in node.all_input_nodes):
                        source_keys[node] = key
                if dims[node.name] is not None:
                    sizes.update(t.shape[dims[node.name]] for t in _tensors(node.meta.get("val")))
    return (dims, sites, True), []


def _sources_upstream(failed: fx.Node, source_keys: dict[fx.Node, tuple]) -> list[tuple]:
    """The op keys of the batch sources ``failed`` reads from, directly or not, in graph order."""
    if not source_keys:
        return []
    seen, stack = {failed}, [failed]
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    keys = [key for node, key in source_keys.items() if node in seen]
    return list(dict.fromkeys(keys))


def _tensors(val) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(val) if isinstance(t, torch.Tensor)]


def _op_key(node: fx.Node, dims: dict[str, int | None], sizes: set[int]) -> tuple:
    """What decides an op's walk: its target, its non-tensor arguments (and which of them are batch
    sizes), its inputs' and output's shapes and dtypes, and its inputs' batch dims."""
    held = []

    def describe(a):
        if isinstance(a, fx.Node):
            return (_shapes(a.meta.get("val")), dims.get(a.name))
        if isinstance(a, (list, tuple)):
            return tuple(describe(v) for v in a)
        if isinstance(a, dict):
            return tuple((k, describe(v)) for k, v in a.items())
        if type(a) is int and a in sizes:
            held.append(a)
        return a if isinstance(a, (int, float, bool, str, type(None))) else str(a)
    return node.target, describe(node.args), describe(node.kwargs), _shapes(node.meta.get("val")), tuple(held)


def _shapes(val):
    if isinstance(val, torch.Tensor):
        return tuple(val.shape), val.dtype
    if isinstance(val, (list, tuple)):
        return tuple(_shapes(v) for v in val)
    return val if isinstance(val, (int, float, bool, type(None))) else str(val)


def _run(node: fx.Node, dims: dict[str, int | None], env: dict, sizes: set[int], probe: int,
         constant: bool = False):
    """(size sites, batch dim, probe value) of one op run at the probe batch, or None when not exact;
    ``constant``: the op is no batch source (see ``_probe``)."""
    fed = any(dims.get(a.name) is not None for a in node.all_input_nodes)
    found = [] if constant and not fed else _size_sites(node, dims, sizes)
    args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: env[a])
    args = _rewritten(args, found, lambda v: v // probe)
    try:
        out = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op that rejects the probe shapes: not exact
        return None
    dim, consistent = _changed_dim(node.meta.get("val"), out, probe)
    rule = _rule_dim(node, dims)
    if not consistent or (rule is not None and dim != rule):
        return None
    return found, dim, out


@contextlib.contextmanager
def _quiet_fake_tensors():
    """A meta kernel rejecting the probe's shapes is the signal of an inexact walk; fake_tensor would log
    it at ERROR with a traceback first, which must not reach the user during a successful plan."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


def _fake_like(val, dim: int | None, parts: int):
    shape = list(val.shape)
    if dim is not None:
        shape[dim] //= parts
    return torch.empty(shape, dtype=val.dtype, device=val.device)


def _rule_dim(node: fx.Node, dims: dict[str, int | None]) -> int | None:
    """The output dim the op's rule maps "batch-carrying inputs split on their batch dim" to (inputs the
    batch does not reach may be split too when no rule leaves them whole; exact matches win)."""
    view = OpView(node)
    wanted = tuple(Shard(dims[a.name]) if dims.get(a.name) is not None else R for a in view.tensor_args)
    if all(p.is_replicate() for p in wanted):
        return None
    fn = rule_for(node.target)
    rules = (fn(view) if fn is not None else []) + [all_replicated_rule(view)]
    for rule in sorted(rules, key=lambda r: r.inputs != wanted):
        if all(w.is_replicate() or got == w for w, got in zip(wanted, rule.inputs)):
            return rule.output.dim if rule.output.is_shard() else None
    return None


def _size_sites(node: fx.Node, dims: dict[str, int | None], sizes: set[int]) -> list[tuple[int, int | None]]:
    """The (argument index, list position or None) of each size argument that holds the batch: at the
    rule's batch dim when the batch reaches the op, else (a batch source) a size equal to a batch dim's
    size met so far (the batch itself, or a count of tokens or of routed tokens)."""
    out_shape = OpView(node).out_shape
    if out_shape is None:
        return []
    fed = [a for a in node.all_input_nodes if dims.get(a.name) is not None]
    dim = _rule_dim(node, dims) if fed else None
    if node.target in _ARANGES:
        end = 0 if node.target is aten.arange.default else 1
        start = node.args[0] if end == 1 else 0
        step_one = len(node.args) <= end + 1
        ok = len(out_shape) == 1 and start == 0 and step_one and node.args[end] == out_shape[0] in sizes
        return [(end, None)] if ok and not fed else []
    if node.target is aten.slice.Tensor and fed and len(node.args) > 3:
        source = node.args[0]
        along = dims.get(source.name) if isinstance(source, fx.Node) else None
        full = along is not None and node.args[1] % len(out_shape) == along
        return [(3, None)] if full and node.args[3] == source.meta["val"].shape[along] else []
    sites = []
    for i, arg in enumerate(node.args):
        if isinstance(arg, (list, tuple)) and len(arg) == len(out_shape) and all(type(v) is int for v in arg):
            sites += [(i, d) for d, v in enumerate(arg) if v == out_shape[d] and v > 1
                      and (d == dim if dim is not None else v in sizes)]
    return sites


def _rewritten(args: tuple, sites: list[tuple[int, int | None]], scale) -> tuple:
    args = list(args)
    for i, position in sites:
        if position is None:
            args[i] = scale(args[i])
        else:
            args[i] = type(args[i])(scale(v) if d == position else v for d, v in enumerate(args[i]))
    return tuple(args)


def _changed_dim(old, new, parts: int) -> tuple[int | None, bool]:
    """(the one dim the probe cut, whether every output changed consistently: one dim, by ``parts``)."""
    olds, news = pytree.tree_leaves(old), pytree.tree_leaves(new)
    if len(olds) != len(news):
        return None, False
    changed = set()
    for o, n in zip(olds, news):
        if not isinstance(o, torch.Tensor):
            if isinstance(n, torch.Tensor) or o != n:
                return None, False
            continue
        if not isinstance(n, torch.Tensor) or o.dim() != n.dim():
            return None, False
        moved = [d for d in range(o.dim()) if o.shape[d] != n.shape[d]]
        if len(moved) > 1 or any(o.shape[d] != n.shape[d] * parts for d in moved):
            return None, False
        changed.add(moved[0] if moved else None)
    if len(changed) > 1:
        return None, False
    return next(iter(changed), None), True


def rescale(graph, microbatches: int):
    """A copy of ``graph`` at one of ``microbatches`` microbatches (see the module docstring); when the
    walk was not exact, only the shapes are rescaled (pricing only: arguments keep the global batch).

    Raises ValueError when a batch dim does not divide by ``microbatches``.
    """
    if microbatches == 1:
        return graph
    dims, sites, _ = _analysis(graph)
    new_graph = fx.Graph()
    remap: dict[fx.Node, fx.Node] = {}
    new_graph.graph_copy(graph.gm.graph, remap)
    for old, new in remap.items():
        new.meta = dict(old.meta)
        new.meta["val"] = _scaled(old.meta.get("val"), dims.get(old.name), microbatches, old.name)
        new.meta.pop(SIGNATURE_KEY, None)
        if old.name in sites:
            new.args = _rewritten(new.args, sites[old.name], lambda v: _divided(v, microbatches, old.name))
    output = next(n for n in graph.gm.graph.nodes if n.op == "output")
    if not any(n.op == "output" for n in new_graph.nodes):
        new_graph.output(fx.map_arg(output.args[0], lambda n: remap[n]))
    scaled = copy.copy(graph)
    scaled.gm = fx.GraphModule(graph.gm, new_graph)
    scaled.__post_init__()
    return scaled


def _divided(size: int, parts: int, name: str) -> int:
    if size % parts:
        raise ValueError(f"{name}: a size of {size} does not split into {parts} microbatches; choose a "
                         f"microbatch count that divides the batch")
    return size // parts


def _scaled(val, dim: int | None, parts: int, name: str):
    if isinstance(val, (tuple, list)):
        return type(val)(_scaled(v, dim, parts, name) for v in val)
    if not isinstance(val, torch.Tensor):
        return val
    shape = list(val.shape)
    if dim is not None:
        if shape[dim] % parts:
            raise ValueError(f"{name}: batch dim {dim} of size {shape[dim]} does not split into {parts} microbatches; "
                             f"choose a microbatch count that divides the batch")
        shape[dim] //= parts
    return torch.empty(shape, dtype=val.dtype, device="meta")
