"""Every tensor the runtime creates names its device (``autopar.runtime.devices``).

A factory call without ``device=`` makes a CPU tensor: on a GPU rank that is a parameter the forward cannot
use beside CUDA inputs, or a collective NCCL refuses ("No backend type associated with device type cpu").
Both reached a lent H200 through code that passed every CPU test, so the rule is checked on the source: a
factory of ``torch`` in the runtime passes ``device=`` (``device="cpu"`` where a host tensor is meant).
``*_like`` and ``Tensor.new_*`` follow their source tensor and are not checked.

Lent GPUs run an older torch (2.11) than the suite (2.13): names only the newer one has
(``all_gather_single``, ``reduce_scatter_single``) are reached through ``runtime.flat_collectives`` alone.
"""
from __future__ import annotations

import ast
import os

import pytest
import torch

from autopar.runtime import devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKED = ("autopar/runtime", "autopar/moe", "autopar/ir")
NEWER_TORCH_ONLY = {"all_gather_single", "reduce_scatter_single"}
FACTORIES = {"empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "randint", "rand", "randn",
             "randperm", "empty_strided", "linspace", "eye"}


def factory_calls_without_device(source: str) -> list[tuple[int, str]]:
    """(line, name) of each ``torch.<factory>(...)`` call in ``source`` that passes no ``device=``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        f = node.func
        if isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in FACTORIES:
            if not any(k.arg == "device" or k.arg is None for k in node.keywords):
                found.append((node.lineno, f.attr))
    return found


def newer_torch_names(source: str) -> list[tuple[int, str]]:
    """(line, name) of each attribute of ``NEWER_TORCH_ONLY`` read in ``source``."""
    return [(node.lineno, node.attr) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in NEWER_TORCH_ONLY]


def _runtime_sources(folders=CHECKED):
    for folder in folders:
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(os.path.join(ROOT, path)) as f:
                    yield path, f.read()


def test_every_runtime_tensor_factory_names_its_device():
    missing = [f"{path}:{line} torch.{name}" for path, source in _runtime_sources()
               for line, name in factory_calls_without_device(source)]
    assert not missing, ("tensor factories without device= (a CPU tensor on a GPU rank): " + ", ".join(missing))


def test_the_check_finds_a_factory_without_device():  # negative control
    source = ("import torch\n"
              "a = torch.zeros(3, device=x.device)\n"
              "b = torch.empty(2, dtype=torch.float32)\n"
              "c = torch.tensor([1], **where)\n"
              "d = torch.zeros_like(a)\n")
    assert factory_calls_without_device(source) == [(3, "empty")]


def test_devices_follow_the_plan_and_the_backend():
    assert devices.rank_device("cpu") == torch.device("cpu")
    assert devices.wire_device("gloo") == torch.device("cpu")
    assert devices.wire_device("cpu:gloo,cuda:nccl") == torch.device("cpu")  # gloo takes the CPU tensors
    if not torch.cuda.is_available():
        assert devices.rank_device("cuda") == torch.device("cpu")  # nothing to place on: the CPU runs it
    else:
        assert devices.rank_device("cuda").type == "cuda"
        assert devices.wire_device("nccl").type == "cuda"


@pytest.mark.parametrize("env,rank,expected", [({"LOCAL_RANK": "3"}, 11, 3), ({}, 2, 2)])
def test_local_gpu_index_reads_the_local_rank(monkeypatch, env, rank, expected):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert devices.local_gpu_index(rank) == expected


def test_collectives_only_newer_torch_has_go_through_one_alias():
    found = [f"{path}:{line} {name}" for path, source in _runtime_sources(CHECKED + ("autopar/profiling",))
             if not path.endswith("flat_collectives.py") for line, name in newer_torch_names(source)]
    assert not found, "use runtime.flat_collectives (torch 2.11 lacks these): " + ", ".join(found)


def test_the_newer_torch_check_finds_a_direct_call():  # negative control
    source = "import torch.distributed as dist\ndist.all_gather_single(out, x)\ndist.all_to_all_single(o, x)\n"
    assert newer_torch_names(source) == [(2, "all_gather_single")]


def test_to_wire_is_a_no_op_where_the_tensor_already_is():
    t = torch.ones(3)
    assert devices.to_wire(t, backend="gloo") is t
    copied = devices.to_wire(t, copy=True, backend="gloo")
    assert copied is not t and torch.equal(copied, t)
