"""Public entry for jagged attention: validates once, picks the backend, never substitutes another."""
from __future__ import annotations

from typing import Any

import torch

from gemcore.kernels.jagged_attention_checks import BACKENDS, check_static, check_values
from gemcore.kernels.jagged_attention_reference import ACTIVATIONS, jagged_attention_reference

__all__ = ["ACTIVATIONS", "BACKENDS", "jagged_attention", "make_attention"]


def jagged_attention(q, k, v, offsets, *, kv_offsets=None, activation="softmax", causal=False,
                     scale=None, norm=None, num_targets=None, window=None, max_seqlen=None,
                     backend="auto", validate=True) -> torch.Tensor:
    """Attention over jagged sequences, no padding.

    q: (Tq, H, Dqk), k: (Tk, H, Dqk), v: (Tk, H, Dv) in float32, float16 or bfloat16;
    offsets: (B+1,) starts of q's sequences (and of k/v's unless ``kv_offsets`` is given: cross
    attention, q sequence b attends to kv sequence b). ``offsets=None`` is pooled attention: q of
    shape (Nq, H, Dqk) is shared by every kv sequence and the result is (B, Nq, H, Dv).

    activation: "softmax" or one of :data:`ACTIVATIONS` (``out_i = sum_j act(scale q_i.k_j) v_j
    / norm`` over allowed keys). causal (self-attention only): key j <= query i.
    num_targets: (B,) candidates at the end of each sequence (causal only), each sees the history
    and itself. window: (left, right) in tokens, None or negative = unbounded; a candidate's
    position is clamped to the history's end for ``left`` (it sees the last ``left`` history
    items, as HSTU's ``max_attn_len``). scale defaults to
    1/sqrt(Dqk); norm (non-softmax only) to max_seqlen, which defaults to the longest q or kv
    sequence. backend: "auto" (triton on CUDA, reference elsewhere), "triton" or "reference".
    validate=False (with max_seqlen given) skips the checks of the offsets' values, which cost one
    host sync per call; for callers whose offsets are valid by construction (gemcore's model).
    Returns (Tq, H, Dv) in q's dtype. Bad input raises ValueError naming the argument.
    """
    check_static(q, k, v, offsets, kv_offsets, activation, causal, scale, norm, num_targets,
                 window, max_seqlen, backend)
    if backend == "auto":
        backend = "triton" if q.is_cuda else "reference"
    if backend == "triton":
        from gemcore.kernels import jagged_attention_triton  # imported lazily: needs triton

        return jagged_attention_triton.jagged_attention_triton(
            q, k, v, offsets, kv_offsets=kv_offsets, activation=activation, causal=causal,
            scale=scale, norm=norm, num_targets=num_targets, window=window, max_seqlen=max_seqlen,
            validate=validate)
    resolved = check_values(q, k, offsets, kv_offsets, num_targets,
                            -1 if max_seqlen is None else max_seqlen)
    return jagged_attention_reference(
        q, k, v, offsets, kv_offsets=kv_offsets, activation=activation, causal=causal, scale=scale,
        norm=norm, num_targets=num_targets, window=window, max_seqlen=resolved)


def make_attention(config: Any, backend: str = "auto", activation: str | None = None):
    """Bind an :class:`gemcore.config.AttentionConfig` into the attention hook's callable.

    ``activation`` overrides ``config.activation``; ``config.scale`` / ``config.norm`` of 0 mean
    the defaults (1/sqrt(head_dim), max_seqlen). The callable is
    ``attend(q, k, v, offsets, *, causal=True, num_targets=None, max_seqlen=None)``. When the
    caller gives ``max_seqlen`` (the model does, from the collated batch), the offsets are trusted
    and the per-call host sync of the value checks is skipped.
    """
    act = activation or config.activation
    scale = config.scale or None
    norm = (config.norm or None) if act != "softmax" else None
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if act != "softmax" and act not in ACTIVATIONS:
        raise ValueError(f"activation must be 'softmax' or one of {sorted(ACTIVATIONS)}, got {act!r}")

    def attend(q, k, v, offsets, *, causal=True, num_targets=None, max_seqlen=None):
        return jagged_attention(q, k, v, offsets, activation=act, causal=causal, scale=scale,
                                norm=norm, num_targets=num_targets, max_seqlen=max_seqlen,
                                backend=backend, validate=max_seqlen is None)

    return attend
