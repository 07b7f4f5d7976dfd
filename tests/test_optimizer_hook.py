"""autopar hooks torch's optimizers only once a ParallelModule exists, never at import, and the hook it
then adds warns about the common mistake (an optimizer over the original model's parameters)."""
import subprocess
import sys
import warnings

import torch

from autopar.runtime import optimizer_hooks


def test_importing_autopar_leaves_torch_optimizers_untouched():
    code = ("import torch, torch.optim.optimizer as o; before = dict(o._global_optimizer_pre_hooks); "
            "import autopar, autopar.runtime.module, autopar.runtime.build, autopar.api; "
            "assert dict(o._global_optimizer_pre_hooks) == before, o._global_optimizer_pre_hooks")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


def _step(optimizer) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    return [str(w.message) for w in caught if "has a gradient" in str(w.message)]


def test_the_hook_warns_once_about_an_optimizer_whose_parameters_have_no_gradient():
    had_hook = bool(optimizer_hooks._HOOK)
    optimizer_hooks.watch_optimizers()
    optimizer_hooks.watch_optimizers()  # idempotent: one hook per process
    assert len(optimizer_hooks._HOOK) == 2  # the step pre-hook and post-hook
    try:
        stale = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        assert len(_step(stale)) == 1, "the first step over parameters without gradients warns"
        assert not _step(stale), "only the first step is checked"
        live = torch.nn.Parameter(torch.ones(2))
        live.grad = torch.ones(2)
        assert not _step(torch.optim.SGD([live], lr=0.1)), "negative control: a parameter with a gradient"
        assert not hasattr(stale, "_autopar_checked"), "nothing is set on the user's optimizer"
    finally:
        while not had_hook and optimizer_hooks._HOOK:
            optimizer_hooks._HOOK.pop().remove()
