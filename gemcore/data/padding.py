"""A jagged batch padded to fixed sizes, so that one CUDA graph can replay many batches.

Padding adds users and never touches a real user's sequence. Attention never crosses sequences,
so every real token's output is what it is unpadded. The padding candidates weigh 0 in the loss
(``JaggedBatch.label_weights``), so the loss and every gradient are the unpadded batch's.
Exception: under block-scaled FP8, padding rows can share a 128-row scaling block with real rows
(rounding-level differences only).
"""
from __future__ import annotations

import torch

from gemcore.data.dataset import JaggedBatch


def _padding_offsets(last: torch.Tensor, total: int, users: int) -> torch.Tensor:
    """(users,) ends of ``users`` padding sequences that share ``total`` rows as evenly as possible,
    counted from ``last`` (a (1,) device tensor, read on the device: no sync)."""
    q, r = divmod(total, users)
    k = torch.arange(1, users + 1, device=last.device, dtype=last.dtype)
    return last + k * q + k.clamp(max=r)


def padding_user_length(num_events: int, num_candidates: int, users: int) -> int:
    """At least the longest padding user (history + candidates) of :func:`pad_batch` when ``users``
    padding users share num_events events and num_candidates candidates."""
    return -(-num_events // users) + -(-num_candidates // users) if users else 0


def pad_batch(batch: JaggedBatch, *, num_events: int, num_candidates: int, num_users: int) -> JaggedBatch:
    """``batch`` with padding users appended: exactly num_events history events, num_candidates
    candidates and num_users users.

    The padding users split the extra events and candidates evenly; their item, action and time
    ids are 0, their labels 0 and their label weights 0. The result's ``max_len`` covers them;
    ``sum_sq_len`` counts them too. Runs on the batch's device without a host sync.
    """
    B, T, C = batch.batch_size, batch.item_ids.numel(), batch.cand_ids.numel()
    for name, want, have in (("num_events", num_events, T), ("num_candidates", num_candidates, C),
                             ("num_users", num_users, B)):
        if not isinstance(want, int) or want < have:
            raise ValueError(f"{name} must be an int of at least the batch's {have}, got {want!r}")
    pad_events, pad_cands, pad_users = num_events - T, num_candidates - C, num_users - B
    if pad_users == 0 and (pad_events or pad_cands):
        raise ValueError(f"num_users must exceed the batch's {B} users to hold {pad_events} padding events "
                         f"and {pad_cands} padding candidates, got {num_users}")
    weights = batch.label_weights if batch.label_weights is not None else torch.ones_like(batch.labels)

    def extend(values: torch.Tensor, n: int) -> torch.Tensor:
        return torch.cat([values, values.new_zeros(n)]) if n else values

    def extend_offsets(offsets: torch.Tensor, n: int) -> torch.Tensor:
        return torch.cat([offsets, _padding_offsets(offsets[-1:], n, pad_users)]) if pad_users else offsets

    q_e, r_e = divmod(pad_events, pad_users) if pad_users else (0, 0)
    q_c, r_c = divmod(pad_cands, pad_users) if pad_users else (0, 0)
    # padding user k's length: q_e + q_c, plus 1 for each of the first r_e and the first r_c users
    lengths = [q_e + q_c + (k < r_e) + (k < r_c) for k in range(pad_users)]
    return JaggedBatch(
        item_ids=extend(batch.item_ids, pad_events),
        actions=extend(batch.actions, pad_events),
        time_buckets=extend(batch.time_buckets, pad_events),
        offsets=extend_offsets(batch.offsets, pad_events),
        cand_ids=extend(batch.cand_ids, pad_cands),
        cand_offsets=extend_offsets(batch.cand_offsets, pad_cands),
        labels=extend(batch.labels, pad_cands),
        max_len=max([batch.max_len, *lengths]),
        sum_sq_len=batch.sum_sq_len + sum(n * n for n in lengths),
        label_weights=extend(weights, pad_cands),
    )
