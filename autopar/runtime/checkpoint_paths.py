"""Where a checkpoint or an export may be written: autopar replaces or removes only what it wrote itself.

Invariant: ``pm.save`` / ``pm.export`` never delete, overwrite or move a file or directory that is not
autopar's own. What counts as autopar's own:
  * a checkpoint directory: it holds ``manifest.json`` in autopar's manifest format, and nothing but
    files DCP and autopar write (``.metadata``, ``__<rank>.metadata``, ``__<rank>_<n>.distcp``, their
    ``.tmp`` forms, ``manifest.json``); no subdirectory;
  * a save's leftovers: a sibling ``<name>.tmp-<token>`` / ``<name>.old-<token>`` directory (``token``:
    12 hex digits, as ``checkpoint_files`` names them) holding nothing but such files;
  * an export: a ``torch.save`` file whose state dict has exactly this model's keys (an earlier export).
Anything else at the path is refused with a ``CheckpointError`` naming what is there and the fix; an
empty directory may be replaced. The path is never the working directory or one holding it (renaming
it away would leave every rank in a deleted directory).
"""
from __future__ import annotations

import json
import os
import re
import zipfile
from pathlib import Path

import torch

from autopar.errors import CheckpointError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_OWNED_FILE = re.compile(r"^(?:(?:__\d+)?\.metadata|__\d+_\d+\.distcp)(?:\.tmp)?$|^manifest\.json$")
_SHOWN = 5


def check_path_argument(path, call: str) -> None:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise CheckpointError(f"{call}(path): path must be a non-empty str or pathlib.Path, got {path!r}")


def target(path) -> Path:
    """The absolute path a save or load of ``path`` works on: ``.``/``..`` and symbolic links resolved
    (so a link to a checkpoint directory elsewhere keeps pointing at it, and the staging directory
    sits beside the real one, on its file system)."""
    return Path(os.path.realpath(os.fspath(path)))


def leftover_pattern(final: Path) -> re.Pattern:
    """Names of a save's staging and aside directories for ``final`` (``<name>.tmp-<token>``, ``.old-``)."""
    return re.compile(rf"^{re.escape(final.name)}\.(tmp|old)-[0-9a-f]{{12}}$")


def check_checkpoint_target(final: Path) -> None:
    """CheckpointError unless a save may (re)place ``final``: absent, an empty directory, or an autopar
    checkpoint directory (see the module docstring)."""
    _refuse_working_directory(final, "pm.save('checkpoint')")
    if not final.exists() and not final.is_symlink():
        return
    if not final.is_dir():
        raise CheckpointError(f"checkpoint {str(final)!r}: a file of that name exists and is not an autopar "
                              f"checkpoint directory; autopar leaves it alone: save to another path, or move "
                              f"or delete that file yourself")
    foreign = foreign_entries(final)
    if foreign:
        raise CheckpointError(f"checkpoint {str(final)!r}: the directory holds files that are not autopar's "
                              f"({_listed(foreign)}); a save replaces the whole directory, so autopar refuses "
                              f"rather than delete them: save to a new or empty directory (e.g. "
                              f"{str(final / 'checkpoint')!r}), or move those files away yourself")
    if any(final.iterdir()) and not _has_manifest(final):
        raise CheckpointError(f"checkpoint {str(final)!r} holds DCP files but no readable autopar {MANIFEST}: "
                              f"it is not an autopar checkpoint (another tool's, or a damaged one), so autopar "
                              f"will not replace it; save to another path, or delete it yourself")


def foreign_entries(directory: Path) -> list[str]:
    """Names in ``directory`` that autopar never writes (subdirectories included), sorted."""
    return sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir()
                  if p.is_dir() or p.is_symlink() or not _OWNED_FILE.match(p.name))


def is_own_leftover(path: Path) -> bool:
    """A staging or aside directory of a save (named by ``leftover_pattern``) with only autopar's files."""
    return path.is_dir() and not path.is_symlink() and not foreign_entries(path)


def is_checkpoint(directory: Path) -> bool:
    return is_own_leftover(directory) and _has_manifest(directory)


def _has_manifest(directory: Path) -> bool:
    try:
        manifest = json.loads((directory / MANIFEST).read_bytes())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == MANIFEST_FORMAT and "files" in manifest


def check_export_target(final: Path, state_keys: list[str]) -> None:
    """CheckpointError unless ``pm.export`` may write ``final``: absent, or an earlier export of this model
    (a ``torch.save`` state dict with exactly ``state_keys``); its directory must exist."""
    _refuse_working_directory(final, "pm.export('model.pt')")
    if final.is_dir():
        raise CheckpointError(f"pm.export({str(final)!r}): that is a directory; export writes one file: pass a "
                              f"file path such as {str(final / 'model.pt')!r} (pm.save(path) writes a sharded "
                              f"checkpoint directory)")
    if not final.parent.is_dir():
        raise CheckpointError(f"pm.export({str(final)!r}): its directory {str(final.parent)!r} does not exist; "
                              f"create it first (os.makedirs) or choose another path")
    if not final.exists() and not final.is_symlink():
        return
    keys = _saved_state_keys(final)
    if keys != list(state_keys):
        what = "a state dict of another model" if keys is not None else "not a torch.save state dict"
        raise CheckpointError(f"pm.export({str(final)!r}): a file of that name exists ({what}), and export "
                              f"replaces only an earlier export of this model; autopar leaves it alone: "
                              f"export to another path, or move or delete that file yourself")


def _saved_state_keys(path: Path) -> list[str] | None:
    """The keys of the state dict ``torch.save`` wrote at ``path`` (memory-mapped: no tensor is read),
    or None when it is not one."""
    if not path.is_file() or not zipfile.is_zipfile(path):
        return None
    try:
        state = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except Exception:  # noqa: BLE001 - any unreadable file is "not a state dict", which the caller refuses
        return None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        return None
    return list(state)


def _refuse_working_directory(final: Path, example: str) -> None:
    cwd = Path(os.path.realpath(os.getcwd()))
    if final == cwd or final in cwd.parents:
        which = "the current working directory" if final == cwd else "a directory holding the working directory"
        raise CheckpointError(f"{str(final)!r} is {which}, where your own files live; autopar never writes over "
                              f"it: pass a path inside it, e.g. {example}")


def _listed(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
