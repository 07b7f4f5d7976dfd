"""``pm.save`` and ``pm.export`` never delete, overwrite or move a file that is not autopar's own.

One rank in this process (gloo over a HashStore). Each case puts the user's files where a save or an
export is pointed, expects one CheckpointError naming them and the fix, and then checks that every one
of those files is still there, byte for byte. Negative controls: saving over an earlier autopar
checkpoint and exporting over an earlier export still work (and a leftover of a crashed save is still
cleaned up), so the refusals are not a blanket "path exists".
"""
import os

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.errors import CheckpointError
from autopar.runtime.checkpoint import export_state_dict
from tests.models import make_mlp


@pytest.fixture(scope="module")
def pm():
    assert not dist.is_initialized(), "another test left a process group behind"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model, batch = make_mlp()
    yield autopar.compile(model, autopar.Cluster.local(1), batch)
    dist.destroy_process_group()


def snapshot(root) -> dict:
    """{relative path: bytes} of every file under ``root`` (directories as None)."""
    out = {}
    for folder, dirs, names in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(folder, d), root)] = None
        for n in names:
            with open(os.path.join(folder, n), "rb") as f:
                out[os.path.relpath(os.path.join(folder, n), root)] = f.read()
    return out


def user_project(root):
    (root / "train.py").write_text("print('my training script')\n")
    (root / "data").mkdir()
    (root / "data" / "tokens.bin").write_bytes(b"\x00\x01" * 100)
    return snapshot(root)


def test_saving_to_the_working_directory_is_refused_and_touches_nothing(pm, tmp_path, monkeypatch):
    before = user_project(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="current working directory.*pm.save\\('checkpoint'\\)"):
        pm.save(".")
    with pytest.raises(CheckpointError, match="holding the working directory"):
        pm.save("..")
    assert snapshot(tmp_path) == before


def test_saving_into_a_directory_of_user_files_names_them_and_deletes_none(pm, tmp_path):
    before = user_project(tmp_path)
    with pytest.raises(CheckpointError) as err:
        pm.save(tmp_path)
    message = str(err.value)
    assert "'data/'" in message and "'train.py'" in message and "new or empty directory" in message, message
    assert "\n" not in message
    assert snapshot(tmp_path) == before


def test_a_file_at_the_checkpoint_path_is_not_renamed_aside(pm, tmp_path):
    (tmp_path / "ckpt").write_text("my notes")
    with pytest.raises(CheckpointError, match="a file of that name exists"):
        pm.save(tmp_path / "ckpt")
    assert snapshot(tmp_path) == {"ckpt": b"my notes"}


def test_a_user_file_added_to_a_checkpoint_directory_stops_the_next_save(pm, tmp_path):
    path = tmp_path / "ckpt"
    pm.save(path, step=1)
    (path / "notes.txt").write_text("loss went down")
    with pytest.raises(CheckpointError, match="'notes.txt'"):
        pm.save(path, step=2)
    assert (path / "notes.txt").read_text() == "loss went down" and pm.load(path)["step"] == 1


def test_another_tools_dcp_directory_is_not_replaced(pm, tmp_path):
    path = tmp_path / "ckpt"
    pm.save(path)
    (path / "manifest.json").unlink()  # now a bare DCP checkpoint, as torchtitan writes
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError, match="no readable autopar manifest.json"):
        pm.save(path)
    assert snapshot(tmp_path) == before


def test_user_directories_named_like_a_save_leftover_survive(pm, tmp_path):
    """Only ``<name>.tmp-<12 hex>`` / ``.old-`` directories holding nothing but checkpoint files are removed."""
    (tmp_path / "ckpt.tmp-mine").mkdir()
    (tmp_path / "ckpt.tmp-mine" / "keep.txt").write_text("1")
    (tmp_path / "ckpt.old-0123456789ab").mkdir()
    (tmp_path / "ckpt.old-0123456789ab" / "keep.txt").write_text("2")
    crashed = tmp_path / "ckpt.tmp-abcdefabcdef"  # a real leftover of a crashed save: removed
    crashed.mkdir()
    (crashed / "__0_0.distcp").write_bytes(b"half")
    pm.save(tmp_path / "ckpt", step=3)
    pm.save(tmp_path / "ckpt", step=4)  # negative control: an autopar checkpoint is replaced
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt.old-0123456789ab", "ckpt.tmp-mine"]
    assert (tmp_path / "ckpt.tmp-mine" / "keep.txt").read_text() == "1"
    assert (tmp_path / "ckpt.old-0123456789ab" / "keep.txt").read_text() == "2"
    assert pm.load(tmp_path / "ckpt")["step"] == 4


def test_an_empty_directory_and_a_symlinked_checkpoint_are_written(pm, tmp_path):
    (tmp_path / "empty").mkdir()
    pm.save(tmp_path / "empty", step=5)
    assert pm.load(tmp_path / "empty")["step"] == 5
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    pm.save(tmp_path / "link", step=6)
    assert (tmp_path / "link").is_symlink() and pm.load(tmp_path / "empty")["step"] == 6


def test_export_refuses_user_files_directories_and_missing_parents(pm, tmp_path, monkeypatch):
    (tmp_path / "notes.pt").write_text("not a state dict")
    torch.save({"other": torch.zeros(1)}, tmp_path / "other.pt")
    before = snapshot(tmp_path)
    cases = {tmp_path / "notes.pt": "not a torch.save state dict", tmp_path / "other.pt": "another model",
             tmp_path: "is a directory", tmp_path / "missing" / "model.pt": "does not exist; create it"}
    for path, cause in cases.items():
        with pytest.raises(CheckpointError, match=cause) as err:
            pm.export(path)
        assert "\n" not in str(err.value)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="current working directory"):
        pm.export(".")
    assert snapshot(tmp_path) == before


def test_export_replaces_an_earlier_export_of_the_model(pm, tmp_path):
    target = tmp_path / "model.pt"
    pm.export(target)
    with torch.no_grad():
        for p in pm.parameters():
            p.add_(1.0)
    pm.export(target)  # negative control: an earlier export is replaced
    assert all(torch.equal(a, b) for a, b in zip(torch.load(target).values(), pm.full_state_dict().values()))
    assert sorted(os.listdir(tmp_path)) == ["model.pt"], "a temporary file was left"
    pm.save(tmp_path / "ckpt")
    assert list(export_state_dict(tmp_path / "ckpt")) == list(torch.load(target))


def test_plan_to_json_replaces_only_an_earlier_plan(pm, tmp_path):
    plan = pm.plan
    (tmp_path / "train.py").write_text("mine")
    with pytest.raises(autopar.errors.PlanError, match="exists and is not a plan file"):
        plan.to_json(tmp_path / "train.py")
    with pytest.raises(autopar.errors.PlanError, match="is a directory"):
        plan.to_json(tmp_path)
    with pytest.raises(autopar.errors.PlanError, match="does not exist; create it first"):
        plan.to_json(tmp_path / "missing" / "plan.json")
    assert (tmp_path / "train.py").read_text() == "mine"
    plan.to_json(tmp_path / "plan.json")
    plan.to_json(tmp_path / "plan.json")  # negative control: an earlier plan is replaced
    assert autopar.Plan.from_json(tmp_path / "plan.json").to_json() == plan.to_json()
    assert sorted(os.listdir(tmp_path)) == ["plan.json", "train.py"]
