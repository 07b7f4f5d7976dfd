"""The optimizer step on CPU ranks as the profile measures it (``profiling.profiler_optimizer``): host time per
ATen call of the step and the rate of its element passes, priced by ``cost_models.compute.optimizer_step_time``,
with the fallback (op_overhead, memory_bandwidth) for clusters that did not measure them."""
import dataclasses
import statistics
import time

import pytest
import torch

from autopar.cost_models.compute import OPTIMIZER_TRAFFIC, optimizer_step_time
from autopar.cost_models.offload import optimizer_offload_effect
from autopar.cost_models.optimizer_calls import optimizer_calls_per_tensor
from autopar.errors import ClusterError
from autopar.hardware.cluster import Cluster
from autopar.profiling.probe_step import TinyBlock, tiny_block_nodes
from autopar.profiling.profiler_optimizer import (
    LARGE_NUMEL,
    LARGE_TENSORS,
    TINY_TENSORS,
    _adamw_step,
    measure_optimizer,
    optimizer_figures,
    optimizer_note,
)


def _cpu(**fields) -> Cluster:
    return dataclasses.replace(Cluster.local(1), op_overhead=12e-6, memory_bandwidth=20e9, **fields)


def _probe_seconds(cluster: Cluster) -> list[float]:
    """What the two probes take if the machine is exactly ``cluster``'s optimizer model."""
    calls = optimizer_calls_per_tensor("adamw")
    per_call = cluster.optimizer_call_overhead
    traffic = LARGE_TENSORS * LARGE_NUMEL * 4 * OPTIMIZER_TRAFFIC["adamw"] / cluster.optimizer_bandwidth
    return [TINY_TENSORS * calls * per_call, LARGE_TENSORS * calls * per_call + traffic]


def test_figures_from_the_probes_price_the_probes_back():
    truth = _cpu(optimizer_call_overhead=3e-6, optimizer_bandwidth=6e9)
    per_call, bandwidth = optimizer_figures([{"optimizer": _probe_seconds(truth)}] * 2)
    assert per_call == pytest.approx(3e-6) and bandwidth == pytest.approx(6e9)
    # and optimizer_step_time, on the recovered cluster, prices the large probe (less zero_grad's call) as timed
    recovered = _cpu(optimizer_call_overhead=per_call, optimizer_bandwidth=bandwidth)
    zero_grad = LARGE_TENSORS * per_call
    priced = optimizer_step_time(LARGE_TENSORS * LARGE_NUMEL, LARGE_TENSORS, 4, "adamw", recovered) - zero_grad
    assert priced == pytest.approx(_probe_seconds(truth)[1])
    # negative control: the fallback (op_overhead, memory_bandwidth) does not
    fallback = optimizer_step_time(LARGE_TENSORS * LARGE_NUMEL, LARGE_TENSORS, 4, "adamw", _cpu()) - zero_grad
    assert abs(fallback - _probe_seconds(truth)[1]) > 0.3 * _probe_seconds(truth)[1]


def test_figures_are_medians_over_ranks_and_zero_when_unmeasured():
    truth = _cpu(optimizer_call_overhead=3e-6, optimizer_bandwidth=6e9)
    slow = [2 * s for s in _probe_seconds(truth)]
    per_call, _ = optimizer_figures([{"optimizer": _probe_seconds(truth)}] * 2 + [{"optimizer": slow}])
    assert per_call == pytest.approx(3e-6)
    assert optimizer_figures([{"optimizer": None}, {}]) == (0.0, 0.0)  # GPU ranks: not measured
    tiny = _probe_seconds(truth)[0]
    tiny_only = [tiny, 0.5 * tiny * LARGE_TENSORS / TINY_TENSORS]  # less than its host part: no passes left
    assert optimizer_figures([{"optimizer": tiny_only}]) == (pytest.approx(3e-6), 0.0)
    assert optimizer_note(0.0, 0.0) == "" and "3.0 µs" in optimizer_note(3e-6, 6e9)


def test_step_uses_the_measured_figures_on_cpus_and_falls_back_without_them():
    measured = _cpu(optimizer_call_overhead=3e-6, optimizer_bandwidth=5e9)
    calls = optimizer_calls_per_tensor("adamw") + 1  # zero_grad's per-tensor call
    assert optimizer_step_time(1000, 10, 4, "adamw", measured) == pytest.approx(1000 * 4 * 7 / 5e9 + 10 * calls * 3e-6)
    assert optimizer_step_time(1000, 10, 4, "adamw", _cpu()) == pytest.approx(1000 * 4 * 7 / 20e9 + 10 * calls * 12e-6)
    gpu = dataclasses.replace(measured, device_type="cuda", backend="nccl")
    assert optimizer_step_time(1000, 10, 4, "adamw", gpu) == pytest.approx(1000 * 4 * 7 / 5e9)  # host hidden


def test_offload_on_cpu_ranks_saves_no_step_time_at_any_measured_rate():
    """One memory: the host's passes run at the device step's rate, so offloading adds the two copies only
    (it once priced the host's passes at the streaming rate and the device's at the measured one, and
    every stage offloaded)."""
    for cluster in (_cpu(), _cpu(optimizer_bandwidth=5e9), _cpu(optimizer_bandwidth=80e9)):
        freed, added = optimizer_offload_effect(1e6, torch.float32, "adamw", cluster)
        assert freed > 0 and added == pytest.approx(2 * 1e6 * 4 / cluster.memory_bandwidth)


def test_fields_are_validated_and_absent_from_files_when_unmeasured():
    for field in ("optimizer_call_overhead", "optimizer_bandwidth"):
        with pytest.raises(ClusterError, match=field):
            _cpu(**{field: -1.0})
        with pytest.raises(ClusterError, match=field):
            _cpu(**{field: float("nan")})
    plain = _cpu()
    assert "optimizer_call_overhead" not in plain.to_dict() and "optimizer_bandwidth" not in plain.to_dict()
    measured = _cpu(optimizer_call_overhead=3e-6, optimizer_bandwidth=5e9)
    again = Cluster.from_json(measured.to_json())
    assert (again.optimizer_call_overhead, again.optimizer_bandwidth) == (3e-6, 5e9)
    assert Cluster.from_json(plain.to_json()) == plain


def test_gpu_ranks_do_not_run_the_probes():
    assert measure_optimizer(lambda call, term=None: pytest.fail("timed on a GPU rank"), "cuda") is None


def test_an_optimizer_call_costs_less_host_time_than_a_graph_op_here():
    """The measured property behind the fields (one process, this machine): AdamW's per-tensor calls run
    in place outside autograd, cheaper than a graph op's pass, which op_overhead prices."""
    torch.set_num_threads(1)

    def seconds(call, repeats: int) -> float:
        call()
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(repeats):
                call()
            samples.append((time.perf_counter() - start) / repeats)
        return statistics.median(samples)

    tiny, _ = measure_optimizer(lambda call, term=None: seconds(call, 20) if term == "optimizer calls" else 1.0, "cpu")
    per_call = tiny / (TINY_TENSORS * optimizer_calls_per_tensor("adamw"))
    block, x = TinyBlock(), torch.randn(4, 8)
    per_node_pass = seconds(lambda: block(x).backward(), 50) / (2 * tiny_block_nodes())
    assert per_call < 0.8 * per_node_pass


def test_the_large_probe_steps_its_tensors():
    step = _adamw_step(2, 8)
    params = step.__self__.param_groups[0]["params"]
    before = [p.detach().clone() for p in params]
    step()
    assert all(not torch.equal(b, p) for b, p in zip(before, params))
