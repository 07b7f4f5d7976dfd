"""A collective called on some ranks only is named as such, and a rank's return value that cannot leave
its process is refused by name; neither is blamed on a timeout or a dead rank.

Two launches: 2 ranks compile an MLP, then rank 0 alone calls ``pm.save`` while rank 1 returns (the
``if rank == 0: pm.save(...)`` mistake; 10 s timeout); 1 rank returns a module from its function.
"""
import pytest
import torch

import autopar
from autopar.errors import CommunicationError, UsageError
from tests.models import make_mlp


def save_on_rank_0_only(rank: int, path: str) -> int:
    model, batch = make_mlp()
    pm = autopar.compile(model, autopar.Cluster.local(2), batch)
    pm.train_step(*batch)
    if rank == 0:
        pm.save(path)
    return rank


@pytest.mark.distributed
@pytest.mark.slow  # two launches of their own (about a minute): opt-in, with the other slow checks
def test_a_save_called_on_one_rank_names_the_call_and_the_rank_that_skipped_it(tmp_path):
    with pytest.raises(CommunicationError) as err:
        autopar.launch(save_on_rank_0_only, 2, str(tmp_path / "ckpt"), timeout=10)
    message = str(err.value).split("\n")[0]
    assert "pm.save is a collective that every rank must call, but rank 0 called it alone" in message, message
    assert "rank 1 returned from its function (its last autopar call: pm.train_step)" in message, message
    assert "timeout" not in message and "died" not in message, message
    assert not (tmp_path / "ckpt").exists()


def returns_a_module(rank: int) -> torch.nn.Module:
    return torch.nn.Linear(2, 2)


@pytest.mark.distributed
@pytest.mark.slow  # two launches of their own (about a minute): opt-in, with the other slow checks
def test_returning_a_module_from_launch_says_return_plain_data():
    with pytest.raises(UsageError, match=r"returned a Linear, which cannot leave its process.*full_state_dict\(\)"):
        autopar.launch(returns_a_module, 1, timeout=30)


def test_a_module_nested_in_a_returned_container_is_refused(tmp_path):
    """The check behind the launch test above, without processes: dicts, lists, tuples and sets are opened."""
    from autopar.launch import _save_result

    path = str(tmp_path / "result.pt")
    for value in ({"a": [torch.nn.Linear(2, 2)]}, ({torch.nn.ReLU()},), [[[torch.nn.Linear(1, 1)]]]):
        with pytest.raises(UsageError, match="cannot leave its process"):
            _save_result(value, path, 0)
    _save_result({"loss": [1.0, torch.ones(2)], "ranks": {0, 1}}, path, 0)  # plain data goes back
    assert torch.load(path)["loss"][0] == 1.0
