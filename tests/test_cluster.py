"""Cluster descriptions: presets with their numbers, the local cluster, JSON round-trips, clear errors."""
import json

import pytest

from autopar import Cluster
from autopar.cost_models.communication import axis_links
from autopar.errors import ClusterError


@pytest.mark.parametrize("name,capacity_mib", [("p3.16xlarge", 16160), ("dgx-a100", 81920), ("dgx-h100", 81559),
                                               ("a100-40gb", 40960), ("l4", 23034)])
def test_presets(name, capacity_mib):
    c = Cluster.preset(name, nodes=4)
    assert c.num_devices == 32 and c.mesh_shape == (4, 8)
    assert c.memory_capacity == capacity_mib * 2**20
    # usable = (capacity - 1 GiB context and NCCL buffers) × (1 - 5 % allocator reserve): the planner's budget
    assert c.memory_per_device == pytest.approx((capacity_mib * 2**20 - 2**30) * 0.95)
    assert c.inter_node.bandwidth / c.devices_per_node < c.intra_node.bandwidth  # per device: one NIC each
    assert c.source, "every preset cites its source"
    assert Cluster.from_json(c.to_json()) == c


def test_p3_inter_node_link_is_25_gbps():
    c = Cluster.preset("p3.16xlarge", nodes=2)
    assert c.inter_node.bandwidth == pytest.approx(25e9 / 8)
    intra, inter = axis_links(c, (2, 8))[::-1]
    assert intra.link is c.intra_node and inter.link is c.inter_node
    assert inter.bandwidth == pytest.approx(25e9 / 8 / 8), "8 groups share one NIC"


def test_preset_by_gpu_count():
    """gpus= instead of nodes=: part of one node (same links, a node of that many devices) or whole nodes."""
    part, whole = Cluster.preset("dgx-a100", gpus=2), Cluster.preset("dgx-a100", gpus=16)
    assert (part.nodes, part.devices_per_node, part.mesh_shape) == (1, 2, (1, 2))
    assert part.intra_node == Cluster.preset("dgx-a100").intra_node
    assert whole == Cluster.preset("dgx-a100", nodes=2)
    assert Cluster.preset("dgx-a100", gpus=4, mesh_shape=(2, 2)).mesh_shape == (2, 2)


@pytest.mark.parametrize("kwargs,message", [
    (dict(nodes=2, gpus=16), "give nodes=2 or gpus=16, not both"),
    (dict(gpus=12), "neither part of one 8-GPU node nor whole nodes"),
    (dict(gpus=0), "neither part of one 8-GPU node nor whole nodes"),
])
def test_preset_gpu_count_mistakes_are_one_clear_error(kwargs, message):
    with pytest.raises(ClusterError, match=message):
        Cluster.preset("dgx-a100", **kwargs)


def test_local_cluster():
    c = Cluster.local(4)
    assert c.mesh_shape == (1, 4) and c.backend == "gloo" and c.device_type == "cpu"
    assert Cluster.local(4, mesh_shape=(2, 2), memory_per_device=1e6).memory_per_device == 1e6


def test_json_file_round_trip(tmp_path):
    c = Cluster.local(2, mesh_shape=(2, 1))
    path = tmp_path / "cluster.json"
    c.to_json(path)
    assert Cluster.from_json(path) == c


@pytest.mark.parametrize("call,match", [
    (lambda: Cluster.preset("tpu-v5"), "known presets"),
    (lambda: Cluster.preset("dgx-a100", nodes=0), "positive integer"),
    (lambda: Cluster.local(0), "positive integer"),
    (lambda: Cluster.local(4, mesh_shape=(3, 2)), "does not tile"),
    (lambda: Cluster.from_json("/nonexistent/cluster.json"), "does not exist"),
    (lambda: Cluster.from_json("{not json"), "malformed"),
])
def test_bad_cluster_descriptions(call, match):
    with pytest.raises(ClusterError, match=match):
        call()


def test_missing_and_negative_fields():
    d = json.loads(Cluster.local(2).to_json())
    del d["memory_per_device"]
    with pytest.raises(ClusterError, match="missing \\['memory_per_device'\\]"):
        Cluster.from_json(json.dumps(d))
    d = json.loads(Cluster.local(2).to_json())
    d["intra_node"]["bandwidth"] = -1
    with pytest.raises(ClusterError, match="intra_node.bandwidth must be a finite number > 0"):
        Cluster.from_json(json.dumps(d))


def test_microbatch_overhead_defaults_to_zero_round_trips_and_must_be_non_negative():
    d = json.loads(Cluster.local(2).to_json())
    del d["microbatch_overhead"]  # a cluster file written before the field existed
    assert Cluster.from_json(json.dumps(d)).microbatch_overhead == 0.0
    d["microbatch_overhead"] = 2.5e-4
    assert Cluster.from_dict(Cluster.from_dict(d).to_dict()).microbatch_overhead == 2.5e-4
    for bad in (-1e-6, float("nan"), "1ms"):
        d["microbatch_overhead"] = bad
        with pytest.raises(ClusterError, match="microbatch_overhead must be a finite number >= 0"):
            Cluster.from_dict(d)
