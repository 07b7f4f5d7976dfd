"""``autopar.compile(..., compile=True)``: each generated per-rank module runs under ``torch.compile`` (inductor).

The unit compiled is the generated ``fx.GraphModule`` of a runner (``runner.gm``: the SPMD module, a pipeline
stage, an interleaved model chunk), wrapped once per rank by ``torch.compile(gm, dynamic=False)``. Its forward
is what the runners call for every microbatch; autograd of the compiled forward is the compiled backward
(AOTAutograd partitions the joint graph, inductor compiles both halves). What stays outside, in Python, is
what runs between module calls and is per step, not per op: the pipeline's sends and receives, the loss
scaling, the gradient-sync buckets and their hooks (post-accumulate-grad hooks on the parameters still fire:
the compiled backward accumulates into ``.grad`` as eager autograd does). Inside the module:

  * collectives of tensor parallelism are traced as functional collectives (``runtime.traced_collectives``),
    so a sharded layer is one graph, with no break at its all-reduces;
  * recompute regions (``runtime.recompute_regions``: non-reentrant ``torch.utils.checkpoint`` of an outlined
    body) are traced by dynamo as activation-checkpoint regions: the partitioner recomputes them in backward;
  * ZeRO-3's gather / prefetch / free calls (``runtime.zero3_graph.UnitCall``) change storage and wait on
    asynchronous work: they are the only graph breaks, run eagerly (``torch.compiler.disable``), one per
    unit use, i.e. a few per layer at most; their saved-tensor hooks still see every parameter the compiled
    backward saves. A recompute region holding such a call (ZeRO-3 with recompute) cannot be traced as one
    checkpoint region; dynamo then runs it eagerly (not measured yet: the tests cover each alone).

Compilation happens at the first call for each (grad mode, input shapes); the same shapes never compile
again (``dynamic=False``: a later shape compiles its own static graph instead of a dynamic one). A graph
inductor fails to compile runs eagerly instead (the traced fx graph itself: same ops, same collectives in
the same order), and a failure of dynamo itself at the first call makes the module run eagerly from then
on; either way ONE warning per module names the cause. Errors raised while running are not swallowed.

``resolve(compile, device_type)``: ``"auto"`` is on for CUDA plans and off on CPU ranks (inductor's C++
compilation costs minutes on a few cores, more than short CPU runs gain); True / False force it.
"""
from __future__ import annotations

import warnings

import torch

from autopar.errors import CommunicationError, OptionError
from autopar.runtime import faults

CHOICES = (True, False, "auto")


def resolve(option, device_type: str) -> bool:
    """Whether to compile: ``option`` is True, False or "auto" (on for CUDA, off elsewhere)."""
    if option is True or option is False:
        return option
    if option == "auto":
        return device_type == "cuda"
    raise OptionError(f"compile={option!r} is not a choice; use compile=True (torch.compile every rank's module), "
                     f"False (run eagerly) or 'auto' (on for CUDA clusters, off on CPU ranks)")


class CompiledModule:
    """``gm`` under ``torch.compile``, falling back to ``gm`` itself on a compile failure (module docstring)."""

    def __init__(self, gm: torch.fx.GraphModule, label: str):
        self.gm, self.label = gm, label
        self.failure: str | None = None  # the cause, once compilation failed
        self.fn = torch.compile(gm, backend=self._backend, dynamic=False)

    def __call__(self, *args):
        if self.failure is not None and self.fn is None:
            return self.gm(*args)
        try:
            return faults.guard("compiled module", None, self.fn, *args)
        except CommunicationError:
            raise
        except torch._dynamo.exc.TorchDynamoException as e:
            self._fell_back(e)
            self.fn = None
            return self.gm(*args)

    def _backend(self, graph: torch.fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        try:
            return inductor(graph, example_inputs, compile_fx)
        except Exception as e:  # noqa: BLE001 - any inductor failure: this graph runs eagerly
            self._fell_back(e)
            return graph.forward

    def _fell_back(self, error: BaseException) -> None:
        if self.failure is None:
            self.failure = f"{type(error).__name__}: {_first_line(error)}"
            warnings.warn(f"autopar: torch.compile of {self.label} failed ({self.failure}); that module runs "
                          f"eagerly instead (correct, not faster). Pass compile=False to skip compiling.",
                          stacklevel=4)


def inductor(graph, example_inputs, compile_fx):
    """The inductor backend (one place, so a test can make it fail)."""
    return compile_fx(graph, example_inputs)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else "no message"


def compile_runner(runner) -> None:
    """Put each generated module of ``runner`` (its chunks', when interleaved) under ``CompiledModule``."""
    for part in getattr(runner, "chunks", None) or [runner]:
        part.compiled = CompiledModule(part.gm, f"stage {part.stage.index}'s module")


def compile_failures(runner) -> list[str]:
    """The causes of this rank's fallbacks to eager (empty when everything compiled or nothing was asked)."""
    parts = getattr(runner, "chunks", None) or [runner]
    return [p.compiled.failure for p in parts if getattr(p, "compiled", None) is not None and p.compiled.failure]
