"""The padded baseline of `gem bench train` computes the same function as the jagged model."""
from __future__ import annotations

import torch

from gemcore.bench.padded import PaddedGemModel
from gemcore.config import AttentionConfig, ModelConfig
from gemcore.data import make_synthetic
from gemcore.kernels.jagged_attention import make_attention
from gemcore.model import GemModel


def test_padded_baseline_matches_the_jagged_model():
    torch.manual_seed(0)
    model = GemModel(ModelConfig(hidden=16, num_heads=2, num_blocks=2, num_items=40),
                     make_attention(AttentionConfig(), backend="reference"))
    data = make_synthetic(num_users=6, num_items=40, num_actions=4, max_len=12, num_candidates=3,
                          num_clusters=4, kind="uniform", seed=1)
    batch = data.__getitems__(range(6))
    torch.testing.assert_close(PaddedGemModel(model)(batch), model(batch), rtol=1e-4, atol=1e-5)
    (PaddedGemModel(model).loss(batch)).backward()
    assert model.blocks[0].qkv.weight.grad.abs().sum() > 0
