"""examples/train_lm.py end to end: training, a rank killed mid-run, resume on another number of ranks.

The run is one epoch exactly: 160 byte-level samples of 32 tokens (ASCII text of docs/design.md), a global
batch of 8, 20 steps, a checkpoint every 5. Each rank's trace (``--trace``) lists the sample ids it trained
on at each step. A run is killed (SIGKILL of one rank, once that rank has finished step 8), and the next
run in the same directory resumes from the latest checkpoint. What trained is then the killed run's steps
up to that checkpoint plus the resumed run's steps (the killed run's later steps were lost with it): that
must be every sample of the epoch exactly once, in the order of ``autopar.data.GlobalSampler``.

Suite (2 ranks -> 1): loss goes down; the resumed run's losses for the steps it redoes match the killed
run's (1e-5 relative, fp32). Slow tier (4 ranks -> 2, 2 -> 4): the resumed run's losses match an
uninterrupted run on the new number of ranks, step for step after the resume (1e-5 relative).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autopar.data import GlobalSampler

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_lm.py"
SAMPLES, SEQ, BATCH, STEPS, KILL_AFTER = 160, 32, 8, 20, 8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    text = "".join(c for c in (ROOT / "docs" / "design.md").read_text() if ord(c) < 128)
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(text[:SAMPLES * (SEQ + 1) - 1])  # + the tokenizer's end-of-file token: 160 samples exactly
    return path


def command(corpus: Path, out: Path, nprocs: int) -> list[str]:
    return [sys.executable, str(SCRIPT), "--data", str(corpus), "--out", str(out), "--nprocs", str(nprocs),
            "--steps", str(STEPS), "--batch", str(BATCH), "--seq-len", str(SEQ), "--save-every", "5", "--trace"]


def run(corpus: Path, out: Path, nprocs: int) -> str:
    done = subprocess.run(command(corpus, out, nprocs), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def run_and_kill(corpus: Path, out: Path, nprocs: int) -> str:
    """Start the script; SIGKILL its last rank once that rank's trace shows step KILL_AFTER; the run fails."""
    proc = subprocess.Popen(command(corpus, out, nprocs), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    trace = out / "trace" / f"rank{nprocs - 1}.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        lines = trace.read_text().splitlines() if trace.is_file() else []
        last = json.loads(lines[-1]) if lines and lines[-1].endswith("}") else None
        if last is not None and last["step"] >= KILL_AFTER:
            os.kill(last["pid"], signal.SIGKILL)
            break
        time.sleep(0.02)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, "the run should fail once a rank is killed:\n" + output[-3000:]
    return output


def traced(out: Path) -> list[dict]:
    files = sorted((out / "trace").glob("rank*.jsonl"))
    return [json.loads(line) for f in files for line in f.read_text().splitlines()]


def trained_steps(records: list[dict], resumed_from: int) -> dict[int, list[dict]]:
    """{step: the records of the run that trained it}: the first run's up to ``resumed_from``, then the
    resumed run's (the first run's ranks are the processes that trained step 1)."""
    pids_first = {r["pid"] for r in records if r["step"] == 1}
    out: dict[int, list[dict]] = {}
    for r in records:
        first = r["pid"] in pids_first
        if (first and r["step"] <= resumed_from) or (not first and r["step"] > resumed_from):
            out.setdefault(r["step"], []).append(r)
    return out


def global_batches(steps: dict[int, list[dict]]) -> dict[int, list[int]]:
    """{step: the global batch's ids}: the distinct shares, concatenated in index order."""
    out = {}
    for step, records in steps.items():
        shares = {tuple(r["share"]): r["ids"] for r in records}
        count = {c for _, c in shares}
        assert len(count) == 1 and set(shares) == {(i, c) for c in count for i in range(c)}, (step, shares.keys())
        out[step] = [i for key in sorted(shares) for i in shares[key]]
    return out


def resumed_from(output: str) -> int:
    line = next(x for x in output.splitlines() if "resumed from" in x)
    return int(line.split("resumed from step-")[1][:6])


def losses(steps: dict[int, list[dict]]) -> dict[int, float]:
    return {s: records[0]["loss"] for s, records in steps.items()}


def check_epoch(steps: dict[int, list[dict]]) -> None:
    batches = global_batches(steps)
    assert sorted(batches) == list(range(1, STEPS + 1))
    seen = [i for s in sorted(batches) for i in batches[s]]
    assert sorted(seen) == list(range(SAMPLES)), "every sample of the epoch exactly once"
    order = GlobalSampler(SAMPLES, BATCH, seed=0).order(0).tolist()
    assert seen == order, "in the sampler's order"


@pytest.fixture(scope="module")
def two_then_one(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("run21")
    killed = run_and_kill(corpus, out, 2)
    shutil.copytree(out, tmp_path_factory.getbasetemp() / "killed2", dirs_exist_ok=True)  # for the 2 -> 4 test
    return out, killed, run(corpus, out, 1)


def test_the_script_trains_and_resumes_on_one_rank_after_a_rank_is_killed(two_then_one):
    out, killed, resumed = two_then_one
    start = resumed_from(resumed)
    assert 5 <= start < STEPS and start % 5 == 0, resumed
    records = traced(out)
    steps = trained_steps(records, start)
    check_epoch(steps)
    by_step = losses(steps)
    assert sum(by_step[s] for s in (18, 19, 20)) < sum(by_step[s] for s in (1, 2, 3)) - 0.3, by_step
    assert "done: " in resumed and "tok/s" in resumed and "MFU" in resumed
    redone = {r["step"]: r["loss"] for r in records if r["world"] == 2 and r["step"] > start}
    again = {s: v for s, v in by_step.items() if s in redone}
    assert redone, "the killed run trained steps after its last checkpoint"
    assert all(abs(again[s] - redone[s]) <= 1e-5 * abs(redone[s]) for s in redone), (again, redone)


@pytest.mark.slow
@pytest.mark.parametrize("before, after", [(4, 2), (2, 4)])
def test_resume_on_another_number_of_ranks_sees_each_sample_once_and_matches(corpus, tmp_path_factory, two_then_one,
                                                                              before, after):
    base = tmp_path_factory.getbasetemp()
    if before == 2:
        out = tmp_path_factory.mktemp("run24")
        shutil.copytree(base / "killed2", out, dirs_exist_ok=True)
    else:
        out = tmp_path_factory.mktemp("run42")
        run_and_kill(corpus, out, before)
    resumed = run(corpus, out, after)
    start = resumed_from(resumed)
    steps = trained_steps(traced(out), start)
    check_epoch(steps)
    whole = tmp_path_factory.mktemp(f"whole{after}")
    run(corpus, whole, after)
    reference = losses(trained_steps(traced(whole), STEPS))
    mine = losses(steps)
    after_resume = [s for s in mine if s > start]
    assert after_resume and all(abs(mine[s] - reference[s]) <= 1e-5 * abs(reference[s]) for s in after_resume), \
        ({s: mine[s] for s in after_resume}, {s: reference[s] for s in after_resume})
