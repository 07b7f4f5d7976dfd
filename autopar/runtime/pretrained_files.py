"""``compile(weights=PATH, prefix=...)``: each rank reads only the slices of the files it holds.

PATH is a safetensors file, a directory with ``model.safetensors.index.json`` (Hugging Face's sharded
layout; its ``weight_map`` names each tensor's file) or ``model.safetensors``, or a checkpoint directory
written by ``pm.save`` (``manifest.json``: loaded by ``runtime.checkpoint.load`` into empty shards, as
torch.distributed.checkpoint reads exactly the slices each rank holds under any plan).

Invariants:
  * every file is checked before any shard is allocated: its header (8-byte length, JSON, dtypes, offsets
    inside the file, byte sizes matching shapes) and the model's keys (``prefix`` + file key = state-dict
    key; a tied tensor needs one of its names; shape equality): each problem is one ``CheckpointError``
    naming the first few keys, so nothing is ever half-loaded;
  * a shard is ``safe_open(...).get_slice(key)[box]``, the box from ``tensor_source.shard_bounds``: a rank
    reads (and pages in) only its own slices; Partial coordinates get zeros; the file's dtype (bf16, fp16)
    is cast to the model's own parameter dtype (the precision policy casts for compute, as for any weights);
  * tensors absent from the files by design (non-persistent buffers: rotary ``inv_freq``) come from the
    model's own init (``runtime.initialize``), or from the user's tensors when the model is real.

Why not torch.distributed.checkpoint's ``HuggingFaceStorageReader`` (torch 2.13): it does slice with
``get_slice``, but it reads every ``*.safetensors`` of a directory (not the index, not a single file), needs
DTensor state dicts (the runtime's shards are plain tensors with plan specs, Partial ones included), a
process group for the collective load plan, and it reports a missing key or a short file as a generic
planner error after tensors have been allocated; the checks above need the headers first.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from autopar.errors import CheckpointError
from autopar.placement import local_shape
from autopar.runtime.initialize import owners
from autopar.runtime.tensor_source import InitTensors, shard_bounds

INDEX = "model.safetensors.index.json"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_SHOWN = 5


def open_weights(model: torch.nn.Module, weights, prefix: str = ""):
    """Check ``weights`` against ``model`` before anything is planned or allocated: None (no weights),
    ("checkpoint", directory) or ("files", WeightFiles, {fqn: file key})."""
    if weights is None:
        return None
    path = Path(os.fspath(weights))
    if path.is_dir() and (path / "manifest.json").exists():
        return "checkpoint", path
    files = WeightFiles(path)
    return "files", files, files.match(model, prefix)


def weights_source(model: torch.nn.Module, graph, opened, init_seed: int):
    """(the source of this rank's shards or None for the user's own tensors, a pm.save checkpoint to load);
    ``opened``: what ``open_weights`` returned."""
    from autopar.runtime.build import model_tensors

    templates = model_tensors(model, graph)
    if opened is None:
        if any(t.device.type == "meta" for t in templates.values()):
            return InitTensors(model, templates, init_seed), None
        return None, None
    if opened[0] == "checkpoint":
        return CheckpointTensors(model, templates, init_seed), opened[1]
    return FileTensors(model, templates, init_seed, opened[1], opened[2]), None


class CheckpointTensors(InitTensors):
    """Zeros for every state-dict entry (a ``pm.save`` checkpoint fills them next); the rest as InitTensors."""

    def __init__(self, model, templates, init_seed):
        super().__init__(model, templates, init_seed)
        self.persistent = set(model.state_dict(keep_vars=True))

    def local(self, fqn, spec, mesh_shape, coord):
        if fqn in self.persistent:
            t = self.templates[fqn]
            return torch.zeros(local_shape(tuple(t.shape), spec, tuple(mesh_shape)), dtype=t.dtype, device="cpu")
        return super().local(fqn, spec, mesh_shape, coord)


class FileTensors(InitTensors):
    """Slices from ``files`` for the keys ``file_key`` maps (fqn -> file key); the rest as InitTensors."""

    def __init__(self, model, templates, init_seed, files: "WeightFiles", file_key: dict[str, str]):
        super().__init__(model, templates, init_seed)
        self.files, self.file_key = files, file_key

    def full(self, fqn):
        if fqn not in self.file_key:
            return super().full(fqn)
        return self._read(fqn, tuple(slice(None) for _ in self.templates[fqn].shape))

    def local(self, fqn, spec, mesh_shape, coord):
        if fqn not in self.file_key:
            return super().local(fqn, spec, mesh_shape, coord)
        t = self.templates[fqn]
        box, zero = shard_bounds(tuple(t.shape), spec, tuple(mesh_shape), tuple(coord))
        if zero:
            return torch.zeros(local_shape(tuple(t.shape), spec, tuple(mesh_shape)), dtype=t.dtype, device="cpu")
        return self._read(fqn, box)

    def _read(self, fqn: str, box: tuple) -> torch.Tensor:
        from safetensors import safe_open

        key = self.file_key[fqn]
        with safe_open(str(self.files.entries[key][0]), framework="pt") as f:
            piece = f.get_slice(key)[box] if box else f.get_tensor(key)
        return piece.to(self.templates[fqn].dtype).contiguous()


class WeightFiles:
    """The tensors of a safetensors file or directory: key -> (file, shape, dtype), every header checked."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[str, tuple[Path, tuple[int, ...], torch.dtype]] = {}
        for file, keys in self._files(path).items():
            header = read_header(file)
            for key in keys if keys is not None else header:
                if key not in header:
                    raise CheckpointError(f"{path / INDEX} maps {key!r} to {file.name}, which does not hold it; "
                                          f"the index and the files disagree: re-save the weights")
                self.entries[key] = (file, *header[key])

    @staticmethod
    def _files(path: Path) -> dict[Path, list[str] | None]:
        if path.is_file():
            return {path: None}
        if not path.is_dir():
            raise CheckpointError(f"weights={str(path)!r} does not exist; pass a .safetensors file, a directory with "
                                  f"{INDEX} or model.safetensors, or a checkpoint directory written by pm.save")
        if (path / INDEX).is_file():
            try:
                weight_map = json.loads((path / INDEX).read_text(encoding="utf-8"))["weight_map"]
            except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{path / INDEX} is not a safetensors index (JSON with a 'weight_map'): "
                                      f"{type(e).__name__}: {e}") from None
            files: dict[Path, list[str]] = {}
            for key, name in weight_map.items():
                files.setdefault(path / name, []).append(key)
            return files
        if (path / "model.safetensors").is_file():
            return {path / "model.safetensors": None}
        raise CheckpointError(f"weights directory {str(path)!r} has neither {INDEX} nor model.safetensors nor a "
                              f"pm.save manifest.json; pass the directory from_pretrained would read")

    def match(self, model: torch.nn.Module, prefix: str) -> dict[str, str]:
        """fqn -> file key for every name of every tensor in ``model.state_dict()``, after checking that the
        files hold each (one of a tied tensor's names suffices), with its shape, and nothing else."""
        owner = owners(model)
        state = model.state_dict(keep_vars=True)
        groups: dict[tuple, list[str]] = {}
        for fqn in state:
            groups.setdefault(owner.get(fqn, (fqn, "")), []).append(fqn)
        file_key, missing, wrong, used = {}, [], [], set()
        for names in groups.values():
            present = [n[len(prefix):] for n in names if n.startswith(prefix) and n[len(prefix):] in self.entries]
            if not present:
                missing.append(names[0])
                continue
            used.update(present)
            key = present[0]
            shape = tuple(self.entries[key][1])
            if shape != tuple(state[names[0]].shape):
                wrong.append(f"{key}: file {list(shape)}, model {list(state[names[0]].shape)}")
                continue
            for fqn in names:
                file_key[fqn] = key
        unmatched = sorted(set(self.entries) - used - {n[len(prefix):] for n in state if n.startswith(prefix)})
        _raise_if(missing, f"the model's keys {{}} are missing from {self.path} (with prefix={prefix!r} taken off "
                  f"each key; the files' keys look like {sorted(self.entries)[:2]}): pass the prefix the files lack, "
                  f"or the weights of this model")
        _raise_if(unmatched, f"the keys {{}} of {self.path} match no key of the model (prefix={prefix!r} is "
                  f"prepended to each file key; the model's keys look like {list(state)[:2]}); pass the right "
                  f"prefix, or the weights of this model")
        _raise_if(wrong, f"shape mismatches between {self.path} and the model: {{}}; these weights belong to another "
                  f"configuration of the model")
        return file_key


def read_header(file: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """key -> (shape, dtype) of a safetensors file, after checking that it is one and is whole."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length <= 0 or length > size - 8:
            raise CheckpointError(f"{file} is not a safetensors file (no valid header length); pass a .safetensors "
                                  f"file or a directory of them")
        try:
            header = json.loads(fh.read(length))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file} is not a safetensors file (its header is not JSON: {e}); pass a "
                                  f"safetensors file or a directory of them") from None
    data_bytes = size - 8 - length
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = _DTYPES[entry["dtype"]], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: tensor {key!r} has an unreadable header entry {entry!r}") from None
        if end > data_bytes:
            raise CheckpointError(f"{file} is truncated: tensor {key!r} ends at byte {end} of the data, which holds "
                                  f"only {data_bytes} bytes; download or copy the file again")
        if end - start != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"{file}: tensor {key!r} of shape {list(shape)} ({dtype}) has {end - start} bytes; "
                                  f"the file is corrupt")
        out[key] = (shape, dtype)
    return out


def _raise_if(problems: list[str], template: str) -> None:
    if problems:
        more = len(problems) - _SHOWN
        shown = ", ".join(problems[:_SHOWN]) + (f" (and {more} more)" if more > 0 else "")
        raise CheckpointError(template.format(shown))


def hf_config_of(model: torch.nn.Module):
    """{module name: its Hugging Face config} for the modules that carry one (``save_pretrained`` writes it)."""
    return {name: m.config for name, m in model.named_modules()
            if callable(getattr(getattr(m, "config", None), "save_pretrained", None))}


def tied_targets(model: torch.nn.Module) -> list[str]:
    """The state-dict keys (regular expressions, as ``transformers`` matches them) that the model's modules
    declare as tied copies of another key (``_tied_weights_keys``: a {target: source} dict in transformers 5,
    a list of targets before): ``save_pretrained`` leaves them out of the files."""
    out = []
    for name, m in model.named_modules():
        declared = getattr(m, "_tied_weights_keys", None) or ()
        out.extend(f"{name}.{k}" if name else k for k in declared)
    return out
