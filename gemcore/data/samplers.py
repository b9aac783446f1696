"""Batch samplers' epoch bookkeeping, and the ``random`` batch sampler: a seeded shuffle, split
into global batches, sharded by rank."""
from __future__ import annotations

import abc
from typing import Iterator

import torch


class EpochSampler(abc.ABC):
    """Epochs of ``steps_per_epoch()`` steps, as torch's ``DistributedSampler`` iterates: each
    ``iter()`` yields the whole current epoch (the same one again unless ``set_epoch`` moved on),
    except the first after ``load_state_dict`` of a mid-epoch state, which yields the rest of it.
    ``len()`` is the whole epoch's step count. Subclasses set ``n``, ``drop_last`` and
    ``global_batch`` and implement ``_step(step)``: the batch of ``step`` of ``self.epoch``.
    """

    n: int
    global_batch: int
    drop_last: bool
    epoch: int = 0
    step_in_epoch: int = 0
    _resuming: bool = False

    def steps_per_epoch(self) -> int:
        full, tail = divmod(self.n, self.global_batch)
        return full + (1 if tail and not self.drop_last else 0)

    def __len__(self) -> int:
        return self.steps_per_epoch()

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.step_in_epoch, self._resuming = int(epoch), 0, False

    @abc.abstractmethod
    def _step(self, step: int) -> list[int]:
        """This rank's sample indices for ``step`` of ``self.epoch``."""

    def __iter__(self) -> Iterator[list[int]]:
        if not self._resuming:
            self.step_in_epoch = 0
        self._resuming = False
        while self.step_in_epoch < self.steps_per_epoch():
            batch = self._step(self.step_in_epoch)
            self.step_in_epoch += 1
            yield batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])
        self._resuming = True


class RandomBatchSampler(EpochSampler):
    """Yields, per step, this rank's list of sample indices.

    lengths: (N,) history lengths (unused: random ignores cost; kept for the common signature).
    batch_size: global batch in samples, split evenly over ``world_size`` ranks (it must divide).
    Each epoch is a permutation drawn from (seed, epoch); the tail shorter than a global batch is
    a final smaller step unless ``drop_last``. Iterating yields one epoch (:class:`EpochSampler`).
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
        self.n, self.global_batch, self.world_size, self.rank = n, batch_size, world_size, rank
        self.seed, self.drop_last = seed, drop_last
        self._perm_epoch, self._perm = -1, None

    def _step(self, step: int) -> list[int]:
        if self._perm_epoch != self.epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._perm, self._perm_epoch = torch.randperm(self.n, generator=gen), self.epoch
        batch = self._perm[step * self.global_batch:(step + 1) * self.global_batch]
        return batch[self.rank::self.world_size].tolist()
