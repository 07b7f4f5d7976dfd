"""The files of a checkpoint: crash-safe saves, a manifest, verified and code-free loads.

A checkpoint is a directory ``P`` holding DCP's files (``__<rank>_<n>.distcp`` data, ``.metadata``) and
``manifest.json``: {"format", "step", "world_size", "plan_digest", "files": {name: {"bytes", "sha256"}}},
written last, by rank 0, after every rank's files are on disk. Other writers (e.g. sharded optimizer
state) add their entries to the DCP state dict: the manifest covers every file in the directory.

Save (``save_atomically``, collective), in order:
  1. rank 0 puts back a previous checkpoint a crash left aside (see window C), refuses a P that is not
     an autopar checkpoint (``checkpoint_paths``: nothing but autopar's own files is ever replaced or
     removed), removes staging directories of crashed saves, and creates the staging directory
     ``P.tmp-<token>`` (a sibling of P, so the final rename stays on one file system); every rank learns
     the outcome;
  2. every rank writes its files into the staging directory (DCP); a barrier (the process group's timeout);
  3. rank 0 writes the manifest, fsyncs it, and re-reads every file against it;
  4. rank 0 switches: ``rename(P, P.old-<token>)`` if P exists, ``rename(P.tmp-<token>, P)``, fsync of the
     parent directory, ``rmtree(P.old-<token>)``; every rank learns the outcome.

Crash windows (a rank killed, the machine down, the disk full) and what survives:
  A. before or during step 3 (any rank): P is untouched; the staging directory is garbage, removed by the
     next save to P; a load of P reads the previous checkpoint;
  B. between the renames of step 4: P does not exist, ``P.old-<token>`` is the previous checkpoint, whole;
     a load of P reads it (and says which directory it read); the next save to P renames it back first;
  C. after the second rename: P is the new checkpoint; ``P.old-<token>`` is garbage, removed by the next save.
A save is therefore all or nothing: a load of P sees either the previous checkpoint or the new one, whole.

Load verifies before touching the model: the manifest parses, every listed file exists with the listed
size and SHA-256 (with a process group, each rank hashes a share of the files and the verdicts are
gathered, so every rank raises alike). Nothing in a checkpoint runs code: DCP's ``.metadata`` (a
pickle) is read by an unpickler that admits only DCP's metadata records, torch dtypes/sizes/layouts and
paths; DCP's byte entries are read with ``torch.load(weights_only=True)`` (its default planner uses
``weights_only=False``). Every failure is one ``CheckpointError`` naming the path and the cause.

``AUTOPAR_CHECKPOINT_CRASH="<point>:<rank>"`` ends that rank with ``os._exit`` at the named point
(before_write, during_write, after_write, before_switch, mid_switch, after_switch): the tests' kill switch.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from autopar.errors import CheckpointError
from autopar.runtime import checkpoint_paths as paths
from autopar.runtime.checkpoint_paths import MANIFEST, MANIFEST_FORMAT

CRASH_VAR = "AUTOPAR_CHECKPOINT_CRASH"
_CRASH_EXIT_CODE = 43


# ---- save ------------------------------------------------------------------------------------------
def save_atomically(state: dict, path, step: int | None, plan_digest: str, extra: dict | None = None) -> None:
    """Write ``state`` (a DCP state dict) as the checkpoint ``path`` (see the module docstring); ``extra``:
    more JSON entries of the manifest (the run's position, the loss scaler). Collective."""
    final = paths.target(path)
    token = _agree(lambda: uuid.uuid4().hex[:12])
    staging = final.parent / f"{final.name}.tmp-{token}"
    _on_rank0_then_everyone(final, "preparing", lambda: _prepare(final, staging))
    crash_point("before_write")
    try:
        dcp.save(state, storage_writer=_Writer(staging))
    except (CheckpointException, OSError) as e:
        raise CheckpointError(f"checkpoint {str(final)!r}: writing failed ({first_cause(e)}); the previous "
                              f"checkpoint there, if any, is untouched") from None
    crash_point("after_write")
    if dist.is_initialized():
        dist.barrier()
    manifest = {"format": MANIFEST_FORMAT, "step": step, "plan_digest": plan_digest,
                "world_size": dist.get_world_size() if dist.is_initialized() else 1, **(extra or {})}
    _on_rank0_then_everyone(final, "finishing", lambda: _finish(staging, final, manifest, token))


def _prepare(final: Path, staging: Path) -> None:
    if not final.parent.is_dir():
        raise OSError(f"its parent directory {str(final.parent)!r} does not exist")
    _put_back_aside(final)
    paths.check_checkpoint_target(final)
    for stale in _leftovers(final, "tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    staging.mkdir()


def _leftovers(final: Path, kind: str) -> list[Path]:
    """This path's staging (``kind`` "tmp") or aside ("old") directories of earlier saves that hold only
    autopar's files (``checkpoint_paths``); anything else of a similar name is left alone."""
    pattern = paths.leftover_pattern(final)
    return sorted(p for p in final.parent.glob(f"{final.name}.{kind}-*")
                  if pattern.match(p.name) and paths.is_own_leftover(p))


def _finish(staging: Path, final: Path, manifest: dict, token: str) -> None:
    files = sorted(p.name for p in staging.iterdir() if p.name != MANIFEST)
    manifest["files"] = {name: {"bytes": (staging / name).stat().st_size, "sha256": _sha256(staging / name)}
                         for name in files}
    _write_synced(staging / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    problems = [p for name in files for p in _file_problems(staging, name, manifest["files"][name])]
    if problems:
        raise OSError(f"the written files do not read back: {problems[0]}")
    crash_point("before_switch")
    aside = final.parent / f"{final.name}.old-{token}"
    if final.exists() or final.is_symlink():
        paths.check_checkpoint_target(final)  # again: the directory may have changed since step 1
        os.rename(final, aside)
    crash_point("mid_switch")
    os.rename(staging, final)
    _fsync_directory(final.parent)
    crash_point("after_switch")
    shutil.rmtree(aside, ignore_errors=True)


def _put_back_aside(final: Path) -> None:
    """Crash window B: P missing, the previous checkpoint at ``P.old-*``: rename it back. Otherwise
    ``P.old-*`` is garbage of window C."""
    aside = _leftovers(final, "old")
    if aside and not final.exists() and not final.is_symlink() and paths.is_checkpoint(aside[0]):
        os.rename(aside[0], final)
        aside = aside[1:]
    for old in aside:
        shutil.rmtree(old, ignore_errors=True)


class _Writer(dcp.FileSystemWriter):
    """DCP's writer, plus the ``during_write`` kill switch: the rank's files are cut to half their
    length (the state a kill in the middle of writing leaves) and the rank ends."""

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        if _crash_requested("during_write"):
            results = future.wait()
            for result in results:
                written = Path(self.path) / result.storage_data.relative_path
                os.truncate(written, written.stat().st_size // 2)
            os._exit(_CRASH_EXIT_CODE)
        return future


def crash_point(name: str) -> None:
    if _crash_requested(name):
        os._exit(_CRASH_EXIT_CODE)


def _crash_requested(name: str) -> bool:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return os.environ.get(CRASH_VAR) == f"{name}:{rank}"


# ---- collective bookkeeping ----------------------------------------------------------------------
def _agree(make):
    """``make()`` on rank 0, its value on every rank."""
    box = [make() if not dist.is_initialized() or dist.get_rank() == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _on_rank0_then_everyone(final: Path, doing: str, action) -> None:
    """Run ``action`` on rank 0; if it fails, every rank raises the same CheckpointError."""
    on_rank0_then_everyone(action, lambda cause: f"checkpoint {str(final)!r}: {doing} the save failed ({cause}); "
                                                 f"the previous checkpoint there, if any, is untouched")


def on_rank0_then_everyone(action, explain_os_error) -> None:
    """Run ``action`` on rank 0; if it raises a CheckpointError, or an OSError (whose one-line cause
    ``explain_os_error`` turns into the message), every rank raises a CheckpointError with that message."""
    def attempt():
        try:
            action()
            return None
        except CheckpointError as e:
            return str(e)
        except OSError as e:
            return explain_os_error(f"{type(e).__name__}: {e.strerror or e}"
                                    + (f" ({e.filename})" if e.filename else ""))
    message = _agree(attempt)
    if message:
        raise CheckpointError(message)


# ---- load ------------------------------------------------------------------------------------------
def resolve(path) -> Path:
    """The directory holding the checkpoint ``path``: itself, or the previous checkpoint a save crashed
    while switching left aside (window B)."""
    final = paths.target(path)
    if final.is_dir():
        return final
    aside = [p for p in _leftovers(final, "old") if paths.is_checkpoint(p)] if final.parent.is_dir() else []
    if aside:
        return aside[0]
    if final.exists():
        raise CheckpointError(f"{str(final)!r} is a file, not a checkpoint directory: pm.load reads what pm.save "
                              f"wrote; a pm.export file is a plain state dict: load it with "
                              f"model.load_state_dict(torch.load(path)) before autopar.compile")
    raise CheckpointError(f"no checkpoint at {str(final)!r} (no such directory); write one with pm.save(path) "
                          f"on every rank")


def read_manifest(directory: Path) -> dict:
    try:
        manifest = json.loads((directory / MANIFEST).read_bytes())
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not all(
                isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str) for v in files.values()):
            raise ValueError(f"unknown manifest format {manifest.get('format')!r}")
        return manifest
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(directory)!r} has no {MANIFEST}: it is not a complete autopar "
                              f"checkpoint (a save that did not finish, or an older autopar's); save it again")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, OSError) as e:
        raise CheckpointError(f"checkpoint {str(directory)!r}: its {MANIFEST} is unreadable ({first_cause(e)}); "
                              f"the checkpoint cannot be verified, save it again") from None


def verify(directory: Path) -> dict:
    """Check every file of the manifest (size and SHA-256), split over the ranks; returns the manifest."""
    manifest = read_manifest(directory)
    names = sorted(manifest["files"])
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = [p for name in names[rank::world] for p in _file_problems(directory, name, manifest["files"][name])]
    every = [mine]
    if dist.is_initialized():
        every = [None] * world
        dist.all_gather_object(every, mine)
    problems = [p for theirs in every for p in theirs]
    if problems:
        raise CheckpointError(f"checkpoint {str(directory)!r} is damaged: {'; '.join(problems[:3])}"
                              f"{' ...' if len(problems) > 3 else ''}; restore it from a copy or save again")
    return manifest


def _file_problems(directory: Path, name: str, expected: dict) -> list[str]:
    path = directory / name
    if not path.is_file():
        return [f"{name} is missing"]
    size = path.stat().st_size
    if size != expected["bytes"]:
        return [f"{name} has {size} bytes, the manifest says {expected['bytes']} (truncated or overwritten)"]
    if _sha256(path) != expected["sha256"]:
        return [f"{name} does not match its SHA-256 in the manifest (corrupt)"]
    return []


def load_state(state: dict, directory: Path, no_dist: bool = False) -> None:
    """``dcp.load`` with the restricted readers; any failure is a CheckpointError."""
    try:
        dcp.load(state, storage_reader=SafeReader(directory), planner=_SafePlanner(), no_dist=no_dist)
    except CheckpointError:
        raise
    except (CheckpointException, OSError, RuntimeError, ValueError, pickle.UnpicklingError, EOFError) as e:
        raise CheckpointError(f"checkpoint {str(directory)!r} could not be read ({first_cause(e)})") from None


def read_metadata(directory: Path):
    try:
        return SafeReader(directory).read_metadata()
    except CheckpointError:
        raise
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, AttributeError, TypeError) as e:
        raise CheckpointError(f"checkpoint {str(directory)!r}: its .metadata is unreadable "
                              f"({first_cause(e)})") from None


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only the globals DCP's metadata is made of; anything else (os.system, eval, ...) is refused."""

    ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
               ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
               ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath")}

    def find_class(self, module: str, name: str):
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name} (not plain checkpoint metadata: the "
                                     f"checkpoint may be crafted to run code)")


class SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise pickle.UnpicklingError(f".metadata holds a {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """Byte entries (non-tensor objects) are read as plain data only."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# ---- small helpers ---------------------------------------------------------------------------------
def first_cause(error: BaseException) -> str:
    """One line: the first rank's underlying error of a DCP CheckpointException, else the error itself."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = sorted(failures.items())[0]
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"rank {rank}: {first_cause(inner) if isinstance(inner, BaseException) else inner}"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
