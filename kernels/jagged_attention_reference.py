"""Jagged attention in plain PyTorch: the ground truth for the Triton kernels.

Loops over sequences (no padding, no T x T mask); each sequence is one dense attention with an
explicit mask. Readable before fast.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x, approximate="none"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
    "identity": lambda x: x,
}


def allowed_mask(lq: int, lk: int, *, causal: bool, n_targets: int, window, device) -> torch.Tensor:
    """(lq, lk) bool: may query i attend to key j."""
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if causal:
        allowed &= j <= i
        if n_targets:
            history = lq - n_targets
            allowed &= (j < history) | (j == i)
    if window is not None:
        left, right = window
        if left is not None and left >= 0:
            allowed &= (i - j) <= left
        if right is not None and right >= 0:
            allowed &= (j - i) <= right
    return allowed


def jagged_attention_reference(q, k, v, offsets, *, kv_offsets=None, activation="softmax",
                               causal=False, scale=None, norm=None, num_targets=None,
                               window=None, max_seqlen=None):
    """Same contract as :func:`gemcore.kernels.jagged_attention` (inputs already validated).

    q: (Tq, H, Dqk), k: (Tk, H, Dqk), v: (Tk, H, Dv); offsets: (B+1,) or None for pooled
    attention (q: (Nq, H, Dqk) shared by every sequence, output (B, Nq, H, Dv)).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kv_off = (offsets if kv_offsets is None else kv_offsets).tolist()
    pooled = offsets is None
    q_off = None if pooled else offsets.tolist()
    B = len(kv_off) - 1
    if not pooled and max_seqlen is None:
        max_seqlen = max([b - a for a, b in zip(q_off[:-1], q_off[1:])], default=0)
    if norm is None and activation != "softmax":
        if max_seqlen is None:
            max_seqlen = max([b - a for a, b in zip(kv_off[:-1], kv_off[1:])], default=0)
        norm = max(max_seqlen, 1)
    targets = num_targets.tolist() if num_targets is not None else [0] * B
    outs = []
    for b in range(B):
        kb, vb = k[kv_off[b]:kv_off[b + 1]], v[kv_off[b]:kv_off[b + 1]]
        qb = q if pooled else q[q_off[b]:q_off[b + 1]]
        lq, lk = qb.shape[0], kb.shape[0]
        scores = torch.einsum("ihd,jhd->hij", qb, kb) * scale
        allowed = allowed_mask(lq, lk, causal=causal, n_targets=int(targets[b]), window=window,
                               device=q.device)
        if activation == "softmax":
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            probs = torch.where(allowed, probs, torch.zeros((), dtype=probs.dtype, device=probs.device))
        else:
            probs = ACTIVATIONS[activation](scores) * allowed / norm
        outs.append(torch.einsum("hij,jhd->ihd", probs.to(vb.dtype), vb))
    if pooled:
        if not outs:
            return q.new_zeros(0, q.shape[0], q.shape[1], v.shape[-1])
        return torch.stack(outs)
    if not outs:
        return q.new_zeros(0, q.shape[1], v.shape[-1])
    return torch.cat(outs) if len(outs) > 1 else outs[0]
