"""What one node and one input edge of a ``GroupBuilder`` cost: op time, resharding time, memory, cached.

Every price here is a pure function of what its cache key holds, so nodes with equal keys share one entry:

    node_time_k(name, k)        key (strategy signature, k, needs gradient, boundary value)
    edge_time_id(arg, node, idx, src, src_id, k)
                                key (reader's signature, input position, source spec number, k, gradient flags)
    CostEnv.reshard             key (shape, dtype, source and read spec numbers, gradient axes, flags)

Specs are held by ``spec_number`` (equal specs, equal numbers, the same in every builder of the process):
hashing a spec hashes each of its DTensor Placements in Python, and these caches are probed millions of
times per plan. A strategy list's numbers, and each input's Partial-gradient axes
(``redistribute.grad_partial_axes``), are worked out once per list (``strategy_spec_ids``, ``strategy_reads``):
nodes of one signature share the list object.

Terms (seconds per training step, B = env.microbatches): an op costs B · (its roofline time + its kernels'
collectives); an input edge B · (forward + backward resharding), but a parameter's gradient synchronization
once per step (bucketed, ``redistribute_cost(bucketed_sync=True)``).
"""
from __future__ import annotations

import numpy as np
import torch.fx as fx

from autopar.cost_models.communication import spec_number
from autopar.cost_models.compute import cast_time, compute_time, local_bytes
from autopar.cost_models.experts import dispatch_seconds, kernel_saved_bytes, with_expert_load
from autopar.ir.ops import OpView
from autopar.passes.strategies.base import Strategy
from autopar.placement import local_shape
from autopar.redistribute import grad_partial_axes


class NodePrices:
    """The price methods of ``GroupBuilder`` (which sets the attributes used here: env, graph views,
    gradient sets and the caches ``_node_time``, ``_edge_time``, ``_spec_ids``)."""

    def spec_id(self, spec) -> int:
        """A number per distinct spec (``spec_number``): equal specs, equal numbers (price-cache keys use it)."""
        return spec_number(spec)

    def _numbered(self, name: str) -> tuple:
        """(strategies, per strategy (input spec numbers, output spec number), per strategy and input
        (read spec number, Partial-gradient axes)), once per strategy list."""
        strategies = self.strategies[name]
        hit = self._spec_ids.get(id(strategies))
        if hit is None:  # the list is kept in the entry, so its id cannot be reused while the entry lives
            ids = [(tuple(spec_number(spec) for spec in s.in_specs), spec_number(s.out_spec)) for s in strategies]
            reads = [tuple((dst, grad_partial_axes(spec, s.out_spec)) for dst, spec in zip(in_ids, s.in_specs))
                     for s, (in_ids, _) in zip(strategies, ids)]
            hit = self._spec_ids[id(strategies)] = (strategies, ids, reads)
        return hit

    def strategy_spec_ids(self, name: str) -> list[tuple[tuple[int, ...], int]]:
        """Per strategy of ``name``: (``spec_id`` of each input spec, of the output spec)."""
        return self._numbered(name)[1]

    def strategy_reads(self, name: str) -> list[tuple[tuple[int, tuple[int, ...]], ...]]:
        """Per strategy of ``name``, per input: (``spec_id`` it is read in, ``grad_partial_axes`` of that read)."""
        return self._numbered(name)[2]

    def node_time_k(self, name: str, k: int) -> tuple[float, float]:
        """(seconds per step, of which communication) of the op itself under its k-th strategy."""
        # a boundary value runs in an earlier stage (0 here) and indexes placeholder strategies, so it never
        # shares an entry with an interior node of its signature
        key = (self.sig[name], k, name in self.requires_grad, name in self.boundary)
        if key not in self._node_time:
            view = self.views.get(name)
            self._node_time[key] = self._node_time_of(self.nodes[name], view, self.strategies[name][k]) \
                if view is not None and self.nodes[name].op == "call_function" else (0.0, 0.0)
        return self._node_time[key]

    def _node_time_of(self, node: fx.Node, view: OpView, strat: Strategy) -> tuple[float, float]:
        env = self.env
        grad = node.name in self.requires_grad
        routing = env.training.expert_routing
        loaded = with_expert_load(view, strat, env.mesh_shape, routing, grad)  # busiest expert shard, recompute
        t = compute_time(node, loaded, view.in_vals, view.out_vals, env.mesh_shape, env.cluster, grad)
        t += cast_time(self.casts.get(node.name, ()), view.in_vals, strat.in_specs, env.mesh_shape, env.cluster, grad)
        comm = sum(self._kernel_comm(view, axis, tag, strat) for axis, tag in strat.kernels)
        return env.microbatches * (t + comm), env.microbatches * comm

    def _kernel_comm(self, view: OpView, axis: int, tag: str, strat: Strategy) -> float:
        link = self.env.links[axis]
        if tag == "ce_class":  # max, sum-exp and target logit of the local rows
            return 3 * link.time("all_reduce", view.in_shapes[0][0] * 4)
        if tag == "ce_batch":
            return link.time("all_reduce", 8)
        if tag == "causal_context":  # zig-zag balance: half a local query block out and back, forward and backward
            half = local_bytes(view.in_vals[0], strat.in_specs[0], self.env.mesh_shape) / 2
            return 4 * link.time("send", half)
        if tag == "expert_all_to_all":  # token rows to their experts' devices and back (cost_models.experts)
            return dispatch_seconds(view, axis, strat, self.env.mesh_shape, link, self.env.training.expert_routing)
        return 0.0

    def edge_time_k(self, arg: fx.Node, node: fx.Node, idx: int, src, k: int) -> tuple[float, float]:
        """``edge_time`` for the node's k-th strategy, cached by structure (signature, input, specs, flags)."""
        return self.edge_time_id(arg, node, idx, src, self.spec_id(src), k)

    def edge_time_id(self, arg: fx.Node, node: fx.Node, idx: int, src, src_id: int, k: int) -> tuple[float, float]:
        """``edge_time_k`` with the source spec's ``spec_id`` given (the cache key holds the number)."""
        arg_grad, param = arg.name in self.requires_grad, arg.name in self.params
        key = (self.sig[node.name], idx, src_id, k, arg_grad, node.name in self.requires_grad, param)
        hit = self._edge_time.get(key)
        if hit is None:
            dst_id, axes = self.strategy_reads(node.name)[k][idx]
            dst = self.strategies[node.name][k].in_specs[idx]
            hit = self._edge_time[key] = self._edge_price(arg, node, idx, (src, dst), (src_id, dst_id),
                                                          axes if arg_grad else ())
        return hit

    def edge_time(self, arg: fx.Node, node: fx.Node, idx: int, src, strat: Strategy) -> tuple[float, float]:
        """(per-step seconds of per-microbatch traffic, per-step seconds of gradient sync) of one input."""
        dst = strat.in_specs[idx]
        axes = grad_partial_axes(dst, strat.out_spec) if arg.name in self.requires_grad else ()
        return self._edge_price(arg, node, idx, (src, dst), (spec_number(src), spec_number(dst)), axes)

    def _edge_price(self, arg: fx.Node, node: fx.Node, idx: int, specs: tuple, numbers: tuple[int, int],
                    axes: tuple[int, ...]) -> tuple[float, float]:
        """``edge_time`` of reading ``arg`` in ``specs[0]`` as ``specs[1]`` (``numbers``: their ``spec_number``s)
        with the gradient axes ``axes`` (empty when ``arg`` needs no gradient)."""
        if numbers[0] == numbers[1] and not axes:
            return 0.0, 0.0
        val = self.views[node.name].in_vals[idx]
        needs_grad = arg.name in self.requires_grad and node.name in self.requires_grad
        param = arg.name in self.params
        fwd, bwd = self.env.reshard(val, *specs, axes if needs_grad else (), needs_grad, bucketed_sync=param,
                                    numbers=numbers)
        if param:
            return self.env.microbatches * fwd, bwd
        return self.env.microbatches * (fwd + bwd), 0.0

    def replay_bytes(self, name: str, strat: Strategy) -> float:
        """Bytes a recomputed op's replay re-creates: what it would save of one microbatch without recompute."""
        share = self.saved_without_recompute.get(name, 0.0)
        if not share:
            return 0.0
        val = self.nodes[name].meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else [val]
        return share * sum(local_bytes(v, strat.out_spec, self.env.mesh_shape) for v in vals)

    def node_memory(self, name: str, strat: Strategy) -> tuple[float, float]:
        """(parameter-state bytes, saved-activation bytes × in-flight microbatches) of one node."""
        node = self.nodes[name]
        val = node.meta.get("val")
        if node.op == "placeholder" and name in self.params:
            numel = np.prod(local_shape(tuple(val.shape), strat.out_spec, self.env.mesh_shape))
            ways = int(np.prod([size for size, p in zip(self.env.mesh_shape, strat.out_spec) if not p.is_shard()]))
            return self.env.training.param_bytes(name, float(numel), val.dtype, ways), 0.0
        share = self.saved.get(name, 0.0)
        view = self.views.get(name)
        kernel = 0.0 if view is None or name in self.env.recomputed else \
            kernel_saved_bytes(view, strat, self.env.mesh_shape, self.env.training.expert_routing)
        if (not share and not kernel) or name in self.boundary:
            return 0.0, 0.0
        vals = val if isinstance(val, (tuple, list)) else [val]
        act = share * self.env.inflight * sum(local_bytes(v, strat.out_spec, self.env.mesh_shape) for v in vals)
        return 0.0, act + self.env.inflight * kernel
