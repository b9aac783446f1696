"""The padded baseline for ``gem bench train``: what a user writes without gemcore.

The same :class:`~gemcore.model.GemModel` weights, run on histories padded to the batch maximum:
(B, Lmax, hidden) tensors through every layer, attention by ``F.scaled_dot_product_attention`` with
a boolean mask (causal, candidates see the history and themselves, padding masked out). Padding
rows attend to themselves only, so no row is fully masked (which would give NaN).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemcore.data.dataset import JaggedBatch
from gemcore.model import GemModel, click_loss


def padded_layout(seq_offsets: torch.Tensor, num_targets: torch.Tensor, max_len: int):
    """Scatter index and attention mask for padding jagged sequences to ``max_len``.

    Returns rows: (T,) flat index into (B*max_len) of each jagged token, and mask: (B, 1, L, L) bool.
    """
    B = seq_offsets.numel() - 1
    lengths = seq_offsets.diff()
    T = int(seq_offsets[-1]) if B else 0
    seq = torch.repeat_interleave(torch.arange(B, device=seq_offsets.device), lengths, output_size=T)
    pos = torch.arange(T, device=seq_offsets.device) - seq_offsets[seq]
    rows = seq * max_len + pos
    i = torch.arange(max_len, device=seq_offsets.device)
    history = (lengths - num_targets)[:, None, None]
    valid = i[None, :] < lengths[:, None]
    allowed = (i[None, None, :] <= i[None, :, None]) & ((i[None, None, :] < history) | (i[None, :, None] == i[None, None, :]))
    allowed &= valid[:, None, :] & valid[:, :, None]
    allowed |= torch.eye(max_len, dtype=torch.bool, device=seq_offsets.device)[None]  # padding rows: self
    return rows, allowed[:, None]


class PaddedGemModel(nn.Module):
    """Wraps a GemModel and runs its layers on padded (B, Lmax, hidden) tensors with SDPA."""

    def __init__(self, model: GemModel):
        super().__init__()
        self.model = model

    def forward(self, batch: JaggedBatch) -> torch.Tensor:
        m = self.model
        x, seq_offsets, cand_pos, cand_item = m.embed(batch)
        B, L, hidden = batch.batch_size, batch.max_len, x.shape[1]
        rows, mask = padded_layout(seq_offsets, batch.cand_offsets.diff(), L)
        padded = x.new_zeros(B * L, hidden).index_copy(0, rows, x).view(B, L, hidden)
        for block in m.blocks:
            padded = self._block(block, padded, mask)
        return m.score(padded.reshape(B * L, hidden)[rows][cand_pos], cand_item)

    @staticmethod
    def _block(block, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, L, hidden = x.shape
        H = block.num_heads
        q, k, v = block.qkv(block.attn_norm(x)).view(B, L, 3, H, hidden // H).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + block.out(a.transpose(1, 2).reshape(B, L, hidden))
        return x + block.mlp(block.mlp_norm(x))

    def loss(self, batch: JaggedBatch) -> torch.Tensor:
        return click_loss(self(batch), batch.labels)
