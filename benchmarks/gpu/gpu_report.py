"""Markdown tables of a GPU check's results (``gpu_check.py``): parity, profile, plans."""
from __future__ import annotations

GiB = 2**30


def markdown(results: dict) -> str:
    out = ["# autopar GPU check", "", f"environment: `{results.get('environment')}`", "",
           f"section seconds: {results.get('seconds', {})}", ""]
    out += _parity(results.get("parity")) + _shared(results.get("shared_gpu"))
    out += _profile(results.get("profile")) + _plans(results.get("plans"))
    return "\n".join(out) + "\n"


def _failed(section, title: str) -> list[str] | None:
    """The lines for a section that did not run ([] when absent, its error when it failed), else None."""
    if section is None:
        return []
    if isinstance(section, dict) and "error" in section:
        return [title, "", f"error: {section['error']}", "", "```", section.get("traceback", ""), "```", ""]
    return None


def _parity(rows) -> list[str]:
    failed = _failed(rows, "## Parity")
    if failed is not None:
        return failed
    out = ["## Parity (losses vs the same model on the device without autopar)", "",
           "| model | precision | worst rel. loss diff | tolerance | control (lr x2) | passed |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {_label(r)} | {r['precision']} | error: {r['error'][:300]} | | | no |")
        else:
            out.append(f"| {_label(r)} | {r['precision']} | {r['worst_rel']:.2e} | {r['tolerance']:.0e} | "
                       f"{r['control_worst_rel']:.2e} | {'yes' if r['passed'] else 'no'} |")
    return out + [""]


def _label(row) -> str:
    return row["model"] + (" (compile=True)" if row.get("compiled") else "")


def _shared(row) -> list[str]:
    failed = _failed(row, "## Two gloo ranks on one GPU")
    if failed is not None:
        return failed
    out = ["## Two gloo ranks on one GPU", "", f"worst rel. loss diff vs one device: {row['worst_rel']:.2e}",
           f"losses {row['autopar']} vs {row['reference']}", ""]
    cp = row.get("context_parallel")
    if cp is not None:
        out += [f"context parallel (sequence split over the 2 ranks): worst rel. loss diff {cp['worst_rel']:.2e}", ""]
    return out


def _profile(row) -> list[str]:
    failed = _failed(row, "## Profile")
    if failed is not None:
        return failed
    best = ", ".join(f"{d} {v / 1e12:.1f} TFLOP/s" for d, v in row["best_matmul"].items())
    out = ["## Profile (`autopar profile`, one rank)", "", f"- took {row['profile_s']:.1f} s; GPU {row.get('gpu')}",
           f"- matmul curve best: {best}",
           f"- direct 8192^3 bf16: {row.get('direct_bf16_8192', 0) / 1e12:.1f} TFLOP/s; "
           f"4096^3 fp32: {row.get('direct_fp32_4096', 0) / 1e12:.1f} TFLOP/s",
           f"- memory bandwidth {row['memory_bandwidth'] / 1e9:.0f} GB/s; usable memory "
           f"{row['memory_per_device'] / GiB:.2f} GiB of {row['memory_capacity'] / GiB:.2f} GiB",
           f"- op overhead {row['op_overhead'] * 1e6:.1f} us; compute_time_scale {row['compute_time_scale']:.3f}",
           f"- source: {row.get('cluster', {}).get('source', '')}", ""]
    return out


def _plans(rows) -> list[str]:
    failed = _failed(rows, "## Plans")
    if failed is not None:
        return failed
    out = ["## One-GPU plans: predicted vs measured", "",
           "| model | prec | recompute | mb | pred step ms | meas step ms | err | pred GiB | alloc GiB | err | "
           "reserved GiB | plain ms | autopar/plain | compile s |", "|" + "---|" * 14]
    for r in rows:
        head = f"| {r['model']} | {r['precision']} | {r['recompute']} "
        if "skipped" in r or "error" in r:
            out.append(head + f"| {r.get('skipped') or r['error'][:300]} |" + " |" * 10)
            continue
        t_err = r["predicted_step_s"] / r["measured_step_s"] - 1
        m_err = r["predicted_peak_bytes"] / r["max_allocated"] - 1 if r.get("max_allocated") else float("nan")
        plain = r.get("plain_step_s")
        out.append(head + f"| {r['microbatches']} | {r['predicted_step_s'] * 1e3:.1f} | "
                   f"{r['measured_step_s'] * 1e3:.1f} | {t_err:+.1%} | {r['predicted_peak_bytes'] / GiB:.2f} | "
                   f"{r.get('max_allocated', 0) / GiB:.2f} | {m_err:+.1%} | {r.get('max_reserved', 0) / GiB:.2f} | "
                   f"{plain * 1e3 if plain else float('nan'):.1f} | "
                   f"{r['measured_step_s'] / plain if plain else float('nan'):.3f} | {r['compile_s']:.1f} |")
    for r in rows:
        if "torch_compile_step_s" in r or "torch_compile_error" in r:
            compiled, eager = r.get("torch_compile_step_s", 0) * 1e3, r.get("measured_step_s", 0) * 1e3
            out += ["", f"torch.compile on {r['model']} {r['precision']}: {compiled:.1f} ms/step (eager {eager:.1f}),"
                    f" first step {r.get('compile_first_step_s', 0):.1f} s {r.get('torch_compile_error', '')}"]
    return out + [""]
