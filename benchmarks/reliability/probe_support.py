"""The probe's models and its judge: how one case's result becomes an outcome (see ``probe.py``)."""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.errors import AutoparError, CommunicationError


# ---- models ------------------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 16)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(self.drop(F.gelu(self.fc1(x)))), y)


def mlp(dropout: float = 0.0):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    return MLP(dropout), (torch.randn(16, 32, generator=g), torch.randn(16, 16, generator=g))


class Nonzero(MLP):
    def forward(self, x, y):
        picked = (y > 0).nonzero()
        return self.fc2(F.gelu(self.fc1(x)))[picked[:, 0], picked[:, 1]].sum()


class MaskIndex(MLP):
    def forward(self, x, y):
        return (self.fc2(F.gelu(self.fc1(x)))[y > 0] ** 2).mean()


class Branchy(MLP):
    def forward(self, x, y):
        if x.sum() > 0:  # data-dependent Python control flow
            return F.mse_loss(self.fc2(F.gelu(self.fc1(x))), y)
        return F.mse_loss(self.fc2(self.fc1(x)), y)


class LossAndLogits(MLP):
    def forward(self, x, y):
        out = self.fc2(F.gelu(self.fc1(x)))
        return F.mse_loss(out, y), out


# ---- running and judging one case -------------------------------------------------------------------
def error(*needles):
    return ("error", needles)


def works(check=lambda value: True):
    return ("works", check)


def judge(fn, expect) -> tuple[str, str]:
    """(outcome, detail) of running ``fn`` against ``expect``."""
    kind, arg = expect
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()), \
                contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            value = fn()
    except (AutoparError, CommunicationError) as e:
        text = str(e).split("\n")[0]
        if kind == "works":
            return "wrong cause", f"{type(e).__name__}: {text[:160]}"
        missing = [w for w in arg if w.lower() not in text.lower()]
        return ("wrong cause", f"lacks {missing}: {text[:160]}") if missing else ("clear error", text[:100])
    except Exception as e:  # noqa: BLE001 - counting raw crashes is the point
        return "raw crash", f"{type(e).__module__}.{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    if kind == "error":
        return "silent wrong", f"accepted, returned {type(value).__name__}"
    ok = arg(value)
    return ("works", "") if ok else ("silent wrong", f"result differs: {value!r:.120}")


def run_case(fn, expect) -> tuple[str, str]:
    """``expect`` None: ``fn`` judges itself (``with_user_files``)."""
    return fn() if expect is None else judge(fn, expect)


def with_user_files(action, expect):
    """Run ``action(directory)`` in a directory holding a user's files; any file gone or changed: data lost."""
    def run():
        root = Path(tempfile.mkdtemp(prefix="autopar-probe-"))
        (root / "train.py").write_text("print('mine')\n")
        (root / "data").mkdir()
        (root / "data" / "tokens.bin").write_bytes(b"\x01" * 64)
        (root / "notes.pt").write_text("not a state dict")
        before = _snapshot(root)
        cwd = os.getcwd()
        try:
            outcome = judge(lambda: action(root), expect)
        finally:
            os.chdir(cwd)
        after = _snapshot(root)
        lost = [k for k, v in before.items() if after.get(k) != v]
        shutil.rmtree(root, ignore_errors=True)
        return ("data lost", f"{lost} gone or changed") if lost else outcome
    return run


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in root.rglob("*")}


def close(a: float, b: float, tol: float = 1e-5) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(b))
