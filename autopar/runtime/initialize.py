"""Weights of a meta-device model from its own initialization, one module's tensors at a time.

Invariant: the value of every parameter and buffer depends only on (``init_seed``, the fully qualified
name of the module that owns it, that module's init code): never on the plan, the mesh or the world size.
So every rank of every plan, and ``autopar.init_weights`` on one device, compute the same full tensors.

For the module ``m`` owning a tensor, a shallow copy of ``m`` whose direct parameters and buffers are fresh
CPU tensors (children stay as they are: on meta, their init is a no-op) runs, under torch's global RNG
seeded by ``seed_of(init_seed, module name)``:
  1. ``m.reset_parameters()`` (torch's convention: what the constructor ran), then
  2. ``owner._init_weights(m)`` of the deepest module on the path from the root to ``m`` (itself included)
     that has one: a Hugging Face ``PreTrainedModel`` (its ``init_weights`` path applies exactly this to
     every module; in transformers ≥ 5 it also recomputes rotary ``inv_freq`` buffers), or a model that
     follows the same convention (examples/gpt.py).
A tensor neither step wrote (floating tensors start as NaN, integer ones at their minimum; a bool buffer
is never trusted) comes from a CPU construction of ``m`` alone: ``type(m)(**arguments)``, each argument of
its ``__init__`` read from the attribute of that name (``config``, ``dim``...) or left at its default;
that is how constructor-computed buffers (position ids, causal masks, a norm's ones) get the model's own
values. A tensor none of these produce is an ``InitError`` naming it and the way out (``weights=``).
Tied tensors (one Parameter under several names) take the value of their first name's owner.

Host memory: each module's full tensors are dropped before the next module's are made, and the freed heap
is handed back to the OS then (``release_freed_heap``). Without that, glibc's malloc serves tensors below
its mmap threshold (which it raises to 32 MiB after large frees) from heap arenas that the init's
interleaved temporaries (sentinels, NaN checks) fragment: a 1B Llama's rank held 0.1-0.3 GiB more after
init than after loading the same weights from files, varying by rank. Trimming at each module brings the
two to the same bytes (benchmarks/memory/meta_rss.py) and costs nothing once the model is built.
"""
from __future__ import annotations

import copy
import ctypes
import ctypes.util
import functools
import hashlib
import inspect

import torch

from autopar.errors import AutoparError


class InitError(AutoparError):
    """A tensor of a meta-device model that no init path of its module produces."""


def seed_of(init_seed: int, name: str) -> int:
    """A 63-bit seed from (init_seed, a module's fully qualified name)."""
    digest = hashlib.blake2b(f"{int(init_seed)}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def owners(model: torch.nn.Module) -> dict[str, tuple[str, str]]:
    """fqn -> (owning module's name, local name) for every parameter and buffer, tied names mapped to
    the first name of the same tensor (named_parameters' order)."""
    first: dict[int, tuple[str, str]] = {}
    out = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for table in (mod._parameters, mod._buffers):
            for local, t in table.items():
                if t is None:
                    continue
                fqn = f"{mod_name}.{local}" if mod_name else local
                out[fqn] = first.setdefault(id(t), (mod_name, local))
    return out


class ModuleInit:
    """Computes full tensors of ``model`` by owner module; keeps the last module's tensors (its weight and
    bias are read one after the other) and nothing else."""

    def __init__(self, model: torch.nn.Module, init_seed: int = 0):
        self.model, self.init_seed = model, init_seed
        self.owner = owners(model)
        self.modules = dict(model.named_modules(remove_duplicate=False))
        self._cached: tuple[str, dict[str, torch.Tensor]] | None = None

    def full(self, fqn: str) -> torch.Tensor:
        """The full CPU tensor of parameter/buffer ``fqn``."""
        mod_name, local = self.owner[fqn]
        if self._cached is None or self._cached[0] != mod_name:
            if self._cached is not None:
                self._cached = None  # drop the previous module's tensors before making the next ones
                release_freed_heap()
            self._cached = (mod_name, self.module_tensors(mod_name))
        return self._cached[1][local]

    def module_tensors(self, mod_name: str) -> dict[str, torch.Tensor]:
        module = self.modules[mod_name]
        shell = copy.copy(module)
        shell._parameters = {k: None if v is None else torch.nn.Parameter(_sentinel(v), v.requires_grad)
                             for k, v in module._parameters.items()}
        shell._buffers = {k: None if v is None else _sentinel(v) for k, v in module._buffers.items()}
        seed = seed_of(self.init_seed, mod_name)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            if callable(getattr(shell, "reset_parameters", None)):
                shell.reset_parameters()
            initializer = self._initializer_of(mod_name)
            if initializer is not None:
                initializer(shell)
        out = {k: v.detach() for k, v in {**shell._parameters, **shell._buffers}.items() if v is not None}
        unwritten = [k for k, v in out.items() if _unwritten(v)]
        if unwritten:
            out.update(self._constructed(mod_name, module, unwritten, seed))
        return out

    def _initializer_of(self, mod_name: str):
        """``_init_weights`` of the deepest module on the path root -> ``mod_name`` that has one."""
        parts = mod_name.split(".") if mod_name else []
        for depth in range(len(parts), -1, -1):
            holder = self.modules.get(".".join(parts[:depth]))
            fn = getattr(holder, "_init_weights", None) if holder is not None else None
            if callable(fn):
                return fn
        return None

    def _constructed(self, mod_name: str, module, names: list[str], seed: int) -> dict[str, torch.Tensor]:
        """``names`` from a CPU construction of the module alone (see the module docstring)."""
        where = [f"{mod_name}.{n}" if mod_name else n for n in names]
        kwargs = _constructor_arguments(module)
        if kwargs is None:
            raise InitError(f"cannot initialize {where} of the meta-device model: {type(module).__name__} has no "
                            f"reset_parameters() or _init_weights() that sets them, and its constructor's arguments "
                            f"cannot be read back from its attributes; pass weights=PATH, or give the module a "
                            f"reset_parameters() that fills them")
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(seed)
            built = type(module)(**kwargs)
        out = {}
        for name, fqn in zip(names, where):
            t = built._parameters.get(name) if name in built._parameters else built._buffers.get(name)
            want = module._parameters.get(name) if name in module._parameters else module._buffers.get(name)
            if t is None or tuple(t.shape) != tuple(want.shape):
                raise InitError(f"cannot initialize {fqn} of the meta-device model: neither its module's init nor a "
                                f"CPU construction of {type(module).__name__} produces it; pass weights=PATH")
            out[name] = t.detach().to(want.dtype)
        return out


def release_freed_heap() -> None:
    """Give the heap malloc holds free back to the OS (glibc's ``malloc_trim``; a no-op elsewhere). Why not
    ``mallopt(M_MMAP_THRESHOLD)``: that would change the allocator of the whole process for good, training
    steps included (every larger tensor an mmap and fresh page faults); trimming touches init only."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "malloc_trim", None)
    except OSError:
        return None


def _sentinel(like: torch.Tensor) -> torch.Tensor:
    t = torch.empty(like.shape, dtype=like.dtype, device="cpu")
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(False)
    return t.fill_(torch.iinfo(t.dtype).min)


def _unwritten(t: torch.Tensor) -> bool:
    if t.numel() == 0:
        return False
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool:
        return True
    return bool((t == torch.iinfo(t.dtype).min).all())


def _constructor_arguments(module) -> dict | None:
    try:
        params = list(inspect.signature(type(module).__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    kwargs = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        value = getattr(module, p.name, inspect.Parameter.empty) if p.name != "device" else "cpu"
        if isinstance(value, (torch.Tensor, torch.nn.Module)):
            value = inspect.Parameter.empty
        if value is inspect.Parameter.empty:
            if p.default is inspect.Parameter.empty:
                return None
            continue
        kwargs[p.name] = value
    return kwargs


def init_weights(model: torch.nn.Module, init_seed: int = 0, device="cpu") -> torch.nn.Module:
    """Materialize every parameter and buffer of ``model`` (on the meta device or not) in place, on
    ``device``, with the weights ``autopar.compile`` gives a meta-device model for the same ``init_seed``,
    whatever the plan; tied parameters stay tied. Returns ``model``."""
    init = ModuleInit(model, init_seed)
    made: dict[tuple[str, str], torch.Tensor] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for local, t in list(table.items()):
                if t is None:
                    continue
                fqn = f"{mod_name}.{local}" if mod_name else local
                key = init.owner[fqn]
                if key not in made:
                    value = init.full(fqn).to(device)
                    made[key] = torch.nn.Parameter(value, t.requires_grad) if is_param else value
                table[local] = made[key]
    return model
