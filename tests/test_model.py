"""The GEM-style model on jagged batches: shapes, gradients, empty and length-1 histories,
no leakage between users, and the candidate (target) masking."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gemcore.config import AttentionConfig, ModelConfig
from gemcore.data import JaggedDataset, make_synthetic
from gemcore.kernels.jagged_attention import make_attention
from gemcore.model import GemModel, merge_history_and_candidates


def build_model(**overrides) -> GemModel:
    torch.manual_seed(0)
    cfg = ModelConfig(**{"hidden": 16, "num_heads": 2, "num_blocks": 2, "num_items": 50, **overrides})
    return GemModel(cfg, make_attention(AttentionConfig(), backend="reference"))


def dataset_with_lengths(lengths, cand_lengths, seed=0) -> JaggedDataset:
    rng = np.random.default_rng(seed)
    t, c = int(sum(lengths)), int(sum(cand_lengths))
    return JaggedDataset.from_arrays(
        lengths=np.array(lengths), cand_lengths=np.array(cand_lengths),
        item_ids=rng.integers(0, 50, t), actions=rng.integers(0, 4, t), time_gaps=rng.exponential(100, t),
        cand_ids=rng.integers(0, 50, c), labels=rng.integers(0, 2, c).astype(np.float32))


@pytest.mark.parametrize("moe", [0, 4])
def test_forward_backward_with_empty_and_length_one_histories(moe):
    model = build_model(moe_experts=moe, moe_top_k=2)
    data = dataset_with_lengths([0, 1, 5, 0, 3], [2, 1, 3, 1, 2])
    batch = data.__getitems__(range(5))
    logits = model(batch)
    assert logits.shape == (9,) and torch.isfinite(logits).all()
    loss = model.loss(batch)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is None or torch.isfinite(g).all() for g in grads)
    assert model.item_emb.weight.grad.abs().sum() > 0


def test_users_do_not_leak_into_each_other():
    """Scoring users together equals scoring each alone (jagged, no cross-sequence attention)."""
    model = build_model()
    data = dataset_with_lengths([4, 0, 7, 1], [2, 3, 1, 2], seed=1)
    together = model(data.__getitems__(range(4)))
    alone = torch.cat([model(data.__getitems__([i])) for i in range(4)])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


def test_candidates_do_not_see_each_other():
    """Changing one candidate's item leaves the other candidates' scores unchanged."""
    model = build_model()
    data = dataset_with_lengths([5], [3], seed=2)
    batch = data.__getitems__([0])
    before = model(batch)
    batch.cand_ids = batch.cand_ids.clone()
    batch.cand_ids[1] = (batch.cand_ids[1] + 1) % 50
    after = model(batch)
    torch.testing.assert_close(before[[0, 2]], after[[0, 2]])
    assert not torch.allclose(before[1], after[1])


def test_history_order_matters_only_causally():
    """The last history event influences the candidates (they see the whole history)."""
    model = build_model()
    data = dataset_with_lengths([6], [2], seed=3)
    batch = data.__getitems__([0])
    before = model(batch)
    batch.item_ids = batch.item_ids.clone()
    batch.item_ids[-1] = (batch.item_ids[-1] + 7) % 50
    assert not torch.allclose(before, model(batch))


def test_merge_places_each_users_candidates_after_its_history():
    hist = torch.arange(5.0)[:, None]            # users: [0,1] [] [2,3,4]
    cand = -torch.arange(1.0, 5.0)[:, None]      # users: [-1] [-2,-3] [-4]
    x, seq_offsets, cand_pos = merge_history_and_candidates(
        hist, torch.tensor([0, 2, 2, 5]), cand, torch.tensor([0, 1, 3, 4]))
    assert x.squeeze(1).tolist() == [0, 1, -1, -2, -3, 2, 3, 4, -4]
    assert seq_offsets.tolist() == [0, 3, 5, 9] and cand_pos.tolist() == [2, 3, 4, 8]


def test_empty_batch():
    model = build_model()
    data = dataset_with_lengths([3], [1])
    batch = data.__getitems__([])
    assert model(batch).shape == (0,)
    assert model.loss(batch).item() == 0.0


def test_flops_count_real_tokens():
    model = build_model()
    dense = model.dense_parameters()
    assert model.flops(10, 0) == 6 * dense * 10
    assert model.flops(10, 100) - model.flops(10, 0) == 3 * 2 * 100 * 16 * 2


def test_synthetic_data_is_deterministic_and_heavy_tailed():
    a = make_synthetic(num_users=2000, num_items=100, num_actions=4, max_len=256, num_candidates=2,
                       num_clusters=8, seed=5)
    b = make_synthetic(num_users=2000, num_items=100, num_actions=4, max_len=256, num_candidates=2,
                       num_clusters=8, seed=5)
    assert np.array_equal(a.item_ids, b.item_ids) and np.array_equal(a.labels, b.labels)
    lengths = a.lengths.float()
    assert lengths.min() >= 8 and lengths.max() <= 256
    assert lengths.max() > 4 * lengths.median()  # heavy tail
    assert 0.1 < a.labels.mean() < 0.9


def test_moe_gives_every_expert_a_gradient_even_without_tokens():
    """Data-parallel ranks must reduce the same parameters whatever their tokens picked: an
    expert no token was routed to gets a zero gradient, not none (FSDP2 failed on the difference)."""
    from gemcore.model import MoEMLP

    torch.manual_seed(0)
    moe = MoEMLP(hidden=8, inner=16, num_experts=4, top_k=1)
    moe(torch.randn(1, 8)).sum().backward()  # one token: three experts see no rows
    grads = [p.grad for e in moe.experts for p in e.parameters()]
    assert all(g is not None for g in grads)
    assert sum(bool(g.abs().sum() == 0) for g in grads) >= 2 * sum(1 for _ in moe.experts[0].parameters())
