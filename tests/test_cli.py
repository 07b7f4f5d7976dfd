"""The ``autopar`` command: subprocess runs of the real entry point, in-process runs of ``main`` for the rest.

Exit codes checked: 0 ok, 1 AutoparError (one stderr line, no traceback), 2 usage error, 3 anything else.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import autopar
from autopar.cli import main
from autopar.hardware.presets import PRESETS
from autopar.plan import Plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN_CMD = ["plan", "examples/gpt.py:make_gpt", "--cluster", "dgx-a100", "--nodes", "2"]


def run_cli(*args: str, cwd: str = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autopar.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli")
    paths = {k: str(out / name) for k, name in (("out", "plan.json"), ("html", "plan.html"), ("trace", "trace.json"))}
    proc = run_cli(*PLAN_CMD, "--out", paths["out"], "--html", paths["html"], "--trace", paths["trace"])
    return proc, paths


def test_plan_writes_plan_html_and_trace(planned):
    proc, paths = planned
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("autopar plan: GPT on dgx-a100")
    plan = Plan.from_json(paths["out"])
    assert plan.num_devices == 16 and proc.stdout.strip() == plan.summary().strip()
    html = open(paths["html"], encoding="utf-8").read()
    assert "stage 0" in html and "aten.linear.default" in html
    events = json.load(open(paths["trace"]))["traceEvents"]
    sync = ["grad sync"] if plan.stages[0].predicted.get("grad_sync", 0) > 0 else []
    assert [e["name"] for e in events if e["ph"] == "X"] == ["F0", "B0"] + sync
    assert "done in" in proc.stderr and f"wrote {paths['html']}" in proc.stderr


def test_show_round_trips(planned, tmp_path):
    proc, paths = planned
    shown = run_cli("show", paths["out"], "--html", str(tmp_path / "again.html"))
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == proc.stdout
    assert (tmp_path / "again.html").read_text(encoding="utf-8") == open(paths["html"], encoding="utf-8").read()


def test_unknown_preset_is_one_line_naming_the_presets():
    proc = run_cli("plan", "examples/gpt.py:make_gpt", "--cluster", "dgx-z100")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "dgx-z100" in lines[0] and all(name in lines[0] for name in PRESETS)


def test_help_lists_examples():
    proc = run_cli("--help")
    assert proc.returncode == 0
    assert "examples:" in proc.stdout and "autopar plan examples/gpt.py:make_gpt" in proc.stdout
    assert "exit codes" in proc.stdout


@pytest.mark.parametrize("factory,message", [
    ("examples/gpt.py:no_such_factory", "has no callable 'no_such_factory'"),
    ("examples/no_such_file.py:make_gpt", "no such file 'examples/no_such_file.py'"),
    ("no_such_module_xyz:make_gpt", "cannot import module 'no_such_module_xyz'"),
    ("examples/gpt.py", "expected MODULE:FACTORY"),
    ("examples.gpt:GPTConfig", "must return (model, example_inputs)"),
])
def test_bad_factory_exits_1_with_a_clear_message(factory, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["plan", factory, "--cluster", "dgx-a100"]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_usage_errors_exit_2(capsys):
    assert main([]) == 2
    assert main(["plan", "examples.gpt:make_gpt"]) == 2  # --cluster missing
    assert main(["plan", "examples.gpt:make_gpt", "--cluster", "c.json", "--nodes", "2"]) == 2
    assert "--nodes applies to presets only" in capsys.readouterr().err
    assert main(["plan", "--help"]) == 0
    assert "examples:" in capsys.readouterr().out


def test_unexpected_errors_exit_3_with_traceback(tmp_path, capsys):
    (tmp_path / "broken.py").write_text("def build():\n    raise RuntimeError('kaboom')\n")
    assert main(["plan", f"{tmp_path / 'broken.py'}:build", "--cluster", "dgx-a100"]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "kaboom" in err


def test_plan_with_a_cluster_file_and_a_dotted_module(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    autopar.Cluster.local(2).to_json(tmp_path / "cluster.json")
    assert main(["plan", "examples.gpt:make_gpt", "--cluster", str(tmp_path / "cluster.json")]) == 0
    assert capsys.readouterr().out.startswith("autopar plan: GPT on local-2")


def test_unwritable_output_is_an_autopar_error(planned, capsys):
    assert main(["show", planned[1]["out"], "--html", "/nonexistent-dir/plan.html"]) == 1
    assert "cannot write '/nonexistent-dir/plan.html'" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--html", "--trace"])
def test_existing_report_files_are_kept_unless_forced(planned, tmp_path, capsys, monkeypatch, flag):
    mine = tmp_path / "mine.out"
    mine.write_text("the user's own notes\n")
    assert main(["show", planned[1]["out"], flag, str(mine)]) == 1
    err = capsys.readouterr().err
    assert "exists" in err and "--force" in err and "Traceback" not in err
    monkeypatch.chdir(ROOT)  # plan refuses before planning: no factory is called
    assert main(["plan", "examples.gpt:make_gpt", "--cluster", "dgx-a100", flag, str(mine)]) == 1
    assert "--force" in capsys.readouterr().err
    assert mine.read_text() == "the user's own notes\n"
    assert main(["show", planned[1]["out"], flag, str(mine), "--force"]) == 0  # control: --force replaces it
    expected = open(planned[1]["html" if flag == "--html" else "trace"], encoding="utf-8").read()
    assert mine.read_text(encoding="utf-8") == expected
    assert sorted(os.listdir(tmp_path)) == ["mine.out"]  # no temporary file left behind


def test_outputs_naming_one_file_are_a_usage_error(planned, tmp_path):
    same = str(tmp_path / "x.json")
    assert main(["show", planned[1]["out"], "--html", same, "--trace", same]) == 2
    assert not os.path.exists(same)


def test_write_new_text_never_replaces_a_file_created_meanwhile(tmp_path):
    from autopar.errors import AutoparError
    from autopar.ir.text_files import write_new_text

    target = tmp_path / "report.html"
    write_new_text(target, "first", "HTML report", AutoparError)
    with pytest.raises(AutoparError, match="--force"):
        write_new_text(target, "second", "HTML report", AutoparError)
    assert target.read_text() == "first" and sorted(os.listdir(tmp_path)) == ["report.html"]
    write_new_text(target, "second", "HTML report", AutoparError, force=True)
    assert target.read_text() == "second"


def test_profile_writes_the_cluster_file(tmp_path, capsys, monkeypatch):
    profiler = pytest.importorskip("autopar.profiling.profiler", reason="autopar.profiling.profiler is not written yet")
    calls = []

    def fake_profile(nprocs=None, *, quick=False, out=None, **_):
        calls.append((nprocs, quick))
        cluster = autopar.Cluster.local(nprocs or 2)
        cluster.to_json(out)
        return cluster

    monkeypatch.setattr(profiler, "profile_cluster", fake_profile)  # the real one is tested in test_profiler
    assert main(["profile", "--nprocs", "2", "--quick", "--out", str(tmp_path / "c.json")]) == 0
    assert calls == [(2, True)] and autopar.Cluster.from_json(tmp_path / "c.json").num_devices == 2


def test_demo_runs_examples_demo(monkeypatch):
    if not os.path.exists(os.path.join(ROOT, "examples", "demo.py")):
        pytest.skip("examples/demo.py is not written yet")
    seen = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: seen.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    assert main(["demo"]) == 0
    assert seen and seen[0][-1].endswith(os.path.join("examples", "demo.py"))


def test_the_demo_trains_on_four_ranks_as_on_one_device():
    """The README's first command, run for real: a plan for the simulated DGX-A100 nodes, then 4 gloo
    ranks training against one device (the demo exits 1 when the losses disagree or differ across ranks).
    Once broken unseen: a budget that made the planner shard optimizer state (ZeRO) refused the demo's
    optimizer over pm.parameters()."""
    demo = os.path.join(ROOT, "examples", "demo.py")
    done = subprocess.run([sys.executable, demo], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "losses identical on all 4 ranks: True" in done.stdout
    assert "== Part 1: GPT-1.3B" in done.stdout and "autopar plan: GPT on dgx-a100" in done.stdout
