"""autopar demo: plan a GPT for a simulated 2×8 DGX-A100 cluster, then train a GPT built on the meta device in
shards on 4 CPU ranks.

    python examples/demo.py          (or ./run.sh demo, which installs everything first)

Part 1 plans GPT-1.3B (Alpa's suite, on the meta device: no memory needed) for two DGX-A100 nodes and
prints the plan. Part 2 builds the small GPT example on the meta device (shapes only), compiles it for
``Cluster.local(4)`` as a 2×2 mesh with a memory budget that forces sharding: each rank materializes only its
own shards, initialized by autopar from ``init_seed`` (the same weights whatever the plan), and no rank ever
holds the whole model. It trains a few AdamW steps on 4 gloo ranks and prints the losses next to the same
model trained on one device from ``autopar.init_weights`` (exactly those weights), and each rank's share of
the model's bytes.
"""
from __future__ import annotations

import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from autopar.passes.capture import capture  # noqa: E402
from autopar.planner.driver import PlanOptions, memory_bounds  # noqa: E402
from examples.gpt import GPT, GPTConfig, make_batch, make_gpt, suite_config  # noqa: E402

STEPS = 5


def plan_for_dgx() -> None:
    cfg = suite_config("1.3B")
    with torch.device("meta"):
        model = GPT(cfg).half()
    batch = make_batch(cfg, 16, device="meta")
    cluster = autopar.Cluster.preset("dgx-a100", nodes=2)
    start = time.perf_counter()
    plan = autopar.plan(model, cluster, batch)
    print(f"== Part 1: GPT-1.3B ({cfg.n_params / 1e9:.2f}B parameters, batch 16×1024, fp16) on 2×8 "
          f"DGX-A100, planned in {time.perf_counter() - start:.1f} s\n")
    print(plan.summary(max_rows=25))


def meta_gpt():
    """The GPT example on the meta device (no memory) and its batch."""
    cfg = GPTConfig(n_layer=2)
    with torch.device("meta"):
        model = GPT(cfg)
    return model, make_batch(cfg, 8)


def train_on_local_cluster(rank: int, budget: float):
    model, batch = meta_gpt()
    reference = autopar.init_weights(copy.deepcopy(model), init_seed=0)  # the one-device reference
    cluster = autopar.Cluster.local(4, mesh_shape=(2, 2), memory_per_device=budget)
    pm = autopar.compile(model, cluster, batch, stages=1, init_seed=0)  # this rank's shards only
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-3, eps=1e-6)  # any plan, ZeRO included
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    rows = []
    for step in range(STEPS):
        loss = pm.train_step(*batch)
        opt.step()
        opt.zero_grad()
        ref_loss = reference(*batch)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        rows.append((step, loss.item(), ref_loss.item()))
    return rows, (pm.plan.summary(max_rows=40) if rank == 0 else None), (pm.code if rank == 0 else None)


def tight_budget() -> float:
    """A per-device budget between the least memory any plan needs and a fully replicated plan's."""
    model, batch = make_gpt(GPTConfig(n_layer=2), batch_size=8)  # on the CPU: the planner's memory bounds
    floor, replicated = memory_bounds(capture(model, batch), autopar.Cluster.local(4, mesh_shape=(2, 2)),
                                      PlanOptions())
    return floor + 0.3 * (replicated - floor)


def main() -> int:
    plan_for_dgx()
    budget = tight_budget()
    print(f"\n== Part 2: the GPT example built on the meta device, trained in shards on Cluster.local(4) as a 2×2 "
          f"mesh, {budget / 2**20:.2f} MiB per rank (a fully replicated copy would not fit)\n")
    results = autopar.launch(train_on_local_cluster, 4, budget)
    rows, summary, code = results[0]
    print(summary)
    print("\nrank 0's generated code (first lines):\n" + "\n".join(code.splitlines()[38:52]) + "\n    ...")
    print(f"\n{'step':>4}  {'autopar (4 ranks)':>18}  {'single device':>14}  {'rel. error':>10}")
    worst = 0.0
    for step, loss, ref in rows:
        err = abs(loss - ref) / abs(ref)
        worst = max(worst, err)
        print(f"{step:>4}  {loss:>18.6f}  {ref:>14.6f}  {err:>10.1e}")
    same = all(r[0] == results[0][0] for r in results)
    print(f"\nlosses identical on all 4 ranks: {same}; largest relative error vs one device: {worst:.1e}")
    return 0 if worst <= 1e-5 and same else 1


if __name__ == "__main__":
    sys.exit(main())
