"""Human-readable quantities for messages and reports, shared by every layer (errors name budgets in them)."""
from __future__ import annotations


def fmt_seconds(s: float) -> str:
    """Seconds as s, ms or µs with three significant figures or so."""
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def fmt_bytes(b: float) -> str:
    """Bytes in binary units (GiB, MiB, KiB, B)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.2f} {unit}"
    return f"{b:.0f} B"
