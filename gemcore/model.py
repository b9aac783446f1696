"""A GEM-style recommendation model on jagged batches (values + offsets, never padded).

Each user's sequence is its history events followed by its candidate items. Blocks of
attention (through the attention hook, causal with the candidates as ``num_targets``: a candidate
sees the whole history and itself, never another candidate), RMSNorm and an MLP (or a top-k
mixture of experts) run over all users' tokens at once. Each candidate's output is scored by a
click-through head trained with binary cross-entropy.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gemcore.config import ModelConfig
from gemcore.data.dataset import JaggedBatch

AttentionFn = Callable[..., torch.Tensor]


class MLP(nn.Module):
    """x: (T, hidden) -> (T, hidden), SiLU-gated."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class MoEMLP(nn.Module):
    """Top-k routed mixture of ``num_experts`` MLPs. x: (T, hidden) -> (T, hidden).

    Each expert is an :class:`MLP` in ``self.experts`` (a ModuleList, so expert parallelism can
    shard it); tokens are grouped by expert with one sort, no per-token Python loop.
    """

    def __init__(self, hidden: int, inner: int, num_experts: int, top_k: int):
        super().__init__()
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(hidden, inner) for _ in range(num_experts))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert = self.router(x).softmax(dim=-1).topk(self.top_k, dim=-1)  # (T, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat_expert = expert.reshape(-1)
        order = flat_expert.argsort(stable=True)
        # one host sync per MoE layer for the split sizes (documented; EP replaces this path)
        counts = torch.bincount(flat_expert, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        # every expert runs, on zero rows too: each then has a (zero) gradient, so data-parallel
        # ranks reduce the same parameters whichever experts their tokens picked
        for e, chunk in zip(self.experts, order.split(counts)):
            rows = chunk // self.top_k
            y = e(x[rows]) * weights.reshape(-1)[chunk, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Block(nn.Module):
    """Pre-norm attention + MLP over jagged tokens x: (T, hidden)."""

    def __init__(self, cfg: ModelConfig, attention: AttentionFn):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden // cfg.num_heads
        self.attn_norm = RMSNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.out = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.mlp_norm = RMSNorm(cfg.hidden)
        inner = cfg.mlp_ratio * cfg.hidden
        self.mlp = (MoEMLP(cfg.hidden, inner, cfg.moe_experts, cfg.moe_top_k) if cfg.moe_experts
                    else MLP(cfg.hidden, inner))
        self.dropout = nn.Dropout(cfg.dropout)
        self.attention = attention

    def forward(self, x, offsets, num_targets, max_seqlen):
        T = x.shape[0]
        # heads from the module (not from x's width) so tensor parallelism can shard them
        q, k, v = self.qkv(self.attn_norm(x)).view(T, 3, self.num_heads, self.head_dim).unbind(1)
        a = self.attention(q, k, v, offsets, causal=True, num_targets=num_targets, max_seqlen=max_seqlen)
        x = x + self.dropout(self.out(a.reshape(T, self.num_heads * self.head_dim)))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class GemModel(nn.Module):
    """Scores each candidate of each user.

    forward(batch) -> logits: (C,) one per candidate, in ``batch.cand_ids`` order.
    """

    def __init__(self, cfg: ModelConfig, attention: AttentionFn):
        super().__init__()
        self.cfg = cfg
        self.item_emb = nn.Embedding(cfg.num_items, cfg.hidden)
        self.action_emb = nn.Embedding(cfg.num_actions + 1, cfg.hidden)  # last row: "candidate"
        self.time_emb = nn.Embedding(cfg.time_buckets, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg, attention) for _ in range(cfg.num_blocks))
        self.final_norm = RMSNorm(cfg.hidden)
        self.head = nn.Sequential(nn.Linear(2 * cfg.hidden, cfg.hidden), nn.SiLU(), nn.Linear(cfg.hidden, 1))
        self.apply(_init_weights)

    def embed(self, batch: JaggedBatch):
        """Per user [history events, candidates] as one jagged sequence.

        Returns x: (T+C, hidden), seq_offsets: (B+1,), cand_pos: (C,) rows of x holding the
        candidates, and cand_item: (C, hidden) the candidates' item embeddings (for :meth:`score`).
        """
        hist = (self.item_emb(batch.item_ids) + self.action_emb(batch.actions)
                + self.time_emb(batch.time_buckets))
        cand_item = self.item_emb(batch.cand_ids)
        x, seq_offsets, cand_pos = merge_history_and_candidates(
            hist, batch.offsets, cand_item + self.action_emb.weight[-1], batch.cand_offsets)
        return x, seq_offsets, cand_pos, cand_item

    def score(self, h: torch.Tensor, cand_item: torch.Tensor) -> torch.Tensor:
        """Click logits (C,) from the candidates' final states h: (C, hidden) and item embeddings."""
        h = self.final_norm(h)
        # a fresh tensor, not a view: FSDP2 warns that in-place ops on a returned view skip its hooks
        return self.head(torch.cat([h, h * cand_item], dim=-1)).squeeze(-1).clone()

    def forward(self, batch: JaggedBatch) -> torch.Tensor:
        x, seq_offsets, cand_pos, cand_item = self.embed(batch)
        num_targets = batch.cand_offsets.diff()
        for block in self.blocks:
            x = block(x, seq_offsets, num_targets, batch.max_len)
        return self.score(x[cand_pos], cand_item)

    def loss(self, batch: JaggedBatch) -> torch.Tensor:
        """Mean binary cross-entropy over the batch's candidates, weighted by ``batch.label_weights``
        when present (0 for an empty batch)."""
        return click_loss(self(batch), batch.labels, batch.label_weights)

    def dense_parameters(self) -> int:
        """Parameters touched by every token (embedding tables excluded), for FLOP counting."""
        embeddings = {id(p) for m in (self.item_emb, self.action_emb, self.time_emb) for p in m.parameters()}
        return sum(p.numel() for p in self.parameters() if id(p) not in embeddings)

    def flops(self, num_tokens: int, sum_sq_len: int) -> float:
        """Model FLOPs of one training step (forward + backward) on real tokens only.

        6 FLOPs per dense parameter per token (with MoE, only the top-k experts a token visits),
        plus causal attention: forward 2·Σ L²·hidden per block (QKᵀ and PV, halved for causality),
        backward twice that.
        """
        per_token = self.dense_parameters()
        if self.cfg.moe_experts:
            inner = self.cfg.mlp_ratio * self.cfg.hidden
            expert_params = 3 * self.cfg.hidden * inner
            per_token -= self.cfg.num_blocks * (self.cfg.moe_experts - self.cfg.moe_top_k) * expert_params
        attention_fwd = 2.0 * sum_sq_len * self.cfg.hidden * self.cfg.num_blocks
        return 6.0 * per_token * num_tokens + 3.0 * attention_fwd


def click_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean binary cross-entropy of logits (C,) against click labels (C,), in float32; 0 when C = 0.

    weights: (C,) per-candidate weights, or None for all 1; the mean is then
    sum(weights * bce) / sum(weights), 0 when the weights sum to 0 (computed on device, no sync).
    """
    if weights is None:
        return F.binary_cross_entropy_with_logits(logits.float(), labels, reduction="sum") / max(labels.numel(), 1)
    total = (F.binary_cross_entropy_with_logits(logits.float(), labels, reduction="none") * weights).sum()
    return total / weights.sum().clamp_min(torch.finfo(torch.float32).tiny)


def merge_history_and_candidates(hist, offsets, cand, cand_offsets):
    """Interleave per user: [history_b, candidates_b] for each user b, no Python loop.

    hist: (T, D) with offsets (B+1,); cand: (C, D) with cand_offsets (B+1,).
    Returns x: (T+C, D), seq_offsets: (B+1,) and cand_pos: (C,) rows of x holding candidates.
    """
    T, C = hist.shape[0], cand.shape[0]
    B = offsets.numel() - 1
    seq_offsets = offsets + cand_offsets
    users = torch.arange(B, device=hist.device)
    hist_user = torch.repeat_interleave(users, offsets.diff(), output_size=T)
    cand_user = torch.repeat_interleave(users, cand_offsets.diff(), output_size=C)
    hist_pos = torch.arange(T, device=hist.device) + cand_offsets[hist_user]
    cand_pos = torch.arange(C, device=hist.device) + offsets[cand_user + 1]
    x = hist.new_empty(T + C, hist.shape[1])
    x[hist_pos] = hist
    x[cand_pos] = cand.to(hist.dtype)
    return x, seq_offsets, cand_pos


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        # unit-scale embeddings: the head's candidate x history interactions are products of
        # embeddings, and a 0.02 init leaves their gradients ~1e-4 (the model then sits at the base rate)
        nn.init.normal_(module.weight, std=1.0)
