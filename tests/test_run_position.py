"""A checkpoint carries the run's position: ``pm.save(position=...)`` and the fp16 loss scaler come back.

One rank in this process (gloo over a HashStore), the MLP example under fp16 (dynamic loss scaling): the
scaler's scale and growth count are changed, saved with a position (a ``GlobalSampler`` state), and a
module compiled afresh (its scaler at the initial scale) loads both back. Negative control: the fresh
module's scaler differs before the load. A position that is not JSON is a CheckpointError.
"""
import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.data import GlobalSampler
from autopar.errors import CheckpointError
from tests.models import make_mlp


@pytest.fixture(scope="module")
def group():
    assert not dist.is_initialized(), "another test left a process group behind"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def compiled():
    model, batch = make_mlp()
    pm = autopar.compile(model, autopar.Cluster.local(1), batch, precision="fp16")
    return pm, pm.optimizer(torch.optim.AdamW, lr=1e-3), batch


def test_the_position_and_the_loss_scaler_come_back(group, tmp_path):
    pm, opt, batch = compiled()
    pm.train_step(*batch)
    opt.step()
    sampler = GlobalSampler(64, 8, seed=5)
    for _ in range(3):
        sampler.next_ids()
    pm.runner.scaler.scale, pm.runner.scaler.clean_steps = 1024.0, 17
    pm.save(tmp_path / "ckpt", opt, step=1, position={"sampler": sampler.state_dict()})
    fresh, fresh_opt, _ = compiled()
    assert fresh.runner.scaler.scale != 1024.0, "negative control: a fresh module starts at the initial scale"
    manifest = fresh.load(tmp_path / "ckpt", fresh_opt)
    assert (fresh.runner.scaler.scale, fresh.runner.scaler.clean_steps) == (1024.0, 17)
    resumed = GlobalSampler(64, 8, seed=5)
    resumed.load_state_dict(manifest["position"]["sampler"])
    assert torch.equal(resumed.next_global(), sampler.next_global())


def test_a_position_that_is_not_json_is_refused(group, tmp_path):
    pm, opt, _ = compiled()
    with pytest.raises(CheckpointError, match="must be JSON"):
        pm.save(tmp_path / "bad", opt, position={"sampler": torch.zeros(2)})
    assert not (tmp_path / "bad").exists()
