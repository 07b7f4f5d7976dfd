"""The parity suites' launches: one ``autopar.launch`` per world size runs every case of every selected suite
(the suites share its process group and imports), each case under its negative control's sabotage when it
names one (``tests/parity_sabotage.py``).

Every case's result carries ``seconds``, rank 0's wall time for it. With ``AUTOPAR_PARITY_TIMES=FILE`` set,
``launch_modules`` appends one line per case (world, seconds, case) to FILE: the budget of the default tier
is kept by reading those, not by guessing which case is dear.
"""
import os
import time
import warnings

import autopar
from tests.parity import run_case
from tests.parity_sabotage import sabotage


def launch_cases(cases: list[tuple], world: int, timeout: float = 120) -> list[dict]:
    """One ``autopar.launch`` of ``run_cases`` on ``world`` ranks: every rank's results, with rank 0's
    marked ``ranks_agree`` per case (all ranks saw the same loss)."""
    per_rank = autopar.launch(run_cases, world, cases, world, timeout=timeout)
    for case in cases:
        per_rank[0][case]["ranks_agree"] = len({round(r[case].get("loss", 0.0), 12) for r in per_rank}) == 1
    return per_rank


def launch_modules(modules) -> dict[tuple, list[dict]]:
    """One launch per world size for the cases of all ``modules`` (each declares ``PARITY_CASES``, {world:
    [case]}, and may declare ``PARITY_TIMEOUT``, seconds, default 120): {case: every rank's results}.
    A case two modules declare runs once."""
    cases, timeout = {}, {}
    for module in modules:
        for world, listed in module.PARITY_CASES.items():
            cases.setdefault(world, {}).update(dict.fromkeys(listed))
            timeout[world] = max(timeout.get(world, 0), getattr(module, "PARITY_TIMEOUT", 120))
    out = {}
    for world, unique in sorted(cases.items()):
        per_rank = launch_cases(list(unique), world, timeout=timeout[world])
        out.update({case: [r[case] for r in per_rank] for case in unique})
        _record_times(world, {case: per_rank[0][case]["seconds"] for case in unique})
    return out


def _record_times(world: int, seconds: dict[tuple, float]) -> None:
    path = os.environ.get("AUTOPAR_PARITY_TIMES")
    if path:
        with open(path, "a") as out:
            out.writelines(f"{world}\t{s:.1f}\t{case!r}\n" for case, s in seconds.items())


def run_cases(rank: int, cases: list[tuple], world: int) -> dict:
    """Every case in one process group, each timed (``seconds``). A case's last field names a sabotage (its
    negative control): "all_reduce" makes every all-reduce return the local value; "transfer" returns zero
    gradients between pipeline stages; "offsets" misplaces each shard-to-shard piece; "accumulate" keeps only
    the last microbatch's gradients; "replay" skips the collectives when a recomputed region re-runs in
    backward; "cp_swap" skips context parallelism's load-balancing swap; "kv_grad" drops the sum of gathered
    keys' and values' gradients; "host_step" never copies the host-stepped values back; "host_acts" brings
    offloaded activations back as zeros."""
    results = {}
    for case in cases:
        start = time.perf_counter()
        results[case] = _run_one(case, world)
        results[case]["seconds"] = time.perf_counter() - start
    return results


def _run_one(case: tuple, world: int) -> dict:
    model_name, mesh, layout, kind = case
    if model_name == "loop":  # a training-loop idiom (tests/loop_cases.py)
        from tests import loop_cases

        undo = loop_cases.sabotage(kind)
        try:
            return loop_cases.run_loop_case(mesh, layout, world)
        finally:
            undo()
    undo = sabotage(kind)
    try:
        if model_name == "dispatch":  # the all-to-all expert dispatch kernel alone (tests/moe_cases.py)
            from tests import moe_cases

            return moe_cases.run_dispatch_case(mesh, layout)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = run_case(model_name, mesh, layout, world)
    finally:
        undo()
    result["compile_warnings"] = [str(w.message) for w in caught if "torch.compile of" in str(w.message)]
    return result
