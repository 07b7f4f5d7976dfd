"""The fidelity benchmark's report: its table, the three figures against their goals per launch, and each
auto plan against the best forced one (``cost_model_fidelity`` measures; this prints).

Figures of one launch: median |relative time error| over plans, Spearman rho of predicted vs measured step
times, worst |relative memory error|, and the sign balance (plans predicted too slow / too fast): a bias of
one sign is a missing term, not noise.
"""
from __future__ import annotations

import statistics

from autopar.profiling.fidelity import sign_balance, spearman

GOALS = {"time_err": 0.10, "spearman": 0.9, "mem_err": 0.10}


def print_table(rows: list[dict], split: bool) -> None:
    head = f"{'plan':<14}{'mesh':>12}{'pred ms':>9}{'meas ms':>9}{'iqr':>6}{'t err':>8}{'pred MiB':>10}" \
           f"{'meas MiB':>10}{'m err':>8}"
    if split:
        head += f"{'pred comp':>10}{'meas comp':>10}{'pred comm':>10}{'meas comm':>10}"
    print(head)
    for r in rows:
        line = (f"{r['plan']:<14}{r['mesh']:>12}{r['pred_t'] * 1e3:>9.1f}{r['meas_t'] * 1e3:>9.1f}"
                f"{r['iqr'] * 100:>5.0f}%{r['t_err'] * 100:>+7.1f}%{r['pred_mem'] / 2**20:>10.1f}"
                f"{r['meas_mem'] / 2**20:>10.1f}{r['mem_err'] * 100:>+7.1f}%")
        if split:
            meas_comm = r["meas_t"] - r["meas_compute"]
            line += (f"{r['pred_compute'] * 1e3:>10.1f}{r['meas_compute'] * 1e3:>10.1f}"
                     f"{r['pred_comm'] * 1e3:>10.1f}{meas_comm * 1e3:>10.1f}")
        print(line)


def figures(rows: list[dict]) -> dict:
    """The three fidelity figures of one launch: median |time error|, Spearman rho, worst |memory error|."""
    over, under = sign_balance(r["t_err"] for r in rows)
    return {"time_err": statistics.median(abs(r["t_err"]) for r in rows),
            "spearman": spearman([r["pred_t"] for r in rows], [r["meas_t"] for r in rows]),
            "worst_mem_err": max(abs(r["mem_err"]) for r in rows),
            "signed_err": statistics.median(r["t_err"] for r in rows), "over": over, "under": under}


def median_rows(per_launch: list[list[dict]]) -> list[dict]:
    """Per plan, the median over launches of every numeric field (the plans are in the same order)."""
    out = []
    for same in zip(*per_launch):
        row = {k: (statistics.median(r[k] for r in same) if isinstance(v, float) else v) for k, v in same[0].items()}
        out.append(row)
    return out


def print_figures(label: str, per_launch: list[list[dict]]) -> dict:
    """The three fidelity figures against their goals: per launch, then their median over launches."""
    launches = [figures(r) for r in per_launch]
    fig = {k: statistics.median(f[k] for f in launches) for k in launches[0]}
    spread = {k: f" [{min(f[k] for f in launches):.3g}..{max(f[k] for f in launches):.3g}]" if len(launches) > 1
              else "" for k in fig}
    ok = lambda good: "ok" if good else "MISSED"  # noqa: E731
    print(f"{label}, over {len(launches)} launch(es): median |time error| {fig['time_err'] * 100:.1f} %"
          f"{spread['time_err']} (goal <= {GOALS['time_err'] * 100:.0f} %: {ok(fig['time_err'] <= GOALS['time_err'])});"
          f"  Spearman rho {fig['spearman']:.3f}{spread['spearman']} (goal >= {GOALS['spearman']}: "
          f"{ok(fig['spearman'] >= GOALS['spearman'])});  worst |memory error| {fig['worst_mem_err'] * 100:.1f} %"
          f"{spread['worst_mem_err']} (goal <= {GOALS['mem_err'] * 100:.0f} %: "
          f"{ok(fig['worst_mem_err'] <= GOALS['mem_err'])})")
    signs = ", ".join(f"{f['over']}/{f['under']}" for f in launches)
    balanced = all(f["over"] and f["under"] for f in launches)
    print(f"{label}: median signed time error {fig['signed_err'] * 100:+.1f} %; plans predicted too slow / too fast "
          f"per launch: {signs} (goal: both signs in every launch, no single-sign bias: {ok(balanced)})")
    return fig


def print_auto_versus_forced(rows: list[dict]) -> None:
    """Each auto plan against the best forced plan (on the per-plan medians), same mesh and any mesh."""
    forced = [r for r in rows if not r["plan"].startswith(("auto", "pp"))]
    for r in (r for r in rows if r["plan"].startswith("auto")):
        same_mesh = [f for f in forced if f["mesh"] == r["mesh"]]
        for label, pool in (("same mesh", same_mesh), ("any mesh", forced)):
            if pool:
                best = min(pool, key=lambda f: f["meas_t"])
                print(f"{r['plan']} vs the best forced plan ({label}): {_versus(r, best)}")


def _versus(auto: dict, best: dict) -> str:
    """"no slower" when auto measured at most the best forced plan's time; "within noise" when above it by
    less than half the larger of their interquartile ranges over rounds; else "SLOWER"."""
    ratio = auto["meas_t"] / best["meas_t"]
    band = max(auto["iqr"], best["iqr"]) / 2
    verdict = "no slower" if ratio <= 1.0 else ("within noise" if ratio <= 1.0 + band else "SLOWER")
    return (f"{auto['meas_t'] * 1e3:.1f} vs {best['plan']} {best['meas_t'] * 1e3:.1f} ms measured: {ratio:.2f}x, "
            f"{verdict} (noise band {band * 100:.0f} %; predicted {auto['pred_t'] * 1e3:.1f} vs "
            f"{best['pred_t'] * 1e3:.1f} ms)")
