"""Pass 5b, interleave: whether a pipeline runs interleaved 1F1B (Megatron-LM's virtual stages), and how.

Input:  the stage DP's ``StageChoice`` (pp stages, B microbatches), its ``StageCosts``, the global batch,
        the schedule option ("1f1b", "interleaved", "auto") and ``virtual_stages`` (None: choose).
Output: the same choice (v = 1), or one of pp·v model chunks with ``virtual = v``: chunk j holds a
        contiguous run of layers and runs on the submesh of DP stage j mod pp (round robin).

For each v with pp·v ≤ layers and B a multiple of pp (Megatron's requirement), the layers are cut into
pp·v chunks that balance their per-microbatch time (a linear-partition DP on the DP's layer prices, at
the mesh option all stages share), then priced by the schedule simulator:

    time(v) = makespan of ``simulate_schedule(chunk forward, chunk backward, B, interleaved, hop, v)``

with a chunk's forward = 1/3 and backward = 2/3 of its per-microbatch time (as ``plan_builder``), each plus
c, the pipeline runtime's host time per (chunk, microbatch) and direction (``Cluster.microbatch_overhead``,
charged as ``plan_builder.charge_microbatch_overhead`` charges the plan: every chunk runs its own module,
receives and sends for each microbatch, so v chunks per device pay v times the 1F1B stage's 2c·B), and hop
the slowest cut's transfer (forward send and gradient return, ``StageCosts.hops_at``); v sends cross
devices per microbatch where 1F1B has one, which is what the smaller bubble, (pp−1)/(v·B) instead of
(pp−1)/B of the ideal time, has to pay for. Memory per device d:

    Σ_{c on d} (param_c + peak_c) + max_t Σ_{c on d} live_c(t) · act_c  ≤  device memory

with live_c(t) the microbatches chunk c holds at op t of the device's order (``schedule.device_order``;
warm-up keeps more of them alive on the first device than 1F1B does). v = 1 is priced the same way, so
"auto" keeps the smaller time; "interleaved" takes the best v ≥ 2. The chosen chunks' exact solves
then split each device's memory by these estimates (``_LayerPrices.shares``). Interleaving is considered when every
DP stage uses the same mesh option, recomputes nothing and offloads its optimizer alike (chunks of a mixed
pipeline have no one mesh to share); otherwise the reason is recorded and the choice is kept. Where every
stage offloads, so does every chunk, priced as the DP prices it (``stage_offload``).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from autopar.errors import OptionError, PlanError
from autopar.ir.schedule import FORWARD, INTERLEAVED, device_orders, inflight, simulate_schedule
from autopar.passes.inter_op import ChosenStage, StageChoice, StageCosts
from autopar.passes.stage_offload import offload_spans

MAX_VIRTUAL = 8


def check_schedule(schedule: str, virtual_stages, stages) -> None:
    """PlanError for a ``virtual_stages`` the schedule cannot use (the option's checks)."""
    if virtual_stages is None:
        return
    if not isinstance(virtual_stages, int) or isinstance(virtual_stages, bool) or virtual_stages < 1:
        raise OptionError(f"virtual_stages={virtual_stages!r} must be a positive int (model chunks per device)")
    if virtual_stages > 1 and schedule not in (INTERLEAVED, "auto"):
        raise OptionError(f"virtual_stages={virtual_stages} needs schedule='interleaved' (or 'auto'), got "
                        f"schedule={schedule!r}")
    if isinstance(stages, (list, tuple)) and len(stages) % virtual_stages:
        raise OptionError(f"{len(stages)} manual stages do not split into virtual_stages={virtual_stages} chunks per "
                        f"device; list pp·v stages, chunk j on the submesh of chunk j mod pp")


def dp_schedule(schedule: str) -> str:
    """The schedule the stage DP prices (it cuts pp stages; interleaving them comes after)."""
    return "gpipe" if schedule == "gpipe" else "1f1b"


def recorded_schedule(schedule: str, virtual: int) -> str:
    """What the plan records: "gpipe", "interleaved" (v > 1) or "1f1b" ("auto" resolved)."""
    return "gpipe" if schedule == "gpipe" else (INTERLEAVED if virtual > 1 else "1f1b")


def manual_chunks(stages: list[ChosenStage], virtual: int, microbatches: int, memory: float) -> list[ChosenStage]:
    """A manual interleaved stage list: PlanError unless chunk j shares the submesh of chunk j mod pp and the
    microbatches split into groups of pp; each chunk's in-flight count from the interleaved order, and an
    equal share of the device's ``memory`` for its exact solve (no DP prices them to split it otherwise)."""
    pp = len(stages) // virtual
    for j, s in enumerate(stages[pp:], start=pp):
        if s.option != stages[j % pp].option:
            raise PlanError(f"manual interleaved stage {j} must use the submesh and mesh of stage {j % pp} "
                            f"({stages[j % pp].option.physical}, {stages[j % pp].option.logical})")
    if microbatches % pp:
        raise PlanError(f"interleaved 1F1B over {pp} devices needs microbatches a multiple of {pp}, got {microbatches}")
    live = inflight(INTERLEAVED, len(stages), microbatches, virtual)
    return [s._replace(inflight=live[j], budget=memory / virtual) for j, s in enumerate(stages)]


def choose_virtual(choice: StageChoice, costs: StageCosts, global_batch: int, schedule: str,
                   virtual_stages: int | None) -> StageChoice:
    """The interleaved choice (or ``choice``), its ``notes`` saying what was priced:
    {"virtual_stages": {v: predicted seconds, or why not}}."""
    chosen, record = _choose(choice, costs, global_batch, schedule, virtual_stages)
    return dataclasses.replace(chosen, notes={**chosen.notes, **record})


def _choose(choice: StageChoice, costs: StageCosts, global_batch: int, schedule: str,
            virtual_stages: int | None) -> tuple[StageChoice, dict]:
    pp, B = len(choice.stages), choice.microbatches
    if schedule not in (INTERLEAVED, "auto") or pp < 2:
        return choice, {}
    why = _cannot_interleave(choice)
    if why:
        return _refuse(choice, schedule, why)
    option = choice.stages[0].option
    m = costs.options.index(option)
    layer_cost = _LayerPrices(choice, costs, m, global_batch)
    wanted = [virtual_stages] if virtual_stages else [v for v in range(1, MAX_VIRTUAL + 1)]
    priced: dict[int, object] = {}
    for v in wanted:
        if v > 1 and (pp * v > costs.layers.count or B % pp):
            priced[v] = f"needs {pp * v} layers and microbatches a multiple of {pp}"
            continue
        priced[v] = layer_cost.price(pp, v)
    fits = {v: t for v, t in priced.items() if isinstance(t, float) and (v > 1 or schedule == "auto")}
    record = {"virtual_stages": {str(v): t for v, t in priced.items()}}
    if not fits:
        return _refuse(choice, schedule, f"no interleaving fits: {priced}")
    best = min(fits, key=lambda v: (fits[v], v))
    if best == 1:
        return choice, record
    cuts = layer_cost.cuts(pp, best)
    return _chunked(choice, cuts, option, best, layer_cost), record


def keep_uninterleaved(choice: StageChoice, why: str) -> StageChoice:
    """``choice`` as the DP cut it (v = 1), its notes saying ``why`` it was not interleaved."""
    return dataclasses.replace(choice, notes={**choice.notes, "virtual_stages": {"1": "kept", "why": why}})


def _cannot_interleave(choice: StageChoice) -> str:
    if len({s.option for s in choice.stages}) > 1:
        return "the stages use different submeshes"
    if any(s.recompute for s in choice.stages):
        return "a stage recomputes layers"
    if len({s.offload for s in choice.stages}) > 1:
        return "some stages offload their optimizer state and others do not"
    return ""


def _refuse(choice: StageChoice, schedule: str, why: str) -> tuple[StageChoice, dict]:
    if schedule == INTERLEAVED:
        raise PlanError(f"schedule='interleaved' cannot be planned: {why}; use schedule='auto' or '1f1b'")
    return choice, {"virtual_stages": {"1": "kept", "why": why}}


def _chunked(choice: StageChoice, cuts: list[tuple[int, int]], option, v: int, prices: "_LayerPrices") -> StageChoice:
    live = inflight(INTERLEAVED, len(cuts), choice.microbatches, v)
    budgets = prices.shares(cuts, len(cuts) // v, live)
    stages = [ChosenStage(k, i, option, live[j], budget=budgets[j], offload=prices.offload)
              for j, (k, i) in enumerate(cuts)]
    return dataclasses.replace(choice, stages=stages, virtual=v)


class _LayerPrices:
    """Per-microbatch time and memory of any layer range k..i on the DP stages' mesh option, from the
    solution variant the DP used for the first stage (``StageCosts.picks``)."""

    def __init__(self, choice: StageChoice, costs: StageCosts, m: int, global_batch: int):
        B, first = choice.microbatches, choice.stages[0]
        b = global_batch // B
        picks = costs.picks.get(B)
        f = min(first.inflight, picks.shape[-1]) if picks is not None else 1
        variant = max(0, int(picks[0, first.first, first.last, m, f - 1])) if picks is not None else 0
        self.lc = costs.costs(m)[variant]
        scale = b / self.lc.reference_batch
        self.latency, memory = self.lc.stage_tables(scale, B, 1)
        t, sync, param, act, peak = self.lc.ranges
        self.fixed, self.act = param + scale * peak, scale * act
        self.offload = choice.stages[0].offload  # every stage's (``_cannot_interleave``): priced as the DP did
        if self.offload:
            freed, added = offload_spans(self.lc.host_state)
            self.latency, self.fixed = self.latency + added / B, self.fixed - freed
        self.hops, self.B, self.budget = costs.hops_at(b), B, costs.cluster.memory_per_device
        self.host = costs.cluster.microbatch_overhead  # c per (chunk, microbatch) and direction
        self.L = costs.layers.count

    def cuts(self, pp: int, v: int) -> list[tuple[int, int]]:
        """pp·v contiguous layer ranges minimizing the slowest one (linear partition)."""
        n, L = pp * v, self.L
        best = np.full((n + 1, L + 1), np.inf)
        back = np.zeros((n + 1, L + 1), dtype=int)
        best[0, 0] = 0.0
        for c in range(1, n + 1):
            for end in range(c, L - (n - c) + 1):
                for start in range(c - 1, end):
                    val = max(best[c - 1, start], self.latency[start, end - 1])
                    if val < best[c, end]:
                        best[c, end], back[c, end] = val, start
        out, end = [], L
        for c in range(n, 0, -1):
            start = int(back[c, end])
            out.append((start, end - 1))
            end = start
        return out[::-1]

    def price(self, pp: int, v: int) -> float | str:
        """Seconds of the schedule's makespan, or why the chunks do not fit in memory."""
        cuts = self.cuts(pp, v)
        lat = [float(self.latency[k, i]) for k, i in cuts]
        hop = max((float(self.hops[k]) for k, _ in cuts[1:]), default=0.0) / 2
        c = self.host
        ops = simulate_schedule([t / 3 + c for t in lat], [2 * t / 3 + c for t in lat], self.B,
                                INTERLEAVED if v > 1 else "1f1b", hop, v)
        worst = max(self._device_memory(cuts, pp, v, d) for d in range(pp))
        if worst > self.budget:
            return f"needs {worst:.3g} bytes per device"
        return float(max(op.end for op in ops))

    def shares(self, cuts, pp: int, live: list[int]) -> list[float]:
        """Each chunk's memory budget for its exact solve: the device's v chunks split the device's memory in
        proportion to their estimates e_c = param_c + peak_c + live_c · act_c (live_c: the most microbatches
        chunk c holds), so Σ_{c on d} budget_c = device memory, and the plan's peak (Σ of its chunks'
        peaks, ``plan_builder.predict``) stays within it. Solved with the whole device each, every chunk
        could fill it alone."""
        need = [float(self.fixed[k, i]) + live[j] * float(self.act[k, i]) for j, (k, i) in enumerate(cuts)]
        return [self.budget * need[j] / sum(need[j % pp::pp]) for j in range(len(cuts))]

    def _device_memory(self, cuts, pp: int, v: int, device: int) -> float:
        mine = {j: cuts[j] for j in range(device, pp * v, pp)}
        fixed = sum(float(self.fixed[k, i]) for k, i in mine.values())
        live, most = dict.fromkeys(mine, 0), 0.0
        order = device_orders(INTERLEAVED if v > 1 else "1f1b", pp * v, self.B, v)[device]
        for kind, s, _ in order:
            live[s] += 1 if kind == FORWARD else -1
            most = max(most, sum(n * float(self.act[mine[c][0], mine[c][1]]) for c, n in live.items()))
        return fixed + most

