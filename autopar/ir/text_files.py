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
