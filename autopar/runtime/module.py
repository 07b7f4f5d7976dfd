"""``ParallelModule``: what ``autopar.compile`` returns on each rank.

Contract (tests outside this repository rely on it):
  * ``pm(*inputs)`` runs forward on the global batch every rank passes and returns the full output on
    every rank; under ``autopar.compile(..., data="local")`` each rank passes only its share of the batch,
    ``pm.data_shard`` = (index, count) (``runtime.local_data``), and outputs are still the global ones;
  * ``pm.train_step(*inputs)`` runs forward and backward of the model's loss, leaves each local shard's
    gradient in ``.grad`` (accumulating, as PyTorch does; call ``optimizer.zero_grad()``), and returns
    the loss, identical on every rank and detached (``.item()`` it; backward has already run);
  * any torch optimizer built from ``pm.parameters()`` steps what this rank owns under every plan (ZeRO
    shards, fp16 loss scaling: ``runtime.plain_optim``); ``pm.optimizer(torch.optim.AdamW, lr=...,
    param_groups=[{"params": ["*.bias"], "weight_decay": 0.0}])`` builds one with param groups named by the
    model's parameter names;
  * ``pm.parameters()`` are this rank's shards, so any torch optimizer steps them; for the same reason
    ``pm.state_dict()`` holds this rank's shards only (use ``full_state_dict()`` for whole tensors, or
    ``autopar.runtime.checkpoint`` for sharded checkpoints); with ZeRO-3 it is a collective of each
    data-parallel group and holds copies of the parameters (they are sharded between uses);
  * ``pm.full_state_dict()`` has the keys and shapes of ``model.state_dict()``;
  * ``pm.plan`` is the Plan, ``pm.code`` the generated code of this rank;
  * ``pm.step_stats()`` gives step time, tokens/s (or samples/s) and MFU of the ``train_step`` calls so far.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.utils._pytree as pytree

from autopar.errors import InputError, UsageError
from autopar.placement import parse_spec
from autopar.runtime import clipping, devices, faults, modes, plain_optim, rng
from autopar.runtime.collectives import gather_full
from autopar.runtime.input_checks import check_index_ranges, index_checks, wrong_device
from autopar.runtime.module_guards import FixedPlacement, bind_inputs, check_autograd_on
from autopar.runtime.optimizer_hooks import watch_optimizers
from autopar.runtime.throughput import StepClock, model_flops, step_stats


class ParallelModule(FixedPlacement, torch.nn.Module):
    def __init__(self, plan, graph, runner, state_keys: list[str], unused: dict[str, torch.Tensor], local_data=None):
        super().__init__()
        self._local_data = local_data  # ``runtime.local_data.LocalData`` under data="local", else None
        self.plan = plan
        self.runner = runner
        self._graph = graph
        self._state_keys = state_keys
        self._unused = unused
        self._loss_index = _find_loss_index(graph.out_spec, graph.gm)
        self._index_checks = index_checks(graph)
        if not hasattr(runner, "plan"):
            runner.plan = plan
        plain_optim.tag(runner)
        self._rng = rng.ModuleRng.agreed(plan.cluster.get("device_type", "cpu"))  # the ranks' shared dropout stream
        self._clock, self._flops = StepClock(), None  # ``step_stats``
        watch_optimizers()
        clipping.patch_torch()

    # ---- running -------------------------------------------------------------------------------
    @faults.collective_call("pm(...)")
    def forward(self, *inputs, **named):
        inputs = bind_inputs(self._input_names(), inputs, named, "pm(...)", self._local_data is not None)
        self._check_inputs(inputs)
        with self._rng.active():
            flat = self.runner.forward(inputs)
        return pytree.tree_unflatten(list(flat), self._graph.out_spec)

    @faults.collective_call("pm.train_step")
    def train_step(self, *inputs, **named) -> torch.Tensor:
        """Forward + backward of the loss on the global batch; returns the loss, detached (backward has
        run already, so there is nothing to call ``.backward()`` on) and the same on every rank. Inputs
        may be passed by forward's argument names as well."""
        self._clock.tick()
        inputs = bind_inputs(self._input_names(), inputs, named, "pm.train_step(...)",
                             self._local_data is not None)
        check_autograd_on("pm.train_step")
        self._check_inputs(inputs)
        if self._loss_index is None:
            raise InputError("train_step needs forward to return the loss: a scalar tensor, or a dict/"
                             "ModelOutput with a 'loss' entry. Wrap the model so forward returns the loss.")
        with self._rng.active():
            loss = self.runner.train_step(inputs, self._loss_index)
        clipping.mark_gradients(self.runner)
        return loss

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        """``torch.nn.utils.clip_grad_norm_`` of the whole model (a collective: call on every rank): the
        norm of the full gradient (tensor-parallel shards, replicated parameters counted once, ZeRO shards,
        every pipeline stage, fp16 unscaled), returned as a tensor equal on every rank, and every gradient
        the optimizer steps scaled by min(1, max_norm / (norm + 1e-6)). ``torch.nn.utils.clip_grad_norm_(
        pm.parameters(), max_norm)`` does the same (``runtime.clipping``)."""
        return clipping.clip_grad_norm_(self.runner, self.plan, max_norm, norm_type, error_if_nonfinite)

    def optimizer(self, cls=torch.optim.AdamW, param_groups: list[dict] | None = None, **kwargs):
        """``cls(params, **kwargs)`` (a real torch optimizer: LR schedulers take it) over this rank's trainable
        tensors. ``param_groups``: [{"params": [model parameter names or globs], **settings}, ...] as torch's
        param groups but by the model's names (e.g. ``[{"params": ["*.bias", "*ln*"], "weight_decay": 0.0}]``);
        parameters no group names form a last group with ``kwargs``. Under ZeRO it steps this rank's shard
        of each bucket, under fp16 it unscales and skips overflowed steps (``runtime.plain_optim``)."""
        from autopar.runtime.optim import named_groups

        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise UsageError(f"pm.optimizer(cls, **kwargs) takes a torch optimizer class and its arguments, e.g. "
                             f"pm.optimizer(torch.optim.AdamW, lr=1e-3); got {cls!r}")
        if any(getattr(r, "offload_optimizer", False) for r in clipping.stage_runners(self.runner)):
            if param_groups is not None:
                raise UsageError("param_groups with optimizer state offloaded to host memory is not supported; "
                                 "plan without offload, or give one group's settings as keyword arguments")
            from autopar.runtime.optim import PlanOptimizer

            return PlanOptimizer(self.runner, cls, **kwargs)  # it steps host copies (``runtime.offload``)
        named = self.named_model_parameters()
        if param_groups is None:
            groups = list({id(t): t for t in named.values() if t is not None and t.requires_grad}.values())
        else:
            groups = named_groups(named, param_groups)
        try:
            optimizer = cls(groups, **kwargs)
        except TypeError as e:
            if "argument" not in str(e):
                raise
            raise UsageError(f"pm.optimizer({cls.__name__}, ...): {e}; pass the arguments {cls.__name__} "
                             f"takes") from None
        plain_optim.runners_of(optimizer)
        return optimizer

    def named_model_parameters(self) -> "OrderedDict[str, torch.Tensor | None]":
        """{the model's parameter name: this rank's tensor of it (its shard), or None where another
        pipeline stage holds it}, tied names included (both names give the same tensor)."""
        modules = list(self.runner.gm) if isinstance(self.runner.gm, torch.nn.ModuleList) else [self.runner.gm]
        by_fqn = {}
        for info in self._graph.placeholders:
            if info.kind == "parameter":
                by_fqn[info.fqn] = next((getattr(m, info.name) for m in modules if hasattr(m, info.name)), None)
        out = OrderedDict()
        for key in self._state_keys:
            canonical = self._graph.param_aliases.get(key, key)
            if canonical in by_fqn:
                out[key] = by_fqn[canonical]
        return out

    def _input_names(self) -> list[str]:
        return [p.name for p in self._graph.placeholders if p.kind == "input"]

    @property
    def data_shard(self) -> tuple[int, int]:
        """``(index, count)``: the share of the batch this rank passes. Under data="local", rows
        [index·B/count, (index+1)·B/count) of the global batch of B rows (the global batch is the count
        shares in index order; ranks with the same share pass the same rows; ``runtime.local_data``);
        under data="global", (0, 1): the whole batch."""
        return (0, 1) if self._local_data is None else self._local_data.share

    def train(self, mode: bool = True) -> "ParallelModule":
        """As ``nn.Module.train``, and the generated modules' dropout, BatchNorm and attention dropout switch
        to ``mode`` as the model's own would (``runtime.modes``); ``pm.eval()`` is ``pm.train(False)``."""
        super().train(mode)
        modes.set_training(self.runner, mode)
        return self

    def step_stats(self, warmup: int = 1) -> dict:
        """Throughput of the ``train_step`` calls so far on this rank: ``step_time`` (s, the mean wall-clock
        between consecutive calls after the first ``warmup`` intervals), ``tokens_per_s`` (or
        ``samples_per_s``), ``model_flops`` per step, ``flops_per_s``, and ``mfu`` against the cluster's peak
        for the plan's precision. See ``autopar.runtime.throughput``."""
        if self._flops is None:
            self._flops = model_flops(self._graph, self.plan.microbatches)
        return step_stats(self._clock, self.plan, *self._flops[:1], warmup, self._flops[1])

    @property
    def code(self) -> str:
        """The generated Python of this rank's module(s)."""
        return self.runner.code

    # ---- state ---------------------------------------------------------------------------------
    def state_dict(self, *args, **kwargs):
        """``nn.Module.state_dict``; ZeRO-3 parameters are gathered first (a collective) and copied, as their
        storage is freed again at the next use (``runtime.zero3``)."""
        units = getattr(getattr(self.runner, "gradsync", None), "units", None)
        for unit in getattr(units, "units", ()):
            unit.materialize(writes=False)
        out = super().state_dict(*args, **kwargs)
        for unit in getattr(units, "units", ()):
            for name in unit.bucket.names:
                for key in [k for k in out if k.endswith("." + name)]:
                    out[key] = out[key].clone()
        return out

    @faults.collective_call("pm.full_state_dict")
    def full_state_dict(self) -> "OrderedDict[str, torch.Tensor]":
        """Full tensors for every key of the original ``model.state_dict()`` (a collective: call on all ranks).

        Each parameter or buffer is gathered whole inside the first stage that holds it and, when the
        plan has several stages, broadcast from that stage to every rank."""
        full = {}
        for info in self._graph.placeholders:
            if info.kind in ("parameter", "buffer"):
                value = self._gather_whole(info)
                if value is not None:
                    full[info.fqn] = value
        out = OrderedDict()
        for key in self._state_keys:
            canonical = self._graph.param_aliases.get(key, key)
            if canonical in full:
                out[key] = full[canonical]
            elif key in self._unused:
                out[key] = self._unused[key]
            else:
                raise KeyError(f"no value for state key {key!r}")
        return out

    def _gather_whole(self, info) -> torch.Tensor | None:
        node = self._graph.gm.graph.find_nodes(op="placeholder", target=info.name)[0]
        if not node.users:
            return None  # never read (a tied weight's unused copy): taken from its alias or ``unused``
        owner = next(s for s in self.plan.stages if info.name in s.shardings)
        local, spec, mesh_index = self.runner.local_state(info.name)
        if local is not None and self.runner.holds(owner.index):
            whole = gather_full(local, parse_spec(spec), mesh_index).detach().clone()
        else:
            whole = torch.empty(info.shape, dtype=info.dtype, device=devices.wire_device())
        if len(self.plan.device_stages) > 1:
            whole = devices.to_wire(whole)
            faults.guard("broadcast", None, torch.distributed.broadcast, whole, src=owner.ranks[0])
        return whole

    def _check_inputs(self, inputs) -> None:
        if self._local_data is not None:
            return self._check_local_inputs(inputs)
        wrong = wrong_device(self.plan.cluster.get("device_type", "cpu"), inputs)
        if wrong:
            raise InputError(wrong)
        want = self.plan.input_signature
        got = [(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else (None, type(t).__name__)
               for t in inputs]
        if len(got) != len(want) or any(tuple(g[0] or ()) != tuple(w[0]) or g[1] != w[1] for g, w in zip(got, want)):
            raise InputError(f"inputs {got} differ from the example inputs the plan was made for {want}; "
                             f"pass the same shapes and dtypes (every rank passes the global batch)"
                             f"{_advice(got, want)}")
        check_index_ranges(self._index_checks, inputs, self.plan.microbatches)

    def _check_local_inputs(self, inputs) -> None:
        """data="local": this rank's share checked here, then every rank's verdict agreed on (a collective),
        so a wrong share or a bad index on one rank is the same error on all (``local_data.agree``)."""
        self._local_data.agree(inputs, lambda: self._local_error(inputs))

    def _local_error(self, inputs) -> str | Exception | None:
        """What is wrong with this rank's correctly shaped share: its device, or an index out of range."""
        from autopar.errors import IndexRangeError
        from autopar.runtime.input_checks import check_local_index_ranges

        wrong = wrong_device(self.plan.cluster.get("device_type", "cpu"), inputs)
        if wrong:
            return wrong
        try:
            check_local_index_ranges(self._index_checks, inputs)
        except IndexRangeError as e:
            return e
        return None

    def share_state_of(self, other: "ParallelModule") -> None:
        """Use ``other``'s parameter and buffer tensors in place of this module's own (``autopar.compile(...,
        share_with=other)``): both modules then read and train the same tensors. Each must have the same spec
        and local shape here and there, or PlanError names it."""
        from autopar.errors import PlanError

        if hasattr(self.runner, "chunks") or hasattr(other.runner, "chunks"):
            raise PlanError("share_with does not support interleaved 1F1B plans (several model chunks per rank); "
                            "compile both modules with schedule='1f1b'")
        sync = getattr(self.runner, "gradsync", None)
        if any(b.level >= 1 for b in getattr(sync, "buckets", ())) or any(
                b.level >= 1 for b in getattr(getattr(other.runner, "gradsync", None), "buckets", ())):
            raise PlanError("share_with needs ZeRO level 0 (sharded optimizer state belongs to one module's "
                            "optimizer); compile both modules with zero=0, or drop the smaller batch")
        for info in self._graph.placeholders:
            if info.kind not in ("parameter", "buffer"):
                continue
            mine, spec, _ = self.runner.local_state(info.name)
            theirs, their_spec, _ = other.runner.local_state(info.name)
            if mine is None and theirs is None:
                continue
            if mine is None or theirs is None or spec != their_spec or mine.shape != theirs.shape:
                raise PlanError(f"cannot share {info.fqn}: it is {their_spec} there and {spec} here on this rank "
                                f"(the planner could not keep its layout for these inputs); drop this batch or "
                                f"plan both modules with the same pin for it")
            setattr(self.runner.gm, info.name, theirs)
        if sync is not None:  # its hooks and buffers hold this module's own tensors: rebuild over the shared ones
            self.runner.gradsync = sync.over(self.runner.gm)
        self._unused = other._unused

    # ---- checkpoints (autopar.runtime.checkpoint) -----------------------------------------------------
    @faults.collective_call("pm.save")
    def save(self, path, optimizer: torch.optim.Optimizer | None = None, step: int | None = None,
             position: dict | None = None) -> None:
        """Sharded checkpoint (torch.distributed.checkpoint) of this module and ``optimizer`` in the directory
        ``path``: each rank writes only its shards; all or nothing (a crash leaves the previous checkpoint
        whole). ``step``, ``position`` (JSON: where the run is, e.g. ``autopar.data.GlobalSampler.state_dict()``)
        and the fp16 loss scaler are recorded in its manifest. Call on every rank."""
        from autopar.runtime import checkpoint

        checkpoint.save(self, path, optimizer, step, position)

    @faults.collective_call("pm.load")
    def load(self, path, optimizer: torch.optim.Optimizer | None = None) -> dict:
        """Load a checkpoint written by ``save`` under any plan and world size, in place (``optimizer``
        must be built from ``pm.parameters()``), after checking every file against its manifest, and the loss
        scaler; returns the manifest (``["step"]``, ``.get("position")``). Call on every rank."""
        from autopar.runtime import checkpoint

        return checkpoint.load(self, path, optimizer)

    @faults.collective_call("pm.save_pretrained")
    def save_pretrained(self, directory, prefix: str = "", max_shard_size="5GB") -> None:
        """Hugging Face sharded safetensors (``model.safetensors.index.json``) of the state-dict keys under
        ``prefix`` (taken off the keys), plus the model's config.json, in ``directory``: each tensor is
        assembled inside one stage and written by one of its ranks; no rank holds the whole model; existing
        files are replaced whole or kept. Call on every rank. See ``autopar.runtime.pretrained_save``."""
        from autopar.runtime import pretrained_save

        pretrained_save.save_pretrained(self, directory, prefix, max_shard_size)

    @faults.collective_call("pm.export")
    def export(self, path) -> None:
        """``torch.save`` the full single-device state dict to ``path`` from rank 0 (gathers every
        parameter; for models too big for one device, use ``save`` + ``export_state_dict``). Call on every rank."""
        from autopar.runtime import checkpoint

        checkpoint.export(self, path)


def _advice(got: list, want: list) -> str:
    """How to run inputs of other shapes; for a smaller batch, a module that keeps training these weights."""
    same_rest = len(got) == len(want) and all(
        g[1] == w[1] and g[0] is not None and len(g[0]) == len(w[0]) and tuple(g[0][1:]) == tuple(w[0][1:])
        for g, w in zip(got, want))
    if len(got) == 1 and got[0][0] is None and got[0][1] in ("list", "tuple") and len(want) > 1:
        return "; pass the tensors as separate arguments: pm.train_step(*batch), not pm.train_step(batch)"
    if same_rest and got and got[0][0] and got[0][0][0] < want[0][0][0]:
        return ("; for a smaller (last) batch, compile a module for it that shares this one's parameters: "
                "small = autopar.compile(model, cluster, batch, share_with=pm) on every rank (the optimizer over "
                "pm.parameters() then trains both), or drop it (DataLoader(drop_last=True))")
    return "; or re-plan for these inputs"


def _find_loss_index(out_spec, gm) -> int | None:
    """Index of the loss among the flat outputs: the only output, or the 'loss' entry of a dict-like."""
    n = out_spec.num_leaves
    tree = pytree.tree_unflatten(list(range(n)), out_spec)
    if isinstance(tree, int):
        index = tree
    elif hasattr(tree, "keys") and "loss" in tree.keys():
        index = tree["loss"]
    elif isinstance(tree, (tuple, list)) and len(tree) == 1 and isinstance(tree[0], int):
        index = tree[0]
    else:
        return None
    output = next(n for n in gm.graph.nodes if n.op == "output")
    val = pytree.tree_leaves(output.args[0])[index].meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 0 or not val.dtype.is_floating_point:
        return None
    return index
