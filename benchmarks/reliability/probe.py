"""The mistake probe: what users ordinarily write, run against the real code, counted by outcome.

    python benchmarks/reliability/probe.py [--quick]     (--quick: skip the three process launches)

Each case is a call a user might make (option typos, wrong types, shapes, dtypes and devices, misused
module methods, checkpoint and export misuse, launch misuse, hand-edited plan JSON, CLI misuse, and the
training-loop idioms), with what a correct autopar does: raise one clear error (an autopar error whose
message holds the given words: the option or argument, and the valid values or the fix), or work (the
result checked, against the same model on one device where there is a number to compare). Outcomes:

  silent wrong   a mistake accepted without a word, or a result that differs from one device
  data lost      a file of the user's deleted, overwritten or moved
  raw crash      an exception that is not autopar's (a torch/Python error from inside autopar)
  wrong cause    autopar's error, but without the words that name the cause and the fix
  clear error    autopar's error naming the cause and the fix (expected)
  works          the call works and its result is right (expected)

Cases run in this process (no process group, then a one-rank gloo group) and in three launches: 2 ranks
for the training-loop idioms (each compared with one device), 2 ranks where one rank alone calls
``pm.save``, 1 rank returning a module. The table lists every case that is not clear/works, then counts.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import shutil
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import autopar  # noqa: E402
from autopar.cli import main as cli_main  # noqa: E402
from autopar.errors import AutoparError, CommunicationError  # noqa: E402

OUTCOMES = ["silent wrong", "data lost", "raw crash", "wrong cause", "clear error", "works"]


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


# ---- cases without a process group ------------------------------------------------------------------
def planning_cases() -> list:
    model, batch = mlp()
    c2 = autopar.Cluster.local(2)

    def plan(**options):
        return lambda: autopar.plan(model, c2, batch, **{"time_limit": 5, **options})

    option_values = [
        ("stages='two'", {"stages": "two"}, ["stages", "positive int"]),
        ("stages=0", {"stages": 0}, ["stages=0", "positive int"]),
        ("stages=-1", {"stages": -1}, ["stages=-1"]),
        ("stages=True", {"stages": True}, ["stages=True"]),
        ("stages=5 on 2 devices", {"stages": 5}, ["stages=5", "2"]),
        ("pin='p_*' (a str)", {"pin": "p_*"}, ["pin", "dict"]),
        ("pin spec typo", {"pin": {"p_*": "S0R"}}, ["S0R", "S(0)R"]),
        ("pin glob matching nothing", {"pin": {"fc3_*": "RR"}}, ["fc3_*", "matches no"]),
        ("zero=True", {"zero": True}, ["zero=True", "[0, 1, 2, 3]"]),
        ("zero=4", {"zero": 4}, ["zero=4", "[0, 1, 2, 3]"]),
        ("zero='2'", {"zero": "2"}, ["zero='2'"]),
        ("zero glob matching nothing", {"zero": {"encoder.*": 2}}, ["encoder.*", "matches no"]),
        ("recompute glob matching nothing", {"recompute": {"blocks.*": "full"}}, ["blocks.*", "matches no"]),
        ("recompute='yes'", {"recompute": "yes"}, ["recompute='yes'", "'full'"]),
        ("time_limit=-1", {"time_limit": -1}, ["time_limit", "positive"]),
        ("time_limit='60'", {"time_limit": "60"}, ["time_limit", "positive"]),
        ("bucket_bytes=-5", {"bucket_bytes": -5}, ["bucket_bytes", "positive"]),
        ("bucket_bytes='25MB'", {"bucket_bytes": "25MB"}, ["bucket_bytes", "bytes"]),
        ("microbatches=0", {"microbatches": 0}, ["microbatches", "positive"]),
        ("microbatches=3 (does not divide 16)", {"microbatches": 3, "stages": 2}, ["microbatches=3", "divisor"]),
        ("schedule='1F1B'", {"schedule": "1F1B"}, ["schedule", "'1f1b'"]),
        ("schedule='pipedream'", {"schedule": "pipedream"}, ["schedule", "'gpipe'"]),
        ("virtual_stages=0", {"virtual_stages": 0}, ["virtual_stages", "positive"]),
        ("virtual_stages=2 with gpipe", {"virtual_stages": 2, "schedule": "gpipe"}, ["virtual_stages", "interleaved"]),
        ("layers=0", {"layers": 0}, ["layers", "positive"]),
        ("precision='bfloat16'", {"precision": "bfloat16"}, ["bfloat16", "'bf16'"]),
        ("optimizer='adam_w'", {"optimizer": "adam_w"}, ["adam_w", "'adamw'"]),
        ("debug='yes'", {"debug": "yes"}, ["debug", "True or False"]),
        ("unknown option 'stage'", {"stage": 2}, ["'stage'", "did you mean 'stages'"]),
        ("unknown option 'micro_batches'", {"micro_batches": 2}, ["micro_batches", "'microbatches'"]),
        ("manual stages missing submesh", {"stages": [{"layers": [0, 1]}]}, ["submesh"]),
        ("memory_per_device as a planner option", {"memory_per_device": 2 ** 30}, ["memory_per_device", "Cluster"]),
        ("optimizer=torch.optim.AdamW (a class)", {"optimizer": torch.optim.AdamW}, ["optimizer", "'adamw'"]),
    ]
    cases = [("options", name, plan(**opts), error(*words)) for name, opts, words in option_values]
    cases += [
        ("options", "valid options (control)", plan(pin={"p_fc1_*": "RR"}, zero={"fc2.*": 0}, stages=1),
         works(lambda p: p.stages[0].shardings["p_fc1_weight"].out == "RR")),
        ("cluster", "cluster given as a preset name", lambda: autopar.plan(model, "dgx-a100", batch),
         error("autopar.Cluster", "Cluster.preset")),
        ("cluster", "unknown preset", lambda: autopar.Cluster.preset("dgx-z100"), error("dgx-z100", "dgx-a100")),
        ("cluster", "Cluster.local(0)", lambda: autopar.Cluster.local(0), error("0")),
        ("cluster", "Cluster.preset(nodes=0)", lambda: autopar.Cluster.preset("dgx-a100", nodes=0), error("nodes")),
        ("cluster", "a cluster file that does not exist", lambda: autopar.Cluster.from_json("my-cluster.json"),
         error("my-cluster.json", "autopar profile")),
        ("cluster", "mesh_shape that does not hold the devices",
         lambda: autopar.Cluster.local(2, mesh_shape=(3, 1)), error("mesh")),
        ("cluster", "memory_per_device in GiB", lambda: autopar.plan(
            model, autopar.Cluster.local(2, memory_per_device=16), batch), error("memory_per_device=16 * 2**30")),
        ("inputs", "example_inputs None", lambda: autopar.plan(model, c2, None), error("example_inputs", "tuple")),
        ("inputs", "example_inputs a dict", lambda: autopar.plan(model, c2, {"x": batch[0], "y": batch[1]}),
         error("example_inputs", "tuple")),
        ("inputs", "one input missing", lambda: autopar.plan(model, c2, batch[:1]), error("missing", "'y'")),
        ("inputs", "a model class, not an instance", lambda: autopar.plan(MLP, c2, batch), error("nn.Module")),
        ("inputs", "example inputs on meta, weights real",
         lambda: autopar.plan(model, c2, tuple(t.to("meta") for t in batch)), error("meta")),
        ("capture", "nonzero in forward", lambda: autopar.plan(Nonzero(), c2, batch),
         error("aten.nonzero", "nonzero()", "torch.where")),
        ("capture", "boolean mask index", lambda: autopar.plan(MaskIndex(), c2, batch),
         error("[y > 0]", "torch.where")),
        ("capture", "data-dependent if", lambda: autopar.plan(Branchy(), c2, batch),
         error("x.sum() > 0", "torch.where")),
    ]
    return cases


def plan_json_cases() -> list:
    model, batch = mlp()
    text = autopar.plan(model, autopar.Cluster.local(2), batch, time_limit=5).to_json()

    def edited(change):
        def run():
            d = json.loads(text)
            change(d)
            return autopar.Plan.from_json(json.dumps(d))
        return run

    def set_first(key, value):
        def change(d):
            d["stages"][0][key] = value
        return change

    return [
        ("plan JSON", "version edited", edited(lambda d: d.update(version=99)), error("version", "re-plan")),
        ("plan JSON", "stage ranks edited", edited(set_first("ranks", [0, 5])), error("ranks")),
        ("plan JSON", "mesh edited", edited(set_first("mesh_shape", [3, 1])), error("mesh")),
        ("plan JSON", "truncated text", lambda: autopar.Plan.from_json(text[: len(text) // 2]), error("malformed")),
        ("plan JSON", "a missing file", lambda: autopar.Plan.from_json("no-such-plan.json"),
         error("no-such-plan.json")),
        ("plan JSON", "/dev/zero as a plan", lambda: autopar.Plan.from_json("/dev/zero"), error("not a regular file")),
        ("plan JSON", "a dict instead of JSON text", lambda: autopar.Plan.from_json(json.loads(text)),
         error("JSON text", "json.dumps")),
        ("plan JSON", "to_json over a user file", with_user_files(
            lambda root: autopar.Plan.from_json(text).to_json(root / "train.py"), error("train.py", "not a plan")),
         None),
        ("plan JSON", "to_json into a missing directory", with_user_files(
            lambda root: autopar.Plan.from_json(text).to_json(root / "out" / "plan.json"), error("does not exist")),
         None),
        ("plan JSON", "round trip (control)", lambda: autopar.Plan.from_json(text).to_json() == text, works(bool)),
    ]


def cli_cases() -> list:
    def cli(*args):
        def run():
            code = cli_main(list(args))
            if code == 0:
                return code
            raise AutoparError(f"exit code {code}") if code in (1, 2) else RuntimeError(f"exit code {code}")
        return run

    def cli_fails_with_one_line(*args):
        def run():
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                code = cli_main(list(args))
            if code == 0:
                return code
            lines = err.getvalue().strip().splitlines()
            text = lines[-1] if lines else ""
            if code == 3 or len(lines) != 1:
                raise RuntimeError(f"exit {code}: {text}")
            raise AutoparError(text)
        return run

    return [
        ("CLI", "show /dev/zero", cli_fails_with_one_line("show", "/dev/zero"), error("not a regular file")),
        ("CLI", "show a directory", cli_fails_with_one_line("show", "/tmp"), error("directory")),
        ("CLI", "show a missing file", cli_fails_with_one_line("show", "missing.json"), error("missing.json")),
        ("CLI", "plan FILE without :FACTORY", cli_fails_with_one_line("plan", "model.py", "--cluster", "dgx-a100"),
         error("MODULE:FACTORY")),
        ("CLI", "plan with an unknown preset", cli_fails_with_one_line(
            "plan", "examples/gpt.py:make_gpt", "--cluster", "dgx-z100"), error("dgx-z100", "dgx-a100")),
        ("CLI", "--cluster /dev/zero", cli_fails_with_one_line(
            "plan", "examples/gpt.py:make_gpt", "--cluster", "/dev/zero"), error("not a regular file")),
        ("CLI", "a factory that does not exist", cli_fails_with_one_line(
            "plan", "examples/gpt.py:make_gtp", "--cluster", "dgx-a100"), error("make_gtp")),
    ]


def launch_argument_cases() -> list:
    return [
        ("launch", "nprocs=0", lambda: autopar.launch(rank_plus_one, 0), error("nprocs", "positive")),
        ("launch", "nprocs='2'", lambda: autopar.launch(rank_plus_one, "2"), error("nprocs", "positive")),
        ("launch", "backend='glo'", lambda: autopar.launch(rank_plus_one, 2, backend="glo"), error("glo", "'gloo'")),
        ("launch", "timeout=-1", lambda: autopar.launch(rank_plus_one, 2, timeout=-1), error("timeout", "positive")),
        ("launch", "fn given as a name", lambda: autopar.launch("train", 2), error("fn", "rank")),
        ("launch", "fn without the rank", lambda: autopar.launch(no_rank, 2), error("fn(rank", "rank")),
        ("launch", "timeout='60'", lambda: autopar.launch(rank_plus_one, 2, timeout="60"), error("timeout")),
        ("launch", "a lambda", lambda: autopar.launch(lambda r: r, 2), error("lambda", "module-level")),
    ]


def rank_plus_one(rank: int) -> int:
    return rank + 1


def no_rank() -> int:
    return 0


# ---- cases on a one-rank process group ---------------------------------------------------------------
def one_rank_cases() -> list:
    model, batch = mlp()
    reference = copy.deepcopy(model)
    c1 = autopar.Cluster.local(1)
    pm = autopar.compile(model, c1, batch)
    x, y = batch
    expected = reference(x, y).item()

    def no_grad_step():
        with torch.no_grad():
            return pm.train_step(x, y)

    def fresh_step(*args, **kwargs):
        def run():
            pm.zero_grad()
            return pm.train_step(*args, **kwargs).item()
        return run

    def save_into(sub):
        return lambda root: pm.save(root if sub is None else root / sub)

    def in_cwd(action):
        def run(root):
            os.chdir(root)
            return action()
        return run

    cases = [
        ("run-time inputs", "inputs by keyword", fresh_step(x=x, y=y), works(lambda v: close(v, expected))),
        ("run-time inputs", "an unknown keyword", fresh_step(x, target=y), error("'target'", "['x', 'y']")),
        ("run-time inputs", "the batch as one list", fresh_step([x, y]), error("pm.train_step(*batch)")),
        ("run-time inputs", "a numpy array", fresh_step(x.numpy(), y), error("ndarray")),
        ("run-time inputs", "float64 inputs", fresh_step(x.double(), y), error("torch.float64", "torch.float32")),
        ("run-time inputs", "a per-rank slice of the batch", fresh_step(x[:8], y[:8]), error("(8, 32)", "(16, 32)")),
        ("run-time inputs", "inputs on meta", fresh_step(x.to("meta"), y), error("meta")),
        ("run-time inputs", "one input short", fresh_step(x), error("(16, 16)")),
        ("run-time inputs", "a non-contiguous batch", fresh_step(x.t().contiguous().t(), y),
         works(lambda v: close(v, expected))),
        ("module", "train_step under torch.no_grad()", no_grad_step, error("no_grad", "outside")),
        ("module", "pm.half()", lambda: pm.half(), error("float16", "precision=")),
        ("module", "pm.to(torch.float64)", lambda: pm.to(torch.float64), error("float64", "precision=")),
        ("module", "pm.cuda() on a CPU cluster", lambda: pm.cuda(), error("cuda", "cpu")),
        ("module", "pm.to('cpu') on a CPU cluster", lambda: pm.to("cpu") is pm, works(bool)),
        ("module", "pm.load_state_dict(model.state_dict())", lambda: pm.load_state_dict(reference.state_dict()),
         error("model.state_dict()", "pm.load")),
        ("module", "pm.optimizer('adamw')", lambda: pm.optimizer("adamw"), error("optimizer class")),
        ("module", "pm.optimizer(an optimizer instance)", lambda: pm.optimizer(torch.optim.SGD(pm.parameters(), lr=1)),
         error("optimizer class")),
        ("module", "pm.optimizer(AdamW, learning_rate=...)", lambda: pm.optimizer(torch.optim.AdamW, learning_rate=1),
         error("learning_rate")),
        ("module", "eval forward under no_grad", lambda: _no_grad(lambda: pm(x, y).item()),
         works(lambda v: close(v, expected))),
        ("checkpoint", "pm.save(None)", lambda: pm.save(None), error("path")),
        ("checkpoint", "pm.save(path, 'adam')", lambda: pm.save("unused", "adam"), error("optimizer")),
        ("checkpoint", "pm.save(path, step='one')", lambda: pm.save("unused", step="one"), error("step", "int")),
        ("checkpoint", "pm.load of a missing path", lambda: pm.load("no-such-ckpt"), error("no checkpoint", "pm.save")),
        ("checkpoint", "pm.save(path, step=-1)", lambda: pm.save("unused", step=-1), error("step", "non-negative")),
        ("checkpoint", "pm.load of a user's directory", with_user_files(lambda root: pm.load(root), error(
            "manifest.json", "not a complete autopar checkpoint")), None),
        ("checkpoint", "pm.load of a file", lambda: pm.load(__file__), error("is a file", "pm.save")),
        ("checkpoint", "pm.export(None)", lambda: pm.export(None), error("path")),
        ("checkpoint", "optimizer state that was not saved", lambda: _load_missing_optimizer(pm),
         error("without optimizer state")),
        ("checkpoint", "a checkpoint of another model", lambda: _load_other_model(pm), error("checkpoint")),
        ("data loss", "pm.save('.')", with_user_files(in_cwd(lambda: pm.save(".")), error("working directory")),
         None),
        ("data loss", "pm.save(dir of user files)", with_user_files(save_into(None), error("train.py", "data/")), None),
        ("data loss", "pm.save(path of a user file)", with_user_files(save_into("train.py"), error("file", "autopar")),
         None),
        ("data loss", "pm.save into a new subdirectory (control)", with_user_files(
            save_into("ckpt"), works()), None),
        ("data loss", "pm.export over a user file", with_user_files(
            lambda root: pm.export(root / "notes.pt"), error("notes.pt", "not a torch.save state dict")), None),
        ("data loss", "pm.export to a directory", with_user_files(
            lambda root: pm.export(root / "data"), error("directory", "model.pt")), None),
        ("data loss", "pm.export to a missing directory", with_user_files(
            lambda root: pm.export(root / "out" / "model.pt"), error("does not exist")), None),
        ("data loss", "pm.export('.')", with_user_files(in_cwd(lambda: pm.export(".")), error("working directory")),
         None),
        ("compile", "data='locl'", lambda: autopar.compile(model, c1, batch, data="locl"), error("data", "'local'")),
        ("compile", "timeout=-1", lambda: autopar.compile(model, c1, batch, timeout=-1), error("timeout", "positive")),
        ("compile", "plan='plan.json'", lambda: autopar.compile(model, c1, batch, plan="plan.json"),
         error("Plan.from_json")),
        ("compile", "share_with=model", lambda: autopar.compile(model, c1, batch, share_with=model),
         error("share_with")),
        ("compile", "options beside plan=", lambda: autopar.compile(model, c1, batch, plan=pm.plan, stages=1),
         error("ignored")),
        ("compile", "cluster of 2 on 1 rank", lambda: autopar.compile(model, autopar.Cluster.local(2), batch),
         error("2 devices", "1 ranks")),
        ("compile", "forward returns (loss, logits)", lambda: autopar.compile(LossAndLogits(), c1, batch).train_step(
            x, y), error("return the loss")),
    ]
    return cases


def _no_grad(fn):
    with torch.no_grad():
        return fn()


def _load_missing_optimizer(pm):
    path = Path(tempfile.mkdtemp(prefix="autopar-probe-")) / "ckpt"
    pm.save(path)
    return pm.load(path, torch.optim.AdamW(pm.parameters()))


def _load_other_model(pm):
    path = Path(tempfile.mkdtemp(prefix="autopar-probe-")) / "ckpt"
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(32, 8))
    other_pm = autopar.compile(_Wrap(other), autopar.Cluster.local(1), (torch.randn(16, 32),))
    other_pm.save(path)
    return pm.load(path)


class _Wrap(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x).pow(2).mean()


# ---- cases on two ranks: the training-loop idioms (each compared with one device) ----------------------
def loop_cases(rank: int) -> list:
    out = []

    def case(name, fn):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out.append((name, "value", fn()))
        except Exception as e:  # noqa: BLE001 - returned for judging
            out.append((name, "error", (type(e).__name__, isinstance(e, (AutoparError, CommunicationError)),
                                        str(e).split("\n")[0][:200])))

    c2, tp = autopar.Cluster.local(2), autopar.Cluster.local(2, mesh_shape=(1, 2))

    def trained(cluster, steps, options, clip=None, accumulate=1, dropout=0.0, opt_builder=None):
        model, (x, y) = mlp(dropout)
        ref = copy.deepcopy(model)
        pm = autopar.compile(model, cluster, (x, y), **options)
        opt = (opt_builder or (lambda p: pm.optimizer(torch.optim.SGD, lr=0.1)))(pm)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for _ in range(steps):
            for k in range(accumulate):
                pm.train_step(x + k, y)
                ref(x + k, y).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(pm.parameters(), clip)
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        got, want = pm.full_state_dict(), ref.state_dict()
        return max((got[k] - want[k]).abs().max().item() for k in want)

    case("gradient accumulation, data parallel", lambda: trained(c2, 1, {"pin": {"p_*": "RR"}}, accumulate=2))
    case("gradient accumulation, ZeRO-2", lambda: trained(c2, 1, {"zero": 2}, accumulate=2))
    tensor_parallel = {"pin": {"p_*": "RS(0)"}, "stages": 1}
    case("gradient accumulation, tensor parallel", lambda: trained(tp, 1, tensor_parallel, accumulate=2))
    case("clip_grad_norm_, tensor parallel", lambda: trained(tp, 2, tensor_parallel, clip=0.05))
    case("clip_grad_norm_, ZeRO-2", lambda: trained(c2, 2, {"zero": 2}, clip=0.05))
    case("torch.optim.SGD(pm.parameters()) under ZeRO-2", lambda: trained(
        c2, 2, {"zero": 2}, opt_builder=lambda pm: torch.optim.SGD(pm.parameters(), lr=0.1)))

    def per_rank_seed():
        model, batch = mlp(dropout=0.3)
        pm = autopar.compile(model, tp, batch, **tensor_parallel)
        torch.manual_seed(1000 + rank)  # the common per-rank seeding idiom
        losses = [None, None]
        dist.all_gather_object(losses, pm.train_step(*batch).item())
        return abs(losses[0] - losses[1])
    case("dropout with per-rank seeds, tensor parallel (ranks agree)", per_rank_seed)

    def eval_mode():
        model, batch = mlp(dropout=0.5)
        ref = copy.deepcopy(model).eval()
        pm = autopar.compile(model, c2, batch)
        pm.eval()
        with torch.no_grad():
            return abs(pm(*batch).item() - ref(*batch).item())
    case("pm.eval() switches dropout off", eval_mode)

    def frozen():
        model, batch = mlp()
        model.fc1.requires_grad_(False)
        ref = copy.deepcopy(model)
        pm = autopar.compile(model, c2, batch)
        opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.1)
        pm.train_step(*batch)
        opt.step()
        ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
        ref(*batch).backward()
        ref_opt.step()
        got, want = pm.full_state_dict(), ref.state_dict()
        return max((got[k] - want[k]).abs().max().item() for k in want)
    case("frozen parameters", frozen)

    def scheduler():
        model, batch = mlp()
        pm = autopar.compile(model, c2, batch)
        opt = pm.optimizer(torch.optim.SGD, lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        pm.train_step(*batch)
        opt.step()
        sched.step()
        return abs(opt.param_groups[0]["lr"] - 0.05)
    case("LR scheduler on pm.optimizer", scheduler)
    return out if rank == 0 else []


def judge_loop(entry) -> tuple[str, str]:
    name, kind, value = entry
    if kind == "value":
        return ("works", "") if value <= 1e-5 else ("silent wrong", f"differs from one device by {value:.3g}")
    type_name, ours, text = value
    return ("wrong cause" if ours else "raw crash"), f"{type_name}: {text[:160]}"


def save_on_rank_0_only(rank: int, path: str) -> int:
    model, batch = mlp()
    pm = autopar.compile(model, autopar.Cluster.local(2), batch)
    pm.train_step(*batch)
    if rank == 0:
        pm.save(path)
    return rank


def returns_module(rank: int):
    return nn.Linear(2, 2)


def launch_cases() -> list:
    path = str(Path(tempfile.mkdtemp(prefix="autopar-probe-")) / "ckpt")
    return [
        ("launch", "pm.save on rank 0 only", lambda: autopar.launch(save_on_rank_0_only, 2, path, timeout=10),
         error("every rank must call", "rank 1")),
        ("launch", "fn returns a module", lambda: autopar.launch(returns_module, 1, timeout=60),
         error("returned a Linear", "plain data")),
    ]


# ---- report ------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the process launches")
    args = parser.parse_args()
    os.chdir(Path(__file__).resolve().parents[2])
    results = []
    for group in (planning_cases, plan_json_cases, cli_cases, launch_argument_cases):
        results += [(kind, name, *run_case(fn, expect)) for kind, name, fn, expect in group()]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        results += [(kind, name, *run_case(fn, expect)) for kind, name, fn, expect in one_rank_cases()]
    finally:
        dist.destroy_process_group()
    if not args.quick:
        results += [(kind, name, *run_case(fn, expect)) for kind, name, fn, expect in launch_cases()]
        try:
            loop = autopar.launch(loop_cases, 2, timeout=120)[0]
            results += [("training loop", entry[0], *judge_loop(entry)) for entry in loop]
        except Exception as e:  # noqa: BLE001 - the launch itself failing is a finding
            results.append(("training loop", "the loop cases' launch", "raw crash", f"{type(e).__name__}: {e}"))
    report(results)


def report(results: list) -> None:
    print(f"{'kind':<16} {'case':<44} {'outcome':<13} detail")
    for kind, name, outcome, detail in results:
        if outcome not in ("clear error", "works"):
            print(f"{kind:<16} {name:<44} {outcome:<13} {detail}")
    counts = Counter(outcome for _, _, outcome, _ in results)
    print(f"\n{len(results)} cases: " + ", ".join(f"{counts.get(o, 0)} {o}" for o in OUTCOMES))
    by_kind = Counter(kind for kind, *_ in results)
    print("by kind: " + ", ".join(f"{k} {n}" for k, n in by_kind.items()))


if __name__ == "__main__":
    main()
