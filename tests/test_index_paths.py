"""Index range checks follow every data path from the inputs to the kernel that would mask a bad index.

Hugging Face's causal-LM loss pads the labels (``F.pad(labels, (0, 1), value=-100)``) and shifts them before
the cross-entropy; a model may mask labels with ``torch.where`` on another input. Under a vocabulary-parallel
cross-entropy or embedding an out-of-range index there trains silently, so the check must replay those ops
on the real inputs (``runtime.input_checks``). Negative control: without the replay (no checks found) the
same bad label passes.
"""
import pytest
import torch
import torch.nn.functional as F

from autopar.errors import IndexRangeError
from autopar.passes.capture import capture
from autopar.runtime import input_checks
from tests.models import make_hf_gpt2


class MaskedLabels(torch.nn.Module):
    """Labels masked with ``torch.where`` by another input, padded and shifted, then cross-entropy."""

    def __init__(self, vocab: int = 16):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(vocab, 8), torch.nn.Linear(8, vocab)

    def forward(self, ids, labels, keep):
        labels = torch.where(keep > 0, labels, -100)
        labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        logits = self.head(self.emb(ids))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _masked_case():
    ids = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(0))
    return MaskedLabels(), (ids, ids.clone(), torch.ones(4, 6, dtype=torch.long))


def _checks(model, batch):
    return input_checks.index_checks(capture(model, batch))


@pytest.mark.parametrize("where", [(0, 3), (3, 5)])
def test_a_padded_hf_label_out_of_range_is_refused(where):
    model, (ids, labels) = make_hf_gpt2(batch_size=4, seq=8)
    checks = _checks(model, (ids, labels))
    input_checks.check_index_ranges(checks, (ids, labels), 2)  # good labels pass, in 2 microbatches
    bad = labels.clone()
    bad[where] = 256
    with pytest.raises(IndexRangeError, match="target 256.*256 classes"):
        input_checks.check_index_ranges(checks, (ids, bad), 2)


def test_the_label_shifted_out_is_not_checked():
    """The first label is shifted out by HF's loss: never read, so never refused (one device ignores it)."""
    model, (ids, labels) = make_hf_gpt2(batch_size=4, seq=8)
    bad = labels.clone()
    bad[:, 0] = 999
    input_checks.check_index_ranges(_checks(model, (ids, labels)), (ids, bad), 1)


def test_a_label_masked_by_where_is_checked_only_where_kept():
    model, (ids, labels, keep) = _masked_case()
    checks = _checks(model, (ids, labels, keep))
    bad = labels.clone()
    bad[1, 4] = 16
    with pytest.raises(IndexRangeError, match="target 16"):
        input_checks.check_index_ranges(checks, (ids, bad, keep), 1)
    dropped = keep.clone()
    dropped[1, 4] = 0  # where() replaces it by ignore_index: allowed, as on one device
    input_checks.check_index_ranges(checks, (ids, bad, dropped), 1)
    model(ids, bad, dropped)  # one device agrees


def test_local_shares_replay_the_same_paths():
    model, (ids, labels, keep) = _masked_case()
    checks = _checks(model, (ids, labels, keep))
    bad = labels[:2].clone()
    bad[0, 2] = -5
    with pytest.raises(IndexRangeError, match="target -5"):
        input_checks.check_local_index_ranges(checks, (ids[:2], bad, keep[:2]))


def test_negative_control_without_the_replay_the_bad_label_passes(monkeypatch):
    monkeypatch.setattr(input_checks, "_MAX_REPLAYED", 0)
    model, (ids, labels, keep) = _masked_case()
    checks = _checks(model, (ids, labels, keep))
    bad = labels.clone()
    bad[1, 4] = 16
    input_checks.check_index_ranges(checks, (ids, bad, keep), 1)  # silently accepted


def test_an_index_computed_from_a_parameter_is_not_replayed():
    class FromWeight(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.shift = torch.nn.Parameter(torch.zeros(()))
            self.emb = torch.nn.Embedding(8, 4)

        def forward(self, ids):
            return self.emb(ids + self.shift.long()).sum()

    ids = torch.zeros(2, 3, dtype=torch.long)
    assert _checks(FromWeight(), (ids,)) == []
