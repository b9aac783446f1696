"""Jagged samples in flat arrays, and the batch type the model consumes (values + offsets, no padding)."""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch


@dataclass
class JaggedBatch:
    """One batch of B users. T history events in all, C candidates in all.

    item_ids, actions, time_buckets: (T,) int64 history events, user after user.
    offsets: (B+1,) int64 starts of each user's history in those arrays.
    cand_ids: (C,) int64 candidate items; cand_offsets: (B+1,) int64; labels: (C,) float32 clicks.
    max_len: longest history + candidates of one user; sum_sq_len: sum over users of
    (history + candidates)^2, both host ints computed at collation (for FLOP counting, no sync).
    label_weights: (C,) float32 weight of each candidate in the loss, or None for all 1
    (:func:`gemcore.data.padding.pad_batch` gives padding candidates 0).
    """

    item_ids: torch.Tensor
    actions: torch.Tensor
    time_buckets: torch.Tensor
    offsets: torch.Tensor
    cand_ids: torch.Tensor
    cand_offsets: torch.Tensor
    labels: torch.Tensor
    max_len: int = 0
    sum_sq_len: int = 0
    label_weights: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.offsets.numel() - 1

    @property
    def num_tokens(self) -> int:
        """Real tokens the model processes: history events plus candidates."""
        return self.item_ids.numel() + self.cand_ids.numel()

    def _map(self, fn) -> "JaggedBatch":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return JaggedBatch(**{k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in values.items()})

    def to(self, device, non_blocking: bool = True) -> "JaggedBatch":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "JaggedBatch":
        """Called by DataLoader(pin_memory=True) so host-to-device copies can be asynchronous."""
        return self._map(torch.Tensor.pin_memory)


def time_bucket(gaps_s: np.ndarray, buckets: int) -> np.ndarray:
    """Log2-spaced bucket of a time gap in seconds (minute resolution), clipped to [0, buckets)."""
    return np.clip(np.floor(np.log2(1.0 + np.asarray(gaps_s) / 60.0)), 0, buckets - 1).astype(np.int64)


def _gather_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(s, s + n)`` for each (s, n), vectorised."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    group_start = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + (np.arange(total) - group_start)


class JaggedDataset(torch.utils.data.Dataset):
    """Users' histories and candidates in flat numpy arrays with offsets.

    ``dataset[indices]`` through ``__getitems__`` returns one collated :class:`JaggedBatch`, so a
    ``DataLoader(dataset, batch_sampler=sampler, collate_fn=lambda b: b)`` yields batches directly.
    """

    def __init__(self, *, offsets, item_ids, actions, time_gaps, cand_offsets, cand_ids, labels,
                 time_buckets: int = 32):
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.item_ids = np.asarray(item_ids, dtype=np.int64)
        self.actions = np.asarray(actions, dtype=np.int64)
        self.time_gaps = np.asarray(time_gaps, dtype=np.float64)
        self.cand_offsets = np.asarray(cand_offsets, dtype=np.int64)
        self.cand_ids = np.asarray(cand_ids, dtype=np.int64)
        self.labels = np.asarray(labels, dtype=np.float32)
        self.time_buckets = time_buckets
        n = self.offsets.size - 1
        if self.cand_offsets.size != n + 1:
            raise ValueError(f"cand_offsets must have {n + 1} entries, got {self.cand_offsets.size}")
        for name, arr, end in (("item_ids", self.item_ids, self.offsets[-1]),
                               ("actions", self.actions, self.offsets[-1]),
                               ("time_gaps", self.time_gaps, self.offsets[-1]),
                               ("cand_ids", self.cand_ids, self.cand_offsets[-1]),
                               ("labels", self.labels, self.cand_offsets[-1])):
            if arr.size != end:
                raise ValueError(f"{name} has {arr.size} entries, offsets say {end}")

    @classmethod
    def from_arrays(cls, *, lengths, cand_lengths, **arrays) -> "JaggedDataset":
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        cand_offsets = np.concatenate([[0], np.cumsum(cand_lengths)])
        return cls(offsets=offsets, cand_offsets=cand_offsets, **arrays)

    def __len__(self) -> int:
        return self.offsets.size - 1

    @property
    def lengths(self) -> torch.Tensor:
        """(N,) int64 history lengths, for samplers."""
        return torch.from_numpy(np.diff(self.offsets))

    @property
    def cand_lengths(self) -> torch.Tensor:
        return torch.from_numpy(np.diff(self.cand_offsets))

    def subset(self, indices) -> "JaggedDataset":
        """A new dataset holding the users ``indices`` (in that order)."""
        idx = np.asarray(indices, dtype=np.int64)
        return JaggedDataset.from_arrays(
            lengths=self.offsets[idx + 1] - self.offsets[idx],
            cand_lengths=self.cand_offsets[idx + 1] - self.cand_offsets[idx],
            item_ids=_gather(self.item_ids, self.offsets, idx),
            actions=_gather(self.actions, self.offsets, idx),
            time_gaps=_gather(self.time_gaps, self.offsets, idx),
            cand_ids=_gather(self.cand_ids, self.cand_offsets, idx),
            labels=_gather(self.labels, self.cand_offsets, idx),
            time_buckets=self.time_buckets)

    def __getitem__(self, index: int) -> JaggedBatch:
        return self.__getitems__([index])

    def __getitems__(self, indices) -> JaggedBatch:
        idx = np.asarray(indices, dtype=np.int64)
        lengths = self.offsets[idx + 1] - self.offsets[idx]
        cand_lengths = self.cand_offsets[idx + 1] - self.cand_offsets[idx]
        hist = _gather_ranges(self.offsets[idx], lengths)
        cand = _gather_ranges(self.cand_offsets[idx], cand_lengths)
        seq = lengths + cand_lengths
        return JaggedBatch(
            item_ids=torch.from_numpy(self.item_ids[hist]),
            actions=torch.from_numpy(self.actions[hist]),
            time_buckets=torch.from_numpy(time_bucket(self.time_gaps[hist], self.time_buckets)),
            offsets=torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)),
            cand_ids=torch.from_numpy(self.cand_ids[cand]),
            cand_offsets=torch.from_numpy(np.concatenate([[0], np.cumsum(cand_lengths)]).astype(np.int64)),
            labels=torch.from_numpy(self.labels[cand]),
            max_len=int(seq.max()) if seq.size else 0,
            sum_sq_len=int((seq.astype(np.int64) ** 2).sum()),
        )


def _gather(values: np.ndarray, offsets: np.ndarray, idx: np.ndarray) -> np.ndarray:
    return values[_gather_ranges(offsets[idx], offsets[idx + 1] - offsets[idx])]
