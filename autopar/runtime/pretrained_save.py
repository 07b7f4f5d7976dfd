"""``pm.save_pretrained(DIR, prefix=..., max_shard_size=...)``: Hugging Face sharded safetensors, no rank
holding the whole model.

Layout (what ``transformers``' ``from_pretrained(DIR)`` reads): ``model-0000i-of-0000n.safetensors`` files
of at most ``max_shard_size`` bytes each (a larger tensor alone in its file), ``model.safetensors.index.json``
({"metadata": {"total_size"}, "weight_map": {key: file}}), and ``config.json`` when the model (the module at
``prefix``) carries a Hugging Face config. Keys are the model's state-dict keys with ``prefix`` taken off;
keys outside ``prefix`` are not written. A tied tensor (one parameter under several keys: embedding and
``lm_head``) is written once, as ``transformers`` writes it: under the key its model does not declare a tied
target (``_tied_weights_keys``, which ``from_pretrained`` ties back to the source), else its first key.

Invariants:
  * every file's tensors belong to one stage (the first that holds them); the file's writer is one rank of
    that stage (files go round its ranks); each tensor is gathered whole inside that stage
    (``collectives.gather_full``; a ZeRO-3 unit is gathered and freed again around it), kept by the writer
    only, so a rank holds at most one file's tensors (≤ max_shard_size, or one larger tensor) beyond its shards;
  * nothing existing is lost: writers write hidden temporary files beside the final ones; only when every
    writer has succeeded does rank 0 rename each into place (an existing file of the same name is replaced
    whole, by one rename), then the index and config.json; on any failure every rank raises the same
    CheckpointError and the temporary files are removed (other files in DIR are never touched).
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from autopar.errors import CheckpointError
from autopar.placement import parse_spec
from autopar.runtime import faults
from autopar.runtime.collectives import gather_full

INDEX = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def parse_size(size) -> int:
    """Bytes from an int or a string such as "5GB" (10^9) or "500MiB" (2^20), as transformers reads them."""
    if isinstance(size, int) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
    if not match or float(match.group(1)) <= 0:
        raise CheckpointError(f"max_shard_size={size!r} is not a size; pass bytes (an int) or e.g. '5GB', '500MB'")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def save_pretrained(pm, directory, prefix: str = "", max_shard_size="5GB") -> None:
    """See the module docstring. Collective: call on every rank."""
    limit = parse_size(max_shard_size)
    final = Path(os.fspath(directory)).absolute()
    entries = _once_per_tied_tensor(pm, _entries(pm, prefix))
    if not entries:
        raise CheckpointError(f"no state-dict key of the model starts with prefix={prefix!r}; the keys look like "
                              f"{pm._state_keys[:2]}")
    files = _files(entries, limit)
    token = _agree(lambda: uuid.uuid4().hex[:12])
    outcome = _agree_all(lambda: final.mkdir(parents=True, exist_ok=True) if dist.get_rank() == 0 else None)
    if outcome is None:
        outcome = _agree_all(lambda: _write_my_files(pm, final, files, token, prefix))
    if outcome is None:
        outcome = _agree_all(lambda: _switch_in(pm, final, files, token, prefix) if dist.get_rank() == 0 else None)
    if outcome is not None:
        for name, _, _ in files:
            (final / _temporary(name, token)).unlink(missing_ok=True)
        raise CheckpointError(f"save_pretrained into {str(final)!r} failed: {outcome}; the files there before are "
                              f"untouched")


def _entries(pm, prefix: str) -> list[tuple[str, str, object, int]]:
    """(state key, placeholder name or None for a never-read entry, owner stage or None, bytes), in order."""
    by_fqn = {info.fqn: info for info in pm._graph.placeholders if info.kind in ("parameter", "buffer")}
    out = []
    for key in pm._state_keys:
        if not key.startswith(prefix):
            continue
        info = by_fqn.get(pm._graph.param_aliases.get(key, key))
        node = pm._graph.gm.graph.find_nodes(op="placeholder", target=info.name)[0] if info else None
        if info is None or not node.users:
            value = pm._unused[key]
            out.append((key, None, None, value.numel() * value.element_size()))
            continue
        owner = next(s for s in pm.plan.stages if info.name in s.shardings)
        numel = 1
        for d in info.shape:
            numel *= d
        out.append((key, info.name, owner, numel * info.dtype.itemsize))
    return out


def _once_per_tied_tensor(pm, entries: list) -> list:
    """``entries`` less every key of a tied tensor but the one written (see the module docstring)."""
    targets = [re.compile(t) for t in getattr(pm, "tied_targets", ())]
    groups: dict[str, list[str]] = {}
    for key, *_ in entries:
        groups.setdefault(pm._graph.param_aliases.get(key, key), []).append(key)
    dropped = set()
    for keys in groups.values():
        declared = [k for k in keys if any(t.search(k) for t in targets)]
        kept = next((k for k in keys if k not in declared), keys[0])
        dropped.update(k for k in keys if k != kept)
    return [e for e in entries if e[0] not in dropped]


def _files(entries: list, limit: int) -> list[tuple[str, int, list]]:
    """[(file name, writer rank, entries)]: each stage's entries in order, cut at ``limit`` bytes."""
    groups: dict[int, list] = {}
    for e in entries:
        groups.setdefault(-1 if e[2] is None else e[2].index, []).append(e)
    chunks = []
    for stage_index in sorted(groups):
        current, size, k = [], 0, 0
        for e in groups[stage_index]:
            if current and size + e[3] > limit:
                chunks.append((stage_index, k, current))
                current, size, k = [], 0, k + 1
            current.append(e)
            size += e[3]
        chunks.append((stage_index, k, current))
    n = len(chunks)
    out = []
    for i, (stage_index, k, chunk) in enumerate(chunks):
        stage = chunk[0][2]
        ranks = stage.ranks if stage is not None else list(range(dist.get_world_size()))
        out.append((f"model-{i + 1:05d}-of-{n:05d}.safetensors", ranks[k % len(ranks)], chunk))
    return out


def _write_my_files(pm, final: Path, files: list, token: str, prefix: str) -> None:
    from safetensors.torch import save_file

    me = dist.get_rank()
    for name, writer, chunk in files:
        tensors = {}
        for key, placeholder, stage, _ in chunk:
            if placeholder is None:
                if me == writer:
                    tensors[key[len(prefix):]] = pm._unused[key].detach().cpu().clone().contiguous()
                continue
            if me not in stage.ranks:
                continue
            whole = _gather_in_stage(pm, placeholder)
            if me == writer:
                tensors[key[len(prefix):]] = whole.detach().cpu().contiguous()  # a file's values stay on the host
        if me == writer:
            path = final / _temporary(name, token)
            save_file(tensors, str(path), metadata={"format": "pt"})
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())


def _gather_in_stage(pm, placeholder: str) -> torch.Tensor:
    """The whole value of a placeholder on every rank of its first stage (a collective of that stage)."""
    runner = pm.runner
    unit = _zero3_unit(runner, placeholder)
    local, spec, mesh_index = runner.local_state(placeholder)
    whole = gather_full(local.detach(), parse_spec(spec), mesh_index).clone()
    if unit is not None:
        unit.dirty = False  # read only: the shard is current
        unit.free()
    return whole


def _zero3_unit(runner, placeholder: str):
    for r in getattr(runner, "chunks", [runner]):
        units = getattr(getattr(r, "gradsync", None), "units", None)
        if units is not None and placeholder in units.of_param and hasattr(r.gm, placeholder):
            return units.of_param[placeholder]
    return None


def _switch_in(pm, final: Path, files: list, token: str, prefix: str) -> None:
    """Rank 0: rename every temporary file into place, then write the index and config.json."""
    from safetensors import safe_open

    weight_map, total = {}, 0
    renamed = []
    for name, _, chunk in files:
        temporary = final / _temporary(name, token)
        with safe_open(str(temporary), framework="pt") as f:  # complete and readable before it replaces anything
            if set(f.keys()) != {e[0][len(prefix):] for e in chunk}:
                raise CheckpointError(f"{temporary} does not hold the tensors it was given")
        renamed.append((temporary, final / name))
        total += sum(e[3] for e in chunk)
        weight_map.update({e[0][len(prefix):]: name for e in chunk})
    for temporary, target in renamed:
        os.replace(temporary, target)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_atomically(final / INDEX, json.dumps(index, indent=2).encode())
    config = _config_for(pm, prefix)
    if config is not None:
        with tempfile.TemporaryDirectory(dir=final, prefix=f".config-{token}-") as scratch:
            config.save_pretrained(scratch)
            os.replace(Path(scratch) / "config.json", final / "config.json")
    _fsync_directory(final)


def _config_for(pm, prefix: str):
    configs = getattr(pm, "hf_config", None) or {}
    return configs.get(prefix[:-1] if prefix.endswith(".") else prefix)


def _temporary(name: str, token: str) -> str:
    return f".{name}.tmp-{token}"


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(temporary, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(temporary, path)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _agree(make):
    box = [make() if dist.get_rank() == 0 else None]
    faults.guard("broadcast_object_list", "save_pretrained", dist.broadcast_object_list, box, src=0)
    return box[0]


def _agree_all(action) -> str | None:
    """Run ``action`` on every rank; None when it succeeded everywhere, else the first failure's text (the
    same on every rank)."""
    try:
        action()
        mine = None
    except Exception as e:  # noqa: BLE001 - every rank must learn of any rank's failure
        mine = f"rank {dist.get_rank()}: {type(e).__name__}: {e}"
    every = [None] * dist.get_world_size()
    faults.guard("all_gather_object", "save_pretrained", dist.all_gather_object, every, mine)
    return next((m for m in every if m is not None), None)
