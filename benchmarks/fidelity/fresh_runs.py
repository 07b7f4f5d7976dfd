"""Cost-model fidelity as the goal states it: N consecutive runs, each a fresh `autopar profile` then the benchmark.

    python benchmarks/fidelity/fresh_runs.py                    # 3 runs on 2 ranks; ~2.5 min per run idle
    python benchmarks/fidelity/fresh_runs.py --runs 1 --quick   # a smoke test of the pipeline (coarse profile)

Run i: ``autopar profile --nprocs N --out <workdir>/profile_i.json`` (a fresh subprocess, as a user runs it;
what it measured goes into the results file in the words of the cluster's source line),
then ``cost_model_fidelity.py --nprocs N --cluster <that file> --repeats 1 --json <workdir>/fidelity_i.json``.
Every run's table goes into the results file (default ``benchmarks/results/cost_model_fidelity_3runs_<UTC
date-time>.txt``; an existing file is never overwritten), each with the UTC time and the load average
before and after, then one summary line per run: the goal's figures as profiled (median |time error| <=
10 %, Spearman >= 0.9, both signs of error present) and whether all runs met them, each followed by the same
figures re-priced at the reference mm's speed during the benchmark (``cost_model_fidelity.reference_drift``:
is the model right at the speed the machine ran at, whatever the profile sampled). ``--collective-share``
appends, per run, ``collective_share.py`` on the same profile (after the benchmark, so the goal's pairs stay
profile-then-benchmark). Run it on an idle
machine: other jobs' load changes what is measured between the profile and the benchmark.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.fidelity.fidelity_report import GOALS, figures  # noqa: E402


def _stamp() -> str:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{datetime.datetime.now(datetime.timezone.utc).strftime('%H:%M:%S')} UTC, load average {load}"


def _run(cmd: list[str], log) -> str:
    """Run ``cmd`` from the repository root; its stdout (stderr goes to ``log``). A failure stops the series."""
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    if done.returncode:
        raise SystemExit(f"fresh_runs: {' '.join(cmd)} failed with exit status {done.returncode}; see {log.name}")
    return done.stdout


def one_run(i: int, args, log) -> tuple[str, dict, dict | None]:
    """(text for the results file, the launch's figures as profiled, and re-priced at the reference mm's speed
    during the benchmark, None where the profile states no level) of run ``i``."""
    profile = os.path.join(args.workdir, f"profile_{i}.json")
    rows = os.path.join(args.workdir, f"fidelity_{i}.json")
    text = [f"## run {i}", f"# profile start {_stamp()}"]
    started = time.perf_counter()
    _run([sys.executable, "-m", "autopar.cli", "profile", "--nprocs", str(args.nprocs), "--out", profile]
         + (["--quick"] if args.quick else []), log)
    with open(profile) as f:
        measured = json.load(f)["source"].split("ring terms; ")[-1]  # what the profile measured, in words
    text.append(f"# profile took {time.perf_counter() - started:.0f} s: {measured}")
    text.append(f"# benchmark start {_stamp()}")
    started = time.perf_counter()
    text.append(_run([sys.executable, "benchmarks/fidelity/cost_model_fidelity.py", "--nprocs", str(args.nprocs),
                      "--cluster", profile, "--repeats", "1", "--json", rows] + args.bench_args, log).rstrip())
    text.append(f"# benchmark took {time.perf_counter() - started:.0f} s; end {_stamp()}")
    if args.collective_share:
        share = [sys.executable, "benchmarks/fidelity/collective_share.py", "--cluster", profile]
        text.append(_run(share, log).rstrip())
        text.append(f"# collective_share end {_stamp()}")
    with open(rows) as f:
        data = json.load(f)
    by_reference = data.get("reference_corrected") or [None]
    return "\n".join(text), figures(data["profiled"][0]), by_reference[0] and figures(by_reference[0])


def verdict(fig: dict) -> tuple[bool, str]:
    """(goals met, one line) for a launch's figures as profiled."""
    met = (fig["time_err"] <= GOALS["time_err"] and fig["spearman"] >= GOALS["spearman"]
           and fig["over"] > 0 and fig["under"] > 0)
    return met, (f"median |time error| {fig['time_err'] * 100:.1f} %, Spearman {fig['spearman']:.3f}, "
                 f"median signed error {fig['signed_err'] * 100:+.1f} % ({fig['over']} too slow / {fig['under']} "
                 f"too fast), worst |memory error| {fig['worst_mem_err'] * 100:.1f} %: "
                 f"{'goals met' if met else 'MISSED'}")


def main(argv=None) -> int:
    now = datetime.datetime.now(datetime.timezone.utc)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(
        ROOT, "benchmarks", "results", f"cost_model_fidelity_3runs_{now.strftime('%Y-%m-%d_%H%M')}.txt"))
    parser.add_argument("--workdir", default=None, help="where the cluster files, the benchmark's JSON rows and "
                        "the subprocesses' stderr go (default: a new temporary directory)")
    parser.add_argument("--quick", action="store_true", help="coarse profiles (a smoke test, not a figure)")
    parser.add_argument("--collective-share", action="store_true", help="after each run's benchmark, also "
                        "collective_share.py on its profile (the collectives' time inside a step vs alone vs priced)")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER,
                        help="after --: extra arguments for cost_model_fidelity.py (e.g. -- --plans dp tp)")
    args = parser.parse_args(argv)
    args.bench_args = [a for a in args.bench_args if a != "--"]
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    if os.path.exists(args.out):
        parser.error(f"{args.out} exists; name another --out (results files are never overwritten)")
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="fidelity_runs_")
    os.makedirs(args.workdir, exist_ok=True)
    print(f"cluster files, rows and logs in {args.workdir}", flush=True)
    started = time.perf_counter()
    texts, verdicts = [], []
    with open(os.path.join(args.workdir, "stderr.log"), "a") as log:
        for i in range(1, args.runs + 1):
            text, fig, by_reference = one_run(i, args, log)
            texts.append(text)
            met, line = verdict(fig)
            if by_reference:  # the model at the speed the reference ran at during the benchmark (not the goal)
                line += f"; reference-corrected: {verdict(by_reference)[1]}"
            verdicts.append((met, line))
            print(f"run {i}: {verdicts[-1][1]}", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    header = (f"# Cost-model fidelity (tree {commit.strip() or 'unknown'}), {args.runs} consecutive runs, each a "
              f"fresh `autopar profile --nprocs "
              f"{args.nprocs}`{' --quick' if args.quick else ''} then the benchmark, started "
              f"{now.strftime('%Y-%m-%d %H:%M')} UTC, {os.cpu_count()} cores; {time.perf_counter() - started:.0f} s "
              f"in all.\n# Command: python benchmarks/fidelity/fresh_runs.py {' '.join(argv or sys.argv[1:])}")
    summary = [f"# run {i}: {line}" for i, (_, line) in enumerate(verdicts, 1)]
    summary.append(f"# all {args.runs} runs meet the goals: {'yes' if all(m for m, _ in verdicts) else 'NO'}")
    with open(args.out, "x") as f:
        f.write("\n".join([header, *summary, "", *texts]) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
