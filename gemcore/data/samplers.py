"""The ``random`` batch sampler: a seeded shuffle, split into global batches, sharded by rank."""
from __future__ import annotations

import torch


class RandomBatchSampler:
    """Yields, per step, this rank's list of sample indices.

    lengths: (N,) history lengths (unused: random ignores cost; kept for the common signature).
    batch_size: global batch in samples, split evenly over ``world_size`` ranks (it must divide).
    Each epoch is a permutation drawn from (seed, epoch); the tail shorter than a global batch is
    a final smaller step unless ``drop_last``. Iterating yields one epoch, as torch's
    ``DistributedSampler`` does: ``len(self)`` lists after ``set_epoch(e)`` (the rest of the epoch
    after ``load_state_dict`` of a mid-epoch state), then stops; ``set_epoch(e + 1)`` starts the
    next. ``state_dict`` holds (epoch, step within epoch).
    ``cost`` and ``sub_batch`` (passed by the trainer to every sampler) are accepted and ignored:
    random sharding does not look at cost.
    """

    def __init__(self, lengths, *, batch_size: int, world_size: int = 1, rank: int = 0,
                 seed: int = 0, drop_last: bool = False, cost=None, sub_batch: int | None = None):
        n = len(lengths)
        if batch_size <= 0 or batch_size % world_size:
            raise ValueError(f"batch_size ({batch_size}) must be a positive multiple of world_size ({world_size})")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if n == 0:
            raise ValueError("lengths is empty: no samples to draw")
        self.n, self.batch_size, self.world_size, self.rank = n, batch_size, world_size, rank
        self.seed, self.drop_last = seed, drop_last
        self.epoch, self.step_in_epoch = 0, 0

    def steps_per_epoch(self) -> int:
        full, tail = divmod(self.n, self.batch_size)
        return full + (1 if tail and not self.drop_last else 0)

    def __len__(self) -> int:
        return self.steps_per_epoch()

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.step_in_epoch = int(epoch), 0

    def _permutation(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.n, generator=gen)

    def __iter__(self):
        perm = self._permutation()
        while self.step_in_epoch < self.steps_per_epoch():
            start = self.step_in_epoch * self.batch_size
            batch = perm[start:start + self.batch_size]
            self.step_in_epoch += 1
            yield batch[self.rank::self.world_size].tolist()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])
