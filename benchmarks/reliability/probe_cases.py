"""The probe's cases that run in one process: planning, plan JSON, CLI, launch arguments (no process group),
then the module, checkpoint, export and compile cases on a one-rank gloo group (see ``probe.py``)."""
from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.nn as nn
from probe_support import MLP, Branchy, LossAndLogits, MaskIndex, Nonzero, close, error, mlp, with_user_files, works

import autopar
from autopar.cli import main as cli_main
from autopar.errors import AutoparError


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
