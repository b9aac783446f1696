"""Jagged attention in plain PyTorch: the ground truth for the Triton kernels.

Loops over sequences (no padding, no T x T mask over the whole batch); each sequence is one dense
attention with an explicit (Lq, Lk) mask, computed in float32 (float64 stays float64) and returned
in q's dtype. Readable before fast. Inputs are assumed validated by
:func:`gemcore.kernels.jagged_attention.jagged_attention`.

Semantics shared with the Triton kernels:

* positions ``i`` (query) and ``j`` (key) count from the start of their own sequence;
* ``causal``: ``j <= i``; ``num_targets[b] = n`` (causal only): with ``h = Lq - n`` history tokens,
  a key ``j >= h`` (a candidate) is visible only to itself: allowed iff ``j < h or j == i``;
* ``window = (left, right)``: ``p(i) - j <= left`` and ``j - i <= right``; ``None`` or a negative
  bound is unbounded. ``p(i) = min(i, h)``: a candidate's position is clamped to the end of the
  history, so every candidate sees the last ``left`` history items (as generative-recommenders'
  ``pytorch_hstu_mha`` with ``max_attn_len = left``); without targets ``p(i) = i``;
* softmax rows with no allowed key produce zeros; other activations are
  ``act(scale * q.k) / norm`` summed over allowed keys;
* ``max_seqlen`` (when None) is the longest sequence among q's and kv's sequences; it is the
  default ``norm`` of non-softmax activations.
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


def window_bounds(window) -> tuple[int, int]:
    """(left, right) with -1 for an unbounded side."""
    if window is None:
        return -1, -1
    left, right = window
    left = -1 if left is None or left < 0 else int(left)
    right = -1 if right is None or right < 0 else int(right)
    return left, right


def default_max_seqlen(offsets, kv_offsets) -> int:
    """Longest sequence among q's (``offsets``) and kv's (``kv_offsets``) sequences."""
    longest = 0
    for off in (offsets, kv_offsets):
        if off is not None and off.numel() > 1:
            longest = max(longest, int(off.diff().max()))
    return longest


def allowed_mask(lq: int, lk: int, *, causal: bool, n_targets: int, window, device) -> torch.Tensor:
    """(lq, lk) bool: may query i attend to key j."""
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=device)
    pos = i  # the query's position for the left window: candidates' clamped to the history end
    if causal:
        allowed &= j <= i
        if n_targets:
            history = lq - n_targets
            allowed &= (j < history) | (j == i)
            pos = i.clamp(max=history)
    left, right = window_bounds(window)
    if left >= 0:
        allowed &= (pos - j) <= left
    if right >= 0:
        allowed &= (j - i) <= right
    return allowed


def _masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim restricted to ``allowed``; rows with nothing allowed give 0."""
    if scores.shape[-1] == 0:
        return scores
    scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    e = torch.exp(scores - row_max)
    denom = e.sum(dim=-1, keepdim=True)
    return e / torch.where(denom > 0, denom, torch.ones_like(denom))


def jagged_attention_reference(q, k, v, offsets, *, kv_offsets=None, activation="softmax",
                               causal=False, scale=None, norm=None, num_targets=None,
                               window=None, max_seqlen=None):
    """Same contract as :func:`gemcore.kernels.jagged_attention` (inputs already validated).

    q: (Tq, H, Dqk), k: (Tk, H, Dqk), v: (Tk, H, Dv); offsets: (B+1,) or None for pooled
    attention (q: (Nq, H, Dqk) shared by every sequence, output (B, Nq, H, Dv)).
    """
    out_dtype = q.dtype
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qc, kc, vc = q.to(compute), k.to(compute), v.to(compute)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    pooled = offsets is None
    kv_off = (offsets if kv_offsets is None else kv_offsets).tolist()
    q_off = None if pooled else offsets.tolist()
    B = len(kv_off) - 1
    if activation != "softmax" and norm is None:
        if max_seqlen is None:
            max_seqlen = default_max_seqlen(offsets, kv_offsets)
        norm = max(max_seqlen, 1)
    targets = num_targets.tolist() if num_targets is not None else [0] * B
    outs = []
    for b in range(B):
        kb, vb = kc[kv_off[b]:kv_off[b + 1]], vc[kv_off[b]:kv_off[b + 1]]
        qb = qc if pooled else qc[q_off[b]:q_off[b + 1]]
        lq, lk = qb.shape[0], kb.shape[0]
        scores = torch.einsum("ihd,jhd->hij", qb, kb) * scale
        allowed = allowed_mask(lq, lk, causal=causal, n_targets=int(targets[b]), window=window,
                               device=q.device)
        if activation == "softmax":
            probs = _masked_softmax(scores, allowed)
        else:
            probs = ACTIVATIONS[activation](scores) * allowed / norm
        outs.append(torch.einsum("hij,jhd->ihd", probs, vb))
    if pooled:
        if not outs:
            return q.new_zeros(0, q.shape[0], q.shape[1], v.shape[-1])
        return torch.stack(outs).to(out_dtype)
    if not outs:
        return q.new_zeros(0, q.shape[1], v.shape[-1])
    return torch.cat(outs).to(out_dtype)
