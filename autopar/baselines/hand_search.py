"""Searching a grid of hand configurations with autopar's cost model: scoring, exact pruning, memory ignored.

    from autopar.baselines.hand_search import capture_once, score_options, search_hand
    graph, recapture = capture_once(model, batch, "fp16")
    search = search_hand(configs, score, layout_of, memory_free=lambda c: c.recompute == "none")
    search.best, search.scored, search.unbounded, search.memory_binds, search.ceiling

A config is any object ``score(config, unbounded=False) -> Scored`` prices (``megatron_configs`` turns one
into manual stages and pins, ``score_options`` plans them on an already captured graph). What the search
shares between configs, and why each shortcut leaves every score as a fresh ``autopar.plan`` would give it:

* captures: ``capture_once`` captures the model once at the global batch and once per microbatch count,
  and every config that plans at that count reuses the graph. A capture is a pure function of the model,
  the microbatch's shapes and the precision policy, and planning only adds caches to a graph (node
  signatures, the batch-dim analysis, strategies per (mesh, pins) in ``single_stage.strategies_for``), each a pure
  function of the graph;
* microbatch graphs: the graph at each microbatch count (rescaled, or re-captured) is made once per graph
  (``microbatch_graphs``, the driver's ``at_microbatch``) and shared by every config planned at that count,
  with what planning caches on it;
* floors: with ``floor(config)`` (``hand_bounds``), a config whose lower bound exceeds the best step found is
  not planned (``SKIPPED``); it cannot be the answer (``grid_search``, ``SharedBound``);
* cores: layouts (``layout_of``) are searched independently, each in a forked worker
  (``passes.forked.parallel_map``), and their results merged in the grid's order with the serial search's
  strict ``<``, so the best config, ties included, is the one the serial search returns.

Pruning inside a layout (microbatch counts B, visited most first) is the grid search's own (see
``grid_search``): a config that does not fit ends its layout (fewer, larger microbatches need more memory),
and ``patience`` fitting configs in a row slower than the layout's best end it too.

Memory ignored (``UNBOUNDED_MEMORY``): the configs ``memory_free`` admits (no recompute: recompute adds a
forward and saves only memory) are all searched again at a budget no device binds. The fastest of them,
``unbounded``, is the ceiling a planner sharing the cost model could reach with memory levers alone:
``ceiling`` = best step time that fits / unbounded step time (≥ 1 when the best that fits is memory-free).
Memory binds where a config that does not fit, with memory ignored, beats the best that fits (or nothing
fits).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import multiprocessing

from autopar.errors import InfeasibleError
from autopar.passes.forked import parallel_map
from autopar.planner.driver import plan_graph
from autopar.planner.options import PlanOptions, first_microbatch

# The memory budget of "memory ignored": far above any device (1 PiB), finite so the ILP's rows stay numeric.
UNBOUNDED_MEMORY = 2.0 ** 50


@dataclasses.dataclass
class Scored:
    """One config's predicted step time (seconds), or None with ``status`` "OOM" when it does not fit."""

    config: object
    step_time: float | None
    status: str = "ok"
    plan: object = None


def score_options(graph, cluster, config, options: dict, recapture=None, time_limit: float = 60.0,
                  model_name: str = "GPT") -> Scored:
    """Plan with ``options`` on an already captured graph (``plan_graph``: what ``autopar.plan`` runs after
    capture); a plan that does not fit ``cluster.memory_per_device`` scores "OOM"."""
    try:
        plan = plan_graph(graph, cluster, PlanOptions(time_limit=time_limit, **options), model_name=model_name,
                          recapture=recapture, at_microbatch=microbatch_graphs(graph, recapture))
    except InfeasibleError:
        return Scored(config, None, "OOM")
    if plan.predicted["peak_memory"] > cluster.memory_per_device:
        return Scored(config, None, "OOM")
    return Scored(config, float(plan.predicted["step_time"]), plan=plan)


def microbatch_graphs(graph, recapture=None):
    """The driver's ``at_microbatch(B)`` for ``graph``, one per graph and shared by every plan of it (kept on the
    graph): each B's graph is rescaled or re-captured once, and what planning caches on it (strategies per
    (mesh, pins), node signatures, memory bounds) serves every config at that B."""
    from autopar.planner.driver import shared_microbatch_graphs

    owner, shared = getattr(graph, "_hand_microbatch_graphs", (None, None))
    if owner is not recapture:
        shared = shared_microbatch_graphs(graph, recapture)
        graph._hand_microbatch_graphs = (recapture, shared)
    return shared


def capture_once(model, batch, precision: str = "fp32") -> tuple:
    """(graph at the global batch, recapture(B) at one of B microbatches, each B captured once), with
    ``precision``'s dtypes propagated as ``autopar.plan`` does (so both sides are priced alike).

    The driver re-captures at a plan's B whenever ``batch_dims.rescale_is_exact`` is False (a size the
    walk cannot follow); uncached, such captures were 80 % of a grid's time."""
    from autopar.ir.precision import apply_to_graph, resolve
    from autopar.passes.capture import capture

    policy = resolve(precision)
    graph = apply_to_graph(capture(model, batch), policy)
    return graph, functools.cache(lambda b: apply_to_graph(capture(model, first_microbatch(batch, b)), policy))


def precapture(graph, recapture, microbatches) -> None:
    """Make the graph at every count of ``microbatches`` (re-captured or rescaled, ``microbatch_graphs``) here,
    before workers fork, so that they share them instead of each making its own."""
    shared = microbatch_graphs(graph, recapture)
    for b in sorted(set(microbatches)):
        shared(b)


SKIPPED = "skipped (floor above the best)"  # the status of a config its lower bound ruled out, never planned


class SharedBound:
    """The fastest step time found so far, shared by the forked workers of one search (doubles in shared
    memory, inherited through fork), and the limit a config's floor must not exceed to be planned.

    With ``oom`` and ``best_fit`` (the memory-ignored search): a config of ``oom`` (it did not fit) is also
    planned while its floor is below ``best_fit``, until one of them is found faster than ``best_fit`` (then
    memory binds, ``HandSearch.memory_binds``, and only the fastest matters)."""

    def __init__(self, oom: frozenset = frozenset(), best_fit: float | None = None):
        self._best = multiprocessing.Value("d", math.inf)
        self._binds = multiprocessing.Value("b", 0)
        self.oom, self.best_fit = oom, best_fit

    def limit(self, config) -> float:
        if self.best_fit is not None and config in self.oom and not self._binds.value:
            return max(self._best.value, self.best_fit)
        return self._best.value

    def offer(self, config, step_time: float) -> None:
        with self._best.get_lock():
            self._best.value = min(self._best.value, step_time)
        if self.best_fit is not None and config in self.oom and step_time < self.best_fit:
            self._binds.value = 1


def _search_layout(ordered: list, score, patience: int, log, floor=None, bound: SharedBound | None = None
                   ) -> list[Scored]:
    """One layout's configs, most microbatches first, scored until the pruning rules end it (``grid_search``)."""
    scored, layout_best, worse = [], math.inf, 0
    for k, config in enumerate(ordered):
        if floor is not None and floor(config) > bound.limit(config):
            scored.append(Scored(config, None, SKIPPED))
            worse = 0  # as if it were the layout's best: the walk never stops sooner than without the bound
            continue
        result = score(config)
        result.plan = None  # plans stay in the worker; only the scores travel back
        scored.append(result)
        if log is not None:
            log(result)
        if result.step_time is None:
            return scored + [Scored(c, None, "OOM") for c in ordered[k + 1:]]
        if bound is not None:
            bound.offer(config, result.step_time)
        if result.step_time < layout_best:
            layout_best, worse = result.step_time, 0
        else:
            worse += 1
            if worse >= patience:
                break
    return scored


def grid_search(configs: list, score, layout_of, patience: int = 2, log=None, cost=None,
                parallel: bool = True, floor=None, bound: SharedBound | None = None
                ) -> tuple[Scored | None, list[Scored]]:
    """Score ``configs`` (``score(config) -> Scored``); returns (fastest that fits or None, every scored one).

    Configs are visited per layout (``layout_of(config)``, e.g. (dp, tp, pp)); within a layout the given order
    is microbatches ascending, and they are visited in reverse, most microbatches first. Two rules prune:

    * memory per device does not grow with the microbatch count (the global batch is fixed, so a microbatch
      shrinks as 1/B while the microbatches in flight stay at most pp·v chunk-sized ones), so once a config
      does not fit, the layout's configs with fewer microbatches do not either: they are recorded "OOM"
      without planning;
    * step time against the microbatch count is unimodal under the cost model (the pipeline bubble shrinks
      as 1/B while per-microbatch latencies add up as B grows), so a layout is left after ``patience``
      fitting configs in a row slower than its best.

    ``parallel``: layouts in forked workers, the most expensive first (``cost(config)`` summed over a
    layout's configs, default 1 each); the answer is the serial one (module docstring).

    ``floor(config)``: a lower bound on its step time (``hand_bounds``). Layouts are then visited best first
    (least floor), and a config whose floor exceeds ``bound``'s limit (the fastest found so far, over every
    worker) is recorded ``SKIPPED`` without planning: it cannot be the fastest. A skipped config resets the
    patience count, so a layout's walk goes at least as far over the planned configs as it would without
    the bound: the answer is never slower than the unbounded walk's, and equal to it unless the longer walk
    finds a faster config."""
    layouts = list(dict.fromkeys(layout_of(c) for c in configs))
    members = {layout: [c for c in configs if layout_of(c) == layout][::-1] for layout in layouts}
    if floor is not None:
        bound = bound or SharedBound()
        least = {layout: min(floor(c) for c in group) for layout, group in members.items()}
        order = sorted(range(len(layouts)), key=lambda j: least[layouts[j]])
    else:
        weight = {layout: sum(cost(c) if cost else 1 for c in group) for layout, group in members.items()}
        order = sorted(range(len(layouts)), key=lambda j: -weight[layouts[j]])
    run = functools.partial(_run_layout, members=members, score=score, patience=patience, log=log, floor=floor,
                            bound=bound)
    mapped = parallel_map(run, [layouts[j] for j in order], "hand layouts") if parallel else \
        [run(layouts[j]) for j in order]
    per_layout = dict(zip(order, mapped))
    scored, best = [], None
    for j in range(len(layouts)):
        for result in per_layout[j]:
            scored.append(result)
            if result.step_time is not None and (best is None or result.step_time < best.step_time):
                best = result
    return best, scored


def _run_layout(layout, members: dict, score, patience: int, log, floor=None, bound=None) -> list[Scored]:
    return _search_layout(members[layout], score, patience, log, floor, bound)


@dataclasses.dataclass
class HandSearch:
    """A hand grid's answer: ``best``, the fastest config that fits (None when none does); ``scored``, every
    config scored; ``free``, the memory-free configs scored with memory ignored; ``unbounded``, the fastest
    of those (None when none was searched)."""

    best: Scored | None
    scored: list[Scored]
    free: list[Scored] = dataclasses.field(default_factory=list)

    @property
    def unbounded(self) -> Scored | None:
        timed = [r for r in self.free if r.step_time is not None]
        return min(timed, key=lambda r: r.step_time) if timed else None

    @property
    def memory_binds(self) -> bool:
        """Memory changes the answer: a config that does not fit beats the best one that fits once memory is
        ignored, or no config fits at all."""
        if self.best is None:
            return True
        out = {r.config for r in self.scored if r.status == "OOM"}
        return any(r.step_time is not None and r.step_time < self.best.step_time
                   for r in self.free if r.config in out)

    @property
    def ceiling(self) -> float | None:
        """best that fits / fastest with memory ignored, as a throughput ratio (module docstring)."""
        if self.best is None or self.unbounded is None:
            return None
        return self.best.step_time / min(self.unbounded.step_time, self.best.step_time)


def search_hand(configs: list, score, layout_of, patience: int = 2, log=None, memory_free=None, cost=None,
                parallel: bool = True, floor=None) -> HandSearch:
    """``grid_search`` of ``configs``, then every config ``memory_free`` admits (all by default) searched
    again with ``score(config, unbounded=True)`` (module docstring). Configs must be hashable (they are
    matched by value: workers return copies). ``floor``: see ``grid_search``; in the memory-ignored search a
    config that did not fit is planned while its floor is below the best that fits, until memory is found to
    bind (``SharedBound``), so ``memory_binds`` and ``ceiling`` are those of the search without the floor
    (or of its longer walk)."""
    best, scored = grid_search(configs, score, layout_of, patience, log, cost, parallel, floor)
    free = [c for c in configs if memory_free is None or memory_free(c)]
    marked = None if log is None else (lambda r: log(dataclasses.replace(r, status=f"{r.status}, memory ignored")))
    bound = None
    if floor is not None:
        bound = SharedBound(frozenset(r.config for r in scored if r.status == "OOM"),
                            best.step_time if best is not None else None)
    _, unbounded = grid_search(free, functools.partial(_unbounded, score=score), layout_of, patience, marked, cost,
                               parallel, floor, bound)
    return HandSearch(best, scored, unbounded)


def _unbounded(config, score) -> Scored:
    return score(config, unbounded=True)
