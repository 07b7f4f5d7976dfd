"""A sampler whose position is global: resume on any number of data shards, no sample twice or skipped.

Order: epoch e visits the N samples in ``randperm(N)`` drawn from a generator seeded with (seed, e), the
same on every rank and every world size. Position: (epoch, cursor), the count of samples of epoch e
consumed so far, global (not per rank). Each step takes the next ``global_batch`` ids of the permutation,
ids [cursor, cursor + global_batch), and a rank keeps the rows its share names: with ``shard = (index,
count)`` (``pm.data_shard``), rows [index·G/count, (index+1)·G/count) of that global batch, so the
concatenation of the shares in index order is the global batch. An epoch's tail shorter than a global
batch is dropped (every step has the planned batch) and the next epoch starts.

Hence the invariant a resume relies on: the ids of step s depend only on (seed, N, the global batches of
steps 0..s-1), never on the number of shards or the rank; ``state_dict()`` is that position (plain
ints, saved with the checkpoint: ``pm.save(..., position=...)``), and ``load_state_dict`` on another world
size continues from the same sample. Changing the global batch on resume is allowed: the cursor counts
samples, not steps.
"""
from __future__ import annotations

import torch

from autopar.errors import UsageError


class GlobalSampler:
    def __init__(self, num_samples: int, global_batch: int, seed: int = 0, shard: tuple[int, int] = (0, 1)):
        if num_samples < global_batch or global_batch < 1:
            raise UsageError(f"a global batch of {global_batch} needs at least that many samples; the data set has "
                             f"{num_samples}: add data or lower the batch")
        self.num_samples, self.global_batch, self.seed = num_samples, global_batch, seed
        self.shard = _checked_shard(shard, global_batch)
        self.epoch, self.cursor = 0, 0
        self._order: tuple[int, torch.Tensor] | None = None

    def order(self, epoch: int) -> torch.Tensor:
        """The permutation of epoch ``epoch`` (the same wherever it is computed)."""
        if self._order is None or self._order[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = epoch, torch.randperm(self.num_samples, generator=g)
        return self._order[1]

    def next_global(self) -> torch.Tensor:
        """The ids of the next global batch; advances the position."""
        if self.cursor + self.global_batch > self.num_samples:  # drop the short tail, start the next epoch
            self.epoch, self.cursor = self.epoch + 1, 0
        ids = self.order(self.epoch)[self.cursor:self.cursor + self.global_batch]
        self.cursor += self.global_batch
        return ids

    def next_ids(self) -> torch.Tensor:
        """The ids of this shard's rows of the next global batch; advances the position."""
        index, count = self.shard
        return self.next_global().chunk(count)[index]

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (another world size's, possibly): the same data set and seed are required,
        or the saved position would point at other samples."""
        if (state["seed"], state["num_samples"]) != (self.seed, self.num_samples):
            raise UsageError(f"the saved data position is for {state['num_samples']} samples with seed "
                             f"{state['seed']}, this run has {self.num_samples} with seed {self.seed}; resume with "
                             f"the same data files and seed, or start a new run in another directory")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


def _checked_shard(shard, global_batch: int) -> tuple[int, int]:
    index, count = (int(x) for x in shard)
    if not 0 <= index < count or global_batch % count:
        raise UsageError(f"shard {shard} of a global batch of {global_batch}: need 0 <= index < count and count "
                         f"dividing the batch (pass pm.data_shard)")
    return index, count
