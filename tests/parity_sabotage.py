"""Negative controls of the parity suites: each sabotage breaks one mechanism on every rank alike (nothing
hangs; the results go wrong) and returns the callable that undoes it, so a control proves its parity test can
fail. Also the collective counter a case reads (``count_collectives``)."""
import torch

from autopar.runtime import collectives, faults


def count_collectives() -> callable:
    """Count this rank's collectives (every ``faults.guard`` call) from now on; the returned callable stops
    counting and gives (all of them, those run by a recomputed region's replay in backward)."""
    original, calls = faults.guard, [0, 0]

    def counting(name, key, fn, *args, **kwargs):
        calls[0] += 1
        calls[1] += int(_in_recompute())
        return original(name, key, fn, *args, **kwargs)

    faults.guard = counting

    def stop() -> tuple[int, int]:
        faults.guard = original
        return calls[0], calls[1]
    return stop


def _in_recompute() -> bool:
    """Inside a backward pass with gradient recording on: only a checkpointed region's replay does that."""
    return torch._C._current_graph_task_id() != -1 and torch.is_grad_enabled()


def _skip_collectives_in_replay() -> callable:
    """Recomputed regions whose backward replay skips every collective (an all-reduce keeps its local
    value, other outputs stay zero), on every rank alike: nothing hangs, the replayed activations are wrong."""
    original = faults.guard

    def guard(name, key, fn, *args, **kwargs):
        if not _in_recompute():
            return original(name, key, fn, *args, **kwargs)
        if name != "all_reduce":
            args[0].zero_()
        return None

    faults.guard = guard
    return lambda: setattr(faults, "guard", original)


def _sabotage_dispatch(kind: str) -> callable:
    """All-to-all expert dispatch with a wrong permutation: "unpermute" puts each returned row at the next
    assignment's place; "regroup" hands received rows to the local experts in reversed order."""
    from autopar.runtime import expert_dispatch

    name = "unpermute" if kind == "unpermute" else "_regroup"
    original = getattr(expert_dispatch, name)
    if kind == "unpermute":
        def wrong(rows, order, *args):
            return original(rows, order.roll(1), *args)
    else:
        def wrong(received_counts):
            by_expert, _ = original(received_counts)
            flipped = by_expert.flip(0)
            restore = torch.empty_like(flipped)
            restore[flipped] = torch.arange(flipped.numel())
            return flipped, restore
    setattr(expert_dispatch, name, wrong)
    return lambda: setattr(expert_dispatch, name, original)


def sabotage(kind) -> callable:
    """Install the negative control ``kind`` names (see ``tests/parity_launch.run_cases``); returns its undo."""
    from autopar.runtime import pipeline

    if kind == "replay":
        return _skip_collectives_in_replay()
    if kind == "inductor":  # every graph inductor is given fails to compile: the modules must fall back to eager
        from autopar.runtime import compiled

        def failing(*_):
            raise RuntimeError("inductor made to fail by the test")
        original = compiled.inductor
        compiled.inductor = failing
        return lambda: setattr(compiled, "inductor", original)

    if kind in (True, "all_reduce"):
        original = collectives._all_reduce
        collectives._all_reduce = lambda x, key: x.contiguous().clone()
        return lambda: setattr(collectives, "_all_reduce", original)
    if kind in ("unpermute", "regroup"):
        return _sabotage_dispatch(kind)
    if kind == "offsets":  # each piece read and written at the start of the local shards, not where it lies
        from autopar.runtime import transfer

        original = transfer.relative
        transfer.relative = lambda region, within: tuple(slice(0, r.stop - r.start) for r in region)
        return lambda: setattr(transfer, "relative", original)
    if kind == "accumulate":  # each microbatch's backward overwrites the gradients instead of adding to them
        original = pipeline.PipelineRunner._backward

        def overwrite(self, *args):
            for p in self.gm.parameters():
                if p.grad is not None:
                    p.grad.zero_()
            return original(self, *args)
        pipeline.PipelineRunner._backward = overwrite
        return lambda: setattr(pipeline.PipelineRunner, "_backward", original)
    if kind == "cp_swap":  # the zig-zag swap keeps its own half: each rank attends with its mirror's offsets
        from autopar.runtime import context_parallel

        original = context_parallel._exchange
        context_parallel._exchange = lambda x, peer, group: x.clone()
        return lambda: setattr(context_parallel, "_exchange", original)
    if kind == "kv_grad":  # the reduce-scatter of gathered values' gradients keeps the local part unsummed
        original = collectives._reduce_scatter
        collectives._reduce_scatter = lambda x, dim, key: collectives._chunk(x, dim, key).contiguous()
        return lambda: setattr(collectives, "_reduce_scatter", original)
    if kind == "host_step":  # the host copies are stepped but never copied back into the parameters
        from autopar.runtime import offload

        original = offload.HostCopies.push_params
        offload.HostCopies.push_params = lambda self: None
        return lambda: setattr(offload.HostCopies, "push_params", original)
    if kind == "host_acts":  # activations come back from host memory as zeros
        from autopar.runtime import spmd

        original = spmd.saved_on_host
        spmd.saved_on_host = lambda active, device_type: torch.autograd.graph.saved_tensors_hooks(
            lambda t: t.to("cpu", copy=True), torch.zeros_like) if active else original(active, device_type)
        return lambda: setattr(spmd, "saved_on_host", original)
    if kind == "transfer":
        original = pipeline.send_backward
        pipeline.send_backward = lambda grad, *a: original(None if grad is None else torch.zeros_like(grad), *a)
        return lambda: setattr(pipeline, "send_backward", original)
    return lambda: None
