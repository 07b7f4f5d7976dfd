"""Sharded checkpoints on torch.distributed.checkpoint (DCP): save, load into any plan, export.

    pm.save(path, optimizer, step=None)  # every rank writes only the shards it owns; all or nothing
    pm.load(path, optimizer)      # any plan, any world size: DCP reads the slices each rank now holds
    export_state_dict(path)       # one process, no process group: a plain ``model.state_dict()``

Keys of the checkpoint (DCP flattens nested dicts with "."):
  ``model.<fqn>``           each parameter/buffer of ``model.state_dict()`` that the graph carries, under its
                            canonical key (a tied weight is stored once; ``autopar`` lists its aliases);
                            state-dict entries the graph never reads are stored whole (replicated);
  ``optim.<fqn>.<name>``    that parameter's optimizer state (e.g. exp_avg, exp_avg_sq, step);
  ``optim_groups``          the optimizer's param-group hyperparameters (a tuple, so DCP keeps it whole);
  ``autopar``               JSON: format, model name, state-dict keys in order, aliases, world size.

Files, crash safety and verification: ``autopar.runtime.checkpoint_files`` (a save goes to a staging
directory and is switched in by rename once rank 0 has written and checked ``manifest.json``; a load
checks every file's size and SHA-256 and unpickles nothing but plain metadata before touching the model).

Invariants:
  * a local shard is wrapped (sharing storage, no copy) as a DTensor on its stage's mesh with the plan's
    placements, so DCP records the global shape and this shard's offsets: no rank gathers a parameter,
    and DCP writes each replicated chunk once;
  * optimizer state shaped like its parameter takes the parameter's placements; other state (the step
    count) is replicated; the flat shard state of a ZeRO ≥ 1 bucket is written under its parameters' own
    keys as rectangles at their global offsets (``checkpoint_zero``), so any plan reads it back;
  * a parameter held by several pipeline stages is saved by the lowest-index stage only; on load every
    holder reads it;
  * load writes into the live parameters, buffers and optimizer state in place.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.errors import CheckpointError
from autopar.placement import parse_spec
from autopar.runtime import checkpoint_files as files
from autopar.runtime import checkpoint_paths as paths
from autopar.runtime import faults, plain_optim
from autopar.runtime.checkpoint_zero import bucket_entries

FORMAT = 2  # 2: manifest.json, staging directory switched in by rename


# ---- public entry points -------------------------------------------------------------------------
def save(pm, path, optimizer: torch.optim.Optimizer | None = None, step: int | None = None,
         position: dict | None = None) -> None:
    """Write ``pm``'s shards (and ``optimizer``'s state) as the checkpoint directory ``path``, all or
    nothing; ``step``, ``position`` (rank 0's JSON-able record of where the run is, e.g. its data sampler's
    ``state_dict()``) and the fp16 loss scaler's state are recorded in the manifest. Collective."""
    paths.check_path_argument(path, "pm.save")
    _check_optimizer_argument(optimizer, "pm.save")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise CheckpointError(f"pm.save(path, step={step!r}): step must be None or a non-negative int (the "
                              f"training step the checkpoint holds, returned by pm.load(path)['step'])")
    held = _held_tensors(pm)
    owners = _lowest_stage_holding(held)
    model = {fqn: t for fqn, (t, stage_index) in held.items() if owners[fqn] == stage_index}
    state = {"model": {**model, **_unread_entries(pm)}, "autopar": _meta_json(pm, optimizer is not None)}
    if optimizer is not None:
        state["optim"] = _optimizer_entries(pm, optimizer, set(model))
        state["optim_groups"] = _param_group_hyperparameters(optimizer)
    extra = {"position": _json_checked(position)} if position is not None else {}
    extra["rng"] = _rng_states(pm)
    scaler = getattr(pm.runner, "scaler", None)
    if scaler is not None:
        extra["loss_scaler"] = {"scale": scaler.scale, "clean_steps": scaler.clean_steps, "skipped": scaler.skipped}
    files.save_atomically(state, path, step, pm.plan.digest(), extra)


def _json_checked(position: dict) -> dict:
    try:
        return json.loads(json.dumps(position))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"pm.save(position=...) must be JSON (dicts, lists, numbers, strings): {e}") from None


def load(pm, path, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Fill ``pm``'s shards (and ``optimizer``'s state) in place from the checkpoint at ``path``, whatever
    plan and world size saved it. Collective. Verifies every file first; returns the manifest."""
    paths.check_path_argument(path, "pm.load")
    _check_optimizer_argument(optimizer, "pm.load")
    directory = files.resolve(path)
    manifest = files.verify(directory)
    metadata = files.read_metadata(directory)
    model = {fqn: t for fqn, (t, _) in _held_tensors(pm).items()}
    state = {"model": {**model, **_unread_entries(pm)}}
    if optimizer is not None:
        if "optim_groups" not in metadata.state_dict_metadata:
            raise CheckpointError(f"checkpoint {str(directory)!r} was saved without optimizer state; call "
                                  f"pm.load(path) without an optimizer, or save with pm.save(path, optimizer)")
        _materialize_state(optimizer)
        state["optim"] = _optimizer_entries(pm, optimizer, set(model))
        state["optim_groups"] = ()
    _check_matches(directory, metadata, state)
    files.load_state(state, directory)
    if optimizer is not None:
        _restore_objects(pm, optimizer, state["optim"])
        _set_param_group_hyperparameters(optimizer, state["optim_groups"], directory)
    _restore_loss_scaler(pm, manifest.get("loss_scaler"))
    _restore_rng(pm, manifest.get("rng"), manifest.get("plan_digest") == pm.plan.digest())
    return manifest


def _rng_states(pm) -> list:
    """Every rank's dropout stream state (``runtime.rng``), by rank (a collective)."""
    states = [None] * dist.get_world_size()
    faults.guard("all_gather_object", None, dist.all_gather_object, states, pm._rng.state_dict())
    return states


def _restore_rng(pm, saved: list | None, same_plan: bool) -> None:
    """This rank's saved stream under the same plan; rank 0's under another (every rank then shares one
    state, as a stage's ranks must)."""
    if saved:
        mine = saved[dist.get_rank()] if same_plan and len(saved) == dist.get_world_size() else saved[0]
        pm._rng.load_state_dict(mine)


def _restore_loss_scaler(pm, saved: dict | None) -> None:
    """The saved fp16 loss scale and its growth count, where this plan scales the loss too."""
    scaler = getattr(pm.runner, "scaler", None)
    if scaler is not None and saved:
        scaler.scale, scaler.clean_steps, scaler.skipped = float(saved["scale"]), int(saved["clean_steps"]), \
            int(saved["skipped"])


def export_state_dict(path) -> "OrderedDict[str, torch.Tensor]":
    """The checkpoint at ``path`` as a plain single-device ``model.state_dict()`` (keys in the model's
    order, tied weights sharing one tensor). Runs in one process; needs no process group. Verifies
    every file first."""
    directory = files.resolve(path)
    files.verify(directory)
    metadata = files.read_metadata(directory)
    meta = _read_meta(directory)
    stored = {key[len("model."):]: m for key, m in metadata.state_dict_metadata.items()
              if key.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    full = {key: torch.empty(tuple(m.size), dtype=m.properties.dtype, device="cpu") for key, m in stored.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        files.load_state({"model": full}, directory, no_dist=True)
    return OrderedDict((key, full[meta["aliases"].get(key, key)]) for key in meta["state_keys"])


def export(pm, path) -> None:
    """Write ``pm``'s full state dict with ``torch.save`` from rank 0 (gathers every parameter: use it for
    models that fit one device; for others, ``save`` and then ``export_state_dict`` offline). Collective."""
    paths.check_path_argument(path, "pm.export")
    final = paths.target(path)
    files.on_rank0_then_everyone(lambda: paths.check_export_target(final, list(pm._state_keys)), _export_failed(final))
    state = pm.full_state_dict()
    files.on_rank0_then_everyone(lambda: _write_replacing(state, final), _export_failed(final))


def _check_optimizer_argument(optimizer, call: str) -> None:
    if optimizer is None or hasattr(optimizer, "param_groups") and hasattr(optimizer, "state"):
        return
    raise CheckpointError(f"{call}(path, optimizer): optimizer must be the torch optimizer you step (built from "
                          f"pm.parameters() or by pm.optimizer(...)), or None; got a {type(optimizer).__name__}")


def _export_failed(final):
    return lambda cause: f"pm.export({str(final)!r}) failed ({cause}); any earlier file there is untouched"


def _write_replacing(state: dict, final) -> None:
    """``torch.save`` to a sibling temporary file, then an atomic rename over ``final``: a crash or a full
    disk never leaves a half-written file in place of an earlier export."""
    partial = final.parent / f".{final.name}.partial-{os.getpid()}"
    try:
        torch.save(state, partial)
        os.replace(partial, final)
    finally:
        if partial.exists():
            partial.unlink()


# ---- model entries ---------------------------------------------------------------------------------
def _persistent_fqns(pm) -> set[str]:
    return {pm._graph.param_aliases.get(k, k) for k in pm._state_keys}


def _held_tensors(pm) -> dict[str, tuple[torch.Tensor, int]]:
    """{canonical fqn: (this rank's shard as a DTensor sharing its storage, this rank's stage index)}."""
    persistent = _persistent_fqns(pm)
    stage = _my_stage(pm)
    out = {}
    for info in pm._graph.placeholders:
        if info.kind not in ("parameter", "buffer") or info.fqn not in persistent:
            continue
        local, spec, _ = pm.runner.local_state(info.name)
        if local is not None:
            out[info.fqn] = (_as_dtensor(local.detach(), spec, stage, info.shape), stage.index)
    return out


def _my_stage(pm):
    return pm.plan.stage_of_rank(dist.get_rank() if dist.is_initialized() else 0)


def _as_dtensor(local: torch.Tensor, spec_text: str, stage, global_shape) -> DTensor:
    placements = parse_spec(spec_text)
    assert not any(p.is_partial() for p in placements), f"a stored tensor is never Partial ({spec_text})"
    # _init_backend=False: DCP reads only the mesh coordinate, so no process group is needed; creating
    # one would be a collective over the whole world, which ranks of other pipeline stages never join.
    mesh = DeviceMesh(local.device.type, torch.tensor(stage.ranks, device="cpu").reshape(tuple(stage.mesh_shape)),
                      _init_backend=False)
    shape = torch.Size(global_shape)
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _lowest_stage_holding(held: dict[str, tuple[torch.Tensor, int]]) -> dict[str, int]:
    """{fqn: lowest stage index of any rank holding it}: one small all-gather of names, no tensors."""
    mine = {fqn: stage_index for fqn, (_, stage_index) in held.items()}
    if not dist.is_initialized():
        return mine
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    owners: dict[str, int] = {}
    for theirs in every:
        for fqn, stage_index in theirs.items():
            owners[fqn] = min(owners.get(fqn, stage_index), stage_index)
    return owners


def _unread_entries(pm) -> dict[str, torch.Tensor]:
    """State-dict entries no graph placeholder carries (e.g. a parameter forward never uses), whole."""
    carried = {info.fqn for info in pm._graph.placeholders}
    out = {}
    for key, value in pm._unused.items():
        canonical = pm._graph.param_aliases.get(key, key)
        if canonical not in carried:
            out[canonical] = value.detach()
    return out


# ---- optimizer -------------------------------------------------------------------------------------
def _optimizer_entries(pm, optimizer, fqns: set[str]) -> dict[str, dict]:
    """{fqn: {state name: DTensor (parameter-shaped) | tensor | object}} for the parameters in ``fqns``."""
    plain_optim.runners_of(optimizer)  # ZeRO: the optimizer steps (and holds state for) the bucket shards
    stage = _my_stage(pm)
    held = {}
    for info in pm._graph.placeholders:
        local, spec, _ = pm.runner.local_state(info.name)
        if local is not None and info.fqn in fqns:
            held[id(local)] = (info, spec)
    out = {}
    shards = _zero_shards(pm)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in shards:
                out.update(_zero_bucket_entries(pm, stage, shards[id(p)], optimizer.state.get(p, {}), fqns))
                continue
            if id(p) not in held:
                _raise_foreign_parameter(pm, p)
                continue  # a parameter of pm whose entry another pipeline stage writes
            info, spec = held[id(p)]
            out[info.fqn] = {name: _as_dtensor(v, spec, stage, info.shape)
                             if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0 else v
                             for name, v in optimizer.state.get(p, {}).items()}
    return out


def _zero_shards(pm) -> dict:
    """{id(shard parameter): its bucket} for this rank's ZeRO ≥ 1 gradient-sync buckets."""
    sync = getattr(pm.runner, "gradsync", None)
    return {id(b.shard): b for b in (sync.buckets if sync is not None else []) if b.level >= 1}


def _zero_bucket_entries(pm, stage, bucket, state: dict, fqns: set[str]) -> dict[str, dict]:
    """A ZeRO bucket's flat optimizer state under its parameters' own keys (``checkpoint_zero``)."""
    infos = {info.name: (info.fqn, info.shape) for info in pm._graph.placeholders
             if info.name in bucket.names and info.fqn in fqns}

    def dtensor_of(name: str) -> DTensor:
        local, spec, _ = pm.runner.local_state(name)
        return _as_dtensor(local.detach(), spec, stage, infos[name][1])

    return bucket_entries(bucket, state, infos, dtensor_of)


def _raise_foreign_parameter(pm, p: torch.Tensor) -> None:
    if any(p is q for q in pm.parameters()):
        return
    raise CheckpointError(f"the optimizer holds a tensor of shape {tuple(p.shape)} that is not one of "
                          f"pm.parameters() (this rank's shards); build the optimizer from pm.parameters(), "
                          f"not from the original model's parameters")


def _materialize_state(optimizer) -> None:
    """Create every parameter's optimizer state by one step with zero gradients and lr = 0, which leaves
    the parameters unchanged; DCP then overwrites the state in place. (The same trick as
    torch.distributed.checkpoint.state_dict's private ``_init_optim_state``.)"""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(p in optimizer.state and optimizer.state[p] for p in params):
        return
    saved_grads = [p.grad for p in params]
    saved_lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    with plain_optim.bare_step(optimizer):
        optimizer.step()
    for g, lr in zip(optimizer.param_groups, saved_lrs):
        g["lr"] = lr
    for p, grad in zip(params, saved_grads):
        p.grad = grad


def _restore_objects(pm, optimizer, loaded: dict[str, dict]) -> None:
    """DCP loads tensors in place but replaces non-tensor state (e.g. a float step): put it back."""
    for fqn, entries in loaded.items():
        for p in _params_of(pm, fqn, optimizer):
            for name, value in entries.items():
                if not isinstance(value, torch.Tensor):
                    optimizer.state[p][name] = value


def _params_of(pm, fqn: str, optimizer) -> list[torch.Tensor]:
    ids = {id(p): p for g in optimizer.param_groups for p in g["params"]}
    out = []
    for info in pm._graph.placeholders:
        if info.fqn == fqn:
            local, _, _ = pm.runner.local_state(info.name)
            if local is not None and id(local) in ids:
                out.append(ids[id(local)])
    return out


def _param_group_hyperparameters(optimizer) -> tuple:
    return tuple({k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups)


def _set_param_group_hyperparameters(optimizer, saved: tuple, path) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(f"checkpoint {str(path)!r} has {len(saved)} optimizer param groups, this optimizer "
                              f"{len(optimizer.param_groups)}; build the optimizer with the same groups")
    for group, values in zip(optimizer.param_groups, saved):
        group.update(values)


# ---- metadata and checks -----------------------------------------------------------------------------
def _meta_json(pm, with_optimizer: bool) -> str:
    world = dist.get_world_size() if dist.is_initialized() else 1
    return json.dumps({"format": FORMAT, "model": pm.plan.model, "state_keys": list(pm._state_keys),
                       "aliases": {k: v for k, v in pm._graph.param_aliases.items() if k != v},
                       "world_size": world, "optimizer": with_optimizer}, sort_keys=True)


def _read_meta(path) -> dict:
    holder = {"autopar": ""}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        files.load_state(holder, path, no_dist=True)
    try:
        meta = json.loads(holder["autopar"])
    except (TypeError, ValueError):
        raise CheckpointError(f"checkpoint {str(path)!r}: its 'autopar' entry is not JSON") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        meta = meta if isinstance(meta, dict) else {}
        raise CheckpointError(f"checkpoint {str(path)!r} has format {meta.get('format')}, this autopar reads "
                              f"{FORMAT}; load it with the autopar version that wrote it and re-save")
    return meta


def _check_matches(path, metadata, state: dict) -> None:
    """Every tensor to load exists in the checkpoint with the same global shape (DCP's own errors on
    a mismatch name neither the key nor the cause)."""
    saved = metadata.state_dict_metadata
    problems = []
    for prefix in ("model", "optim"):
        for key, value in _flatten(state.get(prefix, {}), prefix):
            if not isinstance(value, torch.Tensor):
                continue
            if key not in saved:
                problems.append(f"{key} is missing")
            elif tuple(saved[key].size) != tuple(value.shape):
                problems.append(f"{key} has shape {tuple(saved[key].size)} there, {tuple(value.shape)} here")
    if problems:
        model = _read_meta(path).get("model", "?")
        raise CheckpointError(f"checkpoint {str(path)!r} (saved from {model}) does not match this model: "
                              f"{'; '.join(problems[:5])}{' ...' if len(problems) > 5 else ''}; load a "
                              f"checkpoint of the same model (the plan and world size may differ)")


def _flatten(tree: dict, prefix: str):
    """("<prefix>.<key>.<key>...", leaf) of a nested dict: the keys DCP's metadata names its entries by."""
    for key, value in tree.items():
        yield from _flatten(value, f"{prefix}.{key}") if isinstance(value, dict) else [(f"{prefix}.{key}", value)]
