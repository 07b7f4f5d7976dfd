"""Reading a JSON file the user names (a plan, a cluster) without trusting what the path is.

Invariant: nothing is read unless the path is a regular file of at most ``limit`` bytes (a device such as
/dev/zero, a FIFO or a directory is refused before the first byte, a huge file by its size, and one that
grows while being read by reading at most ``limit + 1`` bytes); the bytes must be UTF-8. Every refusal is
one ``error`` (an AutoparError subclass) naming the file, the cause and ``fix``.
"""
from __future__ import annotations

import os
import stat

MAX_JSON_BYTES = 1 << 30  # a plan of a very large model is tens of MiB; 1 GiB is no plan or cluster


def read_json_text(path, what: str, error: type, fix: str, limit: int = MAX_JSON_BYTES) -> str:
    """The UTF-8 text of the file ``path`` (see the module docstring)."""
    name = str(path)
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file (a device, pipe or socket)"
            raise error(f"{what} {name!r} is {kind}; autopar reads JSON files only; {fix}")
        if info.st_size > limit:
            raise error(f"{what} {name!r} has {info.st_size} bytes, more than any {what} ({limit} bytes at most); "
                        f"it is not one: {fix}")
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise error(f"cannot read {what} {name!r}: {e.strerror or e}; {fix}") from None
    if len(raw) > limit:
        raise error(f"{what} {name!r} grew past {limit} bytes while being read; it is not one: {fix}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} {name!r} is not UTF-8 JSON text (byte {e.start}: {raw[e.start:e.start + 1]!r}); "
                    f"{fix}") from None


def _file_target(path, what: str, error: type, example: str) -> tuple[str, str]:
    """(path, its directory) for a file about to be written; an ``error`` when the path is a directory or its
    directory does not exist (``example`` names a file to suggest inside a directory)."""
    name = str(path)
    parent = os.path.dirname(os.path.abspath(name))
    if os.path.isdir(name):
        raise error(f"{what} {name!r} is a directory; pass a file path such as {os.path.join(name, example)!r}")
    if not os.path.isdir(parent):
        raise error(f"cannot write {name!r} ({what}): its directory {parent!r} does not exist; create it first")
    return name, parent


def write_json_text(path, text: str, what: str, error: type, is_ours) -> None:
    """Write ``text`` to the file ``path`` through a sibling temporary file and a rename (never half a file in
    place of an earlier one). An existing file is replaced only when ``is_ours(its text)`` says it is an
    earlier one of the same kind; anything else there (a user's file, a directory) is an ``error`` naming it."""
    name, parent = _file_target(path, what, error, "plan.json")
    if os.path.lexists(name):
        try:
            existing = read_json_text(name, what, error, "")
        except error:
            existing = None
        if existing is None or not is_ours(existing):
            raise error(f"cannot write {what} {name!r}: a file of that name exists and is not a {what}; autopar "
                        f"leaves it alone: write to another path, or move or delete that file yourself")
    partial = os.path.join(parent, f".{os.path.basename(name)}.partial-{os.getpid()}")
    try:
        with open(partial, "w") as f:
            f.write(text)
        os.replace(partial, name)
    except OSError as e:
        raise error(f"cannot write {what} {name!r}: {e.strerror or e}") from None
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def write_new_text(path, text: str, what: str, error: type, force: bool = False) -> None:
    """Write ``text`` to ``path`` through a sibling temporary file, never losing a file already there: without
    ``force`` an existing ``path`` is an ``error`` naming ``--force`` (the temporary file is linked into place,
    which fails rather than replaces, so a file created meanwhile is kept too); with ``force`` it is replaced
    whole by one rename (a reader sees the old file or the new one, never half of either)."""
    name, parent = _file_target(path, what, error, "plan.html")
    if not force and os.path.lexists(name):
        raise _exists(error, what, name)
    partial = os.path.join(parent, f".{os.path.basename(name)}.partial-{os.getpid()}")
    try:
        with open(partial, "w", encoding="utf-8") as f:
            f.write(text)
        if force:
            os.replace(partial, name)
        else:
            os.link(partial, name)
    except FileExistsError:
        raise _exists(error, what, name) from None
    except OSError as e:
        raise error(f"cannot write {name!r} ({what}): {e.strerror or e}") from None
    finally:
        if os.path.lexists(partial):
            os.unlink(partial)


def _exists(error: type, what: str, name: str):
    return error(f"{what} {name!r} exists; autopar does not overwrite it: pass --force to replace it, or write to "
                 f"another path")
