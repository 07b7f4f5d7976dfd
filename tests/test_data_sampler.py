"""autopar.data: the global sampler's position carries over any change of the number of data shards.

Shares of a global batch, concatenated in index order, are the global batch for any count; a position
saved under 4 shards and loaded under 2 (or 1) continues with the next global batch, so an epoch visits
every sample once. Negative control: a sampler that does not load the position repeats samples. Bad
inputs (a position from other data, a shard that does not divide the batch) are UsageErrors.
"""
import pytest
import torch

from autopar.data import ByteTokenizer, GlobalSampler, TextSamples
from autopar.errors import UsageError


def shares(samplers) -> list[int]:
    return [i for s in samplers for i in s.next_ids().tolist()]


def test_shares_of_any_count_concatenate_to_the_same_global_batches():
    for count in (1, 2, 4):
        samplers = [GlobalSampler(40, 8, seed=3, shard=(i, count)) for i in range(count)]
        got = [shares(samplers) for _ in range(5)]
        assert got == [GlobalSampler(40, 8, seed=3).order(0)[8 * k:8 * (k + 1)].tolist() for k in range(5)]


@pytest.mark.parametrize("before, after", [(4, 2), (2, 4), (4, 1)])
def test_a_position_saved_under_one_count_resumes_under_another(before, after):
    first = [GlobalSampler(48, 8, seed=1, shard=(i, before)) for i in range(before)]
    seen = [i for _ in range(3) for i in shares(first)]
    state = first[0].state_dict()
    second = [GlobalSampler(48, 8, seed=1, shard=(i, after)) for i in range(after)]
    for s in second:
        s.load_state_dict(state)
    seen += [i for _ in range(3) for i in shares(second)]
    assert sorted(seen) == list(range(48))
    restarted = [GlobalSampler(48, 8, seed=1, shard=(i, after)) for i in range(after)]  # negative control
    repeated = seen[:24] + [i for _ in range(3) for i in shares(restarted)]
    assert sorted(repeated) != list(range(48))


def test_an_epochs_short_tail_is_dropped_and_the_next_epoch_reorders():
    s = GlobalSampler(20, 8, seed=0)
    first = [s.next_global().tolist() for _ in range(2)]
    third = s.next_global().tolist()
    assert s.epoch == 1 and third == s.order(1)[:8].tolist() and s.order(1).tolist() != s.order(0).tolist()
    assert len(set(first[0] + first[1])) == 16


def test_bad_positions_and_shards_are_usage_errors():
    with pytest.raises(UsageError, match="same data files and seed"):
        GlobalSampler(48, 8, seed=2).load_state_dict(GlobalSampler(40, 8, seed=2).state_dict())
    with pytest.raises(UsageError, match="pm.data_shard"):
        GlobalSampler(48, 8, shard=(0, 3))
    with pytest.raises(UsageError, match="at least that many samples"):
        GlobalSampler(4, 8)


def test_text_samples_are_byte_tokens_cut_into_fixed_rows(tmp_path):
    (tmp_path / "a.txt").write_text("hello world, " * 10)
    (tmp_path / "b.md").write_text("é" * 7)
    data = TextSamples(tmp_path, seq_len=15)
    assert len(data) == (130 + 1 + 14 + 1) // 16
    inputs, labels = data.batch(torch.tensor([0, 1]))
    assert inputs.shape == (2, 15) and torch.equal(labels[:, :-1], inputs[:, 1:])
    assert ByteTokenizer().decode(data.tokens[0].tolist()).startswith("hello world")
    with pytest.raises(UsageError, match="no text file"):
        TextSamples(tmp_path / "missing", seq_len=4)
