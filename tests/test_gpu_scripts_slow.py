"""The GPU checklist's scripts (``benchmarks/gpu``) run end to end on CPU ranks (their ``--device cpu --tiny`` dry
run), so a lent GPU's few minutes are never spent on a script that no longer runs (slow tier: ~2 minutes).

Every case must come back without an error row: parity within its tolerance, and its negative control (the
reference at twice the learning rate) outside it, so the parity figure can fail; the two ranks sharing a device
equal to one device, planned and context parallel (fp32, within 1e-5: sums reorder); each one-device plan priced
and measured; the speed section's modes (plain and autopar, eager and compiled) timed with a positive MFU.
"""
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, out: str, *args: str) -> dict:
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu", script), "--out", out, "--device", "cpu",
           "--tiny", *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stderr[-3000:]
    name = "gpu_check.json" if script == "gpu_check.py" else "gpu_speed.json"
    with open(os.path.join(out, name)) as f:
        return json.load(f)


def test_gpu_check_dry_run(tmp_path):
    results = _run("gpu_check.py", str(tmp_path), "--budget", "240")
    for row in results["parity"]:
        assert "error" not in row, row.get("error")
        assert row["passed"] and row["worst_rel"] <= row["tolerance"] < row["control_worst_rel"], row
    shared = results["shared_gpu"]
    assert "error" not in shared and shared["worst_rel"] <= 1e-5  # fp32: a pipeline's microbatches reorder sums
    assert shared["context_parallel"]["worst_rel"] <= 1e-5, shared["context_parallel"]
    measured = [row for row in results["plans"] if "measured_step_s" in row]
    assert measured and not [row for row in results["plans"] if "error" in row]
    assert all(row["predicted_step_s"] > 0 and row["measured_step_s"] > 0 for row in measured)


def test_gpu_speed_dry_run(tmp_path):
    rows = _run("gpu_speed.py", str(tmp_path), "--sections", "speed")["speed"]
    assert not [row for row in rows if "error" in row], [row["error"] for row in rows if "error" in row]
    modes = {(row["model"], row["mode"]) for row in rows}
    assert {mode for _, mode in modes} == {"plain", "plain_compiled", "autopar", "autopar_compiled"}
    assert all(row["mfu"] > 0 and row["tokens_per_s"] > 0 for row in rows)
