"""Bad checkpoints and bad places to save one: each ends in one CheckpointError, and nothing is lost.

One rank in this process (gloo over a HashStore). Cases: a damaged file (one byte flipped), a truncated
file, a missing manifest, a crafted ``.metadata`` whose unpickling would run code (with a manifest that
matches it, so only the restricted unpickler stands in the way), an unwritable path, a full disk
(RLIMIT_FSIZE lowered in this process: writes past it fail with EFBIG, as on a full disk). After every
failed load the module's weights are unchanged; after every failed save the previous checkpoint loads.
"""
import hashlib
import json
import os
import pickle
import resource
import signal

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.errors import CheckpointError
from autopar.runtime.checkpoint_files import MANIFEST
from tests.models import make_mlp


@pytest.fixture(scope="module")
def pm():
    assert not dist.is_initialized(), "another test left a process group behind"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model, batch = make_mlp()
    yield autopar.compile(model, autopar.Cluster.local(1), batch)
    dist.destroy_process_group()


def weights(pm) -> dict:
    return {k: v.clone() for k, v in pm.full_state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def saved(pm, tmp_path):
    """A good checkpoint of ``pm`` at step 7, and the weights it holds."""
    path = tmp_path / "ckpt"
    pm.save(path, step=7)
    return path, weights(pm)


def perturb(pm) -> None:
    with torch.no_grad():
        for p in pm.parameters():
            p.add_(1.0)


def data_file(path):
    return next(p for p in path.iterdir() if p.suffix == ".distcp")


def test_a_good_checkpoint_round_trips_and_records_its_step(pm, saved):
    path, before = saved
    perturb(pm)
    assert not same(weights(pm), before), "negative control: perturbing changed nothing"
    assert pm.load(path)["step"] == 7
    assert same(weights(pm), before)
    manifest = json.loads((path / MANIFEST).read_text())
    assert set(manifest["files"]) == {p.name for p in path.iterdir()} - {MANIFEST}


@pytest.mark.parametrize("damage, cause", [
    ("flip", "does not match its SHA-256"), ("truncate", "truncated"), ("manifest", "has no manifest.json"),
    ("manifest-bytes", "manifest.json is unreadable"), ("delete", "is missing")])
def test_a_damaged_checkpoint_is_refused_before_the_model_is_touched(pm, saved, damage, cause):
    path, _ = saved
    target = data_file(path)
    if damage == "flip":
        raw = bytearray(target.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        target.write_bytes(bytes(raw))
    elif damage == "truncate":
        os.truncate(target, target.stat().st_size - 10)
    elif damage == "manifest":
        (path / MANIFEST).unlink()
    elif damage == "manifest-bytes":
        (path / MANIFEST).write_bytes(b"\x89PNG\x00\xff")
    else:
        target.unlink()
    perturb(pm)
    live = weights(pm)
    with pytest.raises(CheckpointError, match=cause) as err:
        pm.load(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    assert same(weights(pm), live), "a refused load changed the model"


class RunsCode:
    """Unpickling this calls os.system: what a crafted checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_crafted_metadata_that_would_run_code_is_refused(pm, saved, tmp_path):
    path, _ = saved
    marker = tmp_path / "code-ran"
    crafted = pickle.dumps(RunsCode(marker))
    (path / ".metadata").write_bytes(crafted)
    manifest = json.loads((path / MANIFEST).read_text())  # a matching manifest: only the unpickler stands guard
    manifest["files"][".metadata"] = {"bytes": len(crafted), "sha256": hashlib.sha256(crafted).hexdigest()}
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="refused to load posix.system"):
        pm.load(path)
    assert not marker.exists(), "the crafted metadata ran code"
    with pytest.raises(CheckpointError, match="refused"):
        autopar.runtime.checkpoint.export_state_dict(path)
    pickle.loads(crafted)  # negative control: a plain unpickler runs it
    assert marker.exists()


@pytest.mark.parametrize("where", ["/proc/autopar-ckpt", "file-as-parent/ckpt", "missing-parent/ckpt"])
def test_saving_where_nothing_can_be_written_says_so(pm, tmp_path, where):
    (tmp_path / "file-as-parent").write_text("")
    path = where if where.startswith("/") else tmp_path / where
    with pytest.raises(CheckpointError, match="preparing the save failed") as err:
        pm.save(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_full_disk_leaves_the_previous_checkpoint_loadable(pm, saved):
    path, before = saved
    perturb(pm)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))  # any file past 1 KiB: EFBIG, like ENOSPC
    try:
        with pytest.raises(CheckpointError, match="writing failed .*File too large") as err:
            pm.save(path, step=8)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert "untouched" in str(err.value) and "\n" not in str(err.value)
    assert pm.load(path)["step"] == 7 and same(weights(pm), before)
    pm.save(path, step=8)
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt"], "the failed save's staging files are left"
