"""Padding a jagged batch for CUDA-graph replay: layout, weights, bad sizes, and a loss and
gradients equal to the unpadded batch's (padding users never touch real tokens)."""
from __future__ import annotations

import pytest
import torch

from gemcore.config import AttentionConfig, ModelConfig
from gemcore.data.padding import pad_batch, padding_user_length
from gemcore.kernels.jagged_attention import make_attention
from gemcore.model import GemModel, click_loss
from test_model import dataset_with_lengths


def model() -> GemModel:
    torch.manual_seed(0)
    cfg = ModelConfig(hidden=16, num_heads=2, num_blocks=2, num_items=50)
    return GemModel(cfg, make_attention(AttentionConfig(), backend="reference"))


def test_layout_of_the_padding_users():
    batch = dataset_with_lengths([3, 0, 5], [2, 1, 0]).__getitems__(range(3))
    padded = pad_batch(batch, num_events=8 + 11, num_candidates=3 + 4, num_users=3 + 4)
    assert padded.offsets.tolist() == [0, 3, 3, 8, 11, 14, 17, 19]  # 11 events over 4 users: 3, 3, 3, 2
    assert padded.cand_offsets.tolist() == [0, 2, 3, 3, 4, 5, 6, 7]
    assert padded.item_ids[:8].equal(batch.item_ids) and not padded.item_ids[8:].any()
    assert padded.labels[:3].equal(batch.labels) and not padded.labels[3:].any()
    assert padded.label_weights.tolist() == [1.0] * 3 + [0.0] * 4
    assert padded.max_len == 5 and padded.sum_sq_len == batch.sum_sq_len + 3 * 4 ** 2 + 3 ** 2
    assert padded.max_len <= max(batch.max_len, padding_user_length(11, 4, 4))


def test_no_padding_and_existing_weights_are_kept():
    batch = dataset_with_lengths([2, 1], [1, 1]).__getitems__(range(2))
    batch.label_weights = torch.tensor([0.5, 2.0])
    same = pad_batch(batch, num_events=3, num_candidates=2, num_users=2)
    assert same.offsets.equal(batch.offsets) and same.label_weights.equal(batch.label_weights)
    more = pad_batch(batch, num_events=3, num_candidates=4, num_users=3)
    assert more.label_weights.tolist() == [0.5, 2.0, 0.0, 0.0]


@pytest.mark.parametrize("lengths, cand_lengths", [([0, 1, 7, 0, 2], [1, 2, 1, 0, 3]),  # empty and length-1
                                                   ([1, 1, 1], [1, 1, 1]),  # all length 1
                                                   ([0, 0], [0, 0])])  # no tokens at all
def test_loss_and_gradients_equal_the_unpadded_batch(lengths, cand_lengths):
    batch = dataset_with_lengths(lengths, cand_lengths).__getitems__(range(len(lengths)))
    padded = pad_batch(batch, num_events=batch.item_ids.numel() + 9, num_candidates=batch.cand_ids.numel() + 5,
                       num_users=batch.batch_size + 3)
    grads = []
    for b in (batch, padded):
        m = model()
        loss = m.loss(b)
        loss.backward()
        grads.append((loss.detach(), [p.grad if p.grad is not None else torch.zeros_like(p) for p in m.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = grads
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-7)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_weighted_click_loss_is_a_weighted_mean():
    torch.manual_seed(1)
    logits, labels = torch.randn(6, dtype=torch.float64), torch.randint(0, 2, (6,)).double()
    w = torch.tensor([1.0, 0.0, 2.0, 1.0, 0.0, 0.5], dtype=torch.float64)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    torch.testing.assert_close(click_loss(logits, labels, w), (bce * w).sum() / w.sum())
    assert click_loss(logits, labels, torch.zeros(6, dtype=torch.float64)).item() == 0.0
    torch.testing.assert_close(click_loss(logits, labels, torch.ones(6, dtype=torch.float64)),
                               click_loss(logits, labels))


@pytest.mark.parametrize("kwargs, message", [
    ({"num_events": 2, "num_candidates": 3, "num_users": 4}, "num_events must be an int of at least the batch's 8"),
    ({"num_events": 8, "num_candidates": 2, "num_users": 4}, "num_candidates must be an int of at least"),
    ({"num_events": 8, "num_candidates": 3, "num_users": 2}, "num_users must be an int of at least the batch's 3"),
    ({"num_events": 9, "num_candidates": 3, "num_users": 3}, "num_users must exceed the batch's 3 users"),
    ({"num_events": 8.0, "num_candidates": 3, "num_users": 3}, "num_events must be an int"),
])
def test_bad_sizes_are_named(kwargs, message):
    batch = dataset_with_lengths([3, 0, 5], [2, 1, 0]).__getitems__(range(3))
    with pytest.raises(ValueError, match=message):
        pad_batch(batch, **kwargs)
