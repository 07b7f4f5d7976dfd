"""Did a later tree move the Mist comparison? Each point's best hand layouts rescored, autopar's side replanned.

    python benchmarks/vs_hand/mist_recheck.py [--points P ...]   # the one-tree sweeps of mist_report.py by default
    # -> benchmarks/results/vs_megatron_mist_recheck.{md,json}

The sweeps (``vs_megatron.py --simulate --suite mist``) scored both hand grids on one tree and ``mist_report.py
--replan`` planned autopar's side on it. A later tree may price plans differently. Rescoring a whole grid is the
sweep's work; this rescores, on this tree, the layout each sweep found best at each point (``score_config``, the
same options and time limit as the sweep) and plans autopar's side again (``vs_megatron.plan_autopar``, bf16,
``offload="auto"``), and tabulates saved and current step times side by side. Where every figure is unchanged
the sweep's table holds for this tree; where a hand layout's price moved, another layout of the grid may now
be the best, so the current ratio against the saved best layout is an upper bound.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.vs_hand import mist_report  # noqa: E402
from benchmarks.vs_hand import vs_megatron_report as report  # noqa: E402

HEADERS = ["point", "grid", "best hand layout (sweep)", "its step s (sweep)", "its step s (now)",
           "autopar step s (sweep tree)", "autopar step s (now)", "ratio (sweep)", "ratio (now)", "moved"]


def rescore_hand(point: str, config_text: str, time_limit: float) -> float | None:
    """``config_text``'s step time on this tree (None when it no longer fits)."""
    import autopar
    from autopar.baselines.hand_search import capture_once
    from autopar.baselines.megatron_configs import GPT_NAMES, LLAMA_NAMES, MegatronConfig, score_config
    from benchmarks.vs_hand import vs_megatron

    family, name, gpus, preset = point.split(":")
    cluster = autopar.Cluster.preset(preset, gpus=int(gpus))
    work = vs_megatron.build_workload(family, name, "bf16", preset, int(gpus))
    llama = family == "mistllama"
    blocks = work.model.lm.config.num_hidden_layers if llama else work.model.cfg.n_layer
    config = MegatronConfig.parse(config_text, precision="bf16")
    graph, recapture = capture_once(work.model, work.batch, "bf16")
    return score_config(graph, cluster, config, blocks, recapture, time_limit,
                        LLAMA_NAMES if llama else GPT_NAMES).step_time


def recheck(mist_names: tuple, full_names: tuple, time_limit: float = 300.0, only: list[str] | None = None) -> str:
    import autopar
    from benchmarks.vs_hand import vs_megatron

    autopar_rows = mist_report.load(mist_report.AUTOPAR)
    grids = {"mist": mist_report.load(*mist_names), "full": mist_report.load(*full_names)}
    points = sorted((set(grids["mist"]) | set(grids["full"])) & set(only or grids["mist"].keys() | grids["full"]),
                    key=mist_report.point_order)
    rows, data = [], []
    for point in points:
        family, name, gpus, preset = point.split(":")
        work = vs_megatron.build_workload(family, name, "bf16", preset, int(gpus))
        auto_now, _, _ = vs_megatron.plan_autopar(work, autopar.Cluster.preset(preset, gpus=int(gpus)), "bf16",
                                                  {"time_limit": time_limit, "offload": "auto"})
        auto_then = autopar_rows.get(point, {}).get("auto_step")
        for grid, saved in grids.items():
            row = saved.get(point)
            if not row or row.get("hand_step") is None:
                continue
            hand_now = rescore_hand(point, row["hand"], time_limit)
            entry = {"point": point, "grid": grid, "hand": row["hand"], "hand_then": row["hand_step"],
                     "hand_now": hand_now, "auto_then": auto_then, "auto_now": auto_now}
            data.append(entry)
            rows.append(_row(entry))
            print("| " + " | ".join(str(c) for c in rows[-1]) + " |", flush=True)
    tree = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    text = "\n\n".join([report.machine_line(f"Mist points: the sweeps' best hand layouts rescored and autopar "
                                            f"replanned on tree {tree}"),
                        report.markdown_table(HEADERS, rows),
                        f"Sweeps: {', '.join(mist_names + full_names)}; autopar's side at the sweep's tree: "
                        f"vs_megatron_{mist_report.AUTOPAR}.json. moved: any step time differs from the sweep's."])
    path = report.write_results("mist_recheck", text, data)
    print(text)
    return path


def _row(e: dict) -> list:
    fmt = lambda x: f"{x:.6g}" if x is not None else "n/a"  # noqa: E731
    then = e["hand_then"] / e["auto_then"] if e["auto_then"] else None
    now = e["hand_now"] / e["auto_now"] if e["auto_now"] and e["hand_now"] else None
    moved = e["hand_then"] != e["hand_now"] or e["auto_then"] != e["auto_now"]
    return [e["point"], e["grid"], e["hand"], fmt(e["hand_then"]), fmt(e["hand_now"]), fmt(e["auto_then"]),
            fmt(e["auto_now"]), f"{then:.4f}" if then else "n/a", f"{now:.4f}" if now else "n/a",
            "yes" if moved else "no"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mist", nargs="+", default=list(mist_report.MIST_SWEEPS), help="NAMEs: Mist-baseline sweeps")
    parser.add_argument("--full", nargs="+", default=list(mist_report.FULL_SWEEPS), help="NAMEs of full-grid sweeps")
    parser.add_argument("--time-limit", type=float, default=300.0, help="every ILP solve's limit (as the sweeps)")
    parser.add_argument("--points", nargs="+", help="only these FAMILY:NAME:GPUS:PRESET points")
    args = parser.parse_args(argv)
    recheck(tuple(args.mist), tuple(args.full), args.time_limit, args.points)
    return 0


if __name__ == "__main__":
    sys.exit(main())
