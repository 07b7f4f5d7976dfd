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
import os
import sys
from collections import Counter
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from probe_cases import cli_cases, launch_argument_cases, one_rank_cases, plan_json_cases, planning_cases  # noqa: E402
from probe_ranks import judge_loop, launch_cases, loop_cases  # noqa: E402
from probe_support import run_case  # noqa: E402

import autopar  # noqa: E402

OUTCOMES = ["silent wrong", "data lost", "raw crash", "wrong cause", "clear error", "works"]


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
