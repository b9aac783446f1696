"""Public entry for jagged attention: validates once, picks the backend, never substitutes another."""
from __future__ import annotations

from typing import Any

import torch

from gemcore.kernels.jagged_attention_reference import ACTIVATIONS, jagged_attention_reference

BACKENDS = ("auto", "triton", "reference")


def _validate_offsets(name: str, offsets: torch.Tensor, total: int) -> None:
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{name} must be a 1-D tensor of B+1 starts, got shape {tuple(offsets.shape)}")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {offsets.dtype}")
    if int(offsets[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(offsets[0])}")
    if offsets.numel() > 1 and bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing")
    if int(offsets[-1]) != total:
        raise ValueError(f"{name} must end at the number of tokens ({total}), got {int(offsets[-1])}")


def jagged_attention(q, k, v, offsets, *, kv_offsets=None, activation="softmax", causal=False,
                     scale=None, norm=None, num_targets=None, window=None, max_seqlen=None,
                     backend="auto") -> torch.Tensor:
    """Attention over jagged sequences, no padding.

    q: (Tq, H, Dqk), k: (Tk, H, Dqk), v: (Tk, H, Dv); offsets: (B+1,) starts of q's sequences
    (and k/v's unless ``kv_offsets``). Returns (Tq, H, Dv) in q's dtype. See the README of
    issue 3 / docs for the semantics of each argument.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if activation != "softmax" and activation not in ACTIVATIONS:
        raise ValueError(f"activation must be 'softmax' or one of {sorted(ACTIVATIONS)}, got {activation!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be (T, H, D), got shape {tuple(t.shape)}")
    if offsets is not None:
        _validate_offsets("offsets", offsets, q.shape[0])
    if kv_offsets is not None:
        _validate_offsets("kv_offsets", kv_offsets, k.shape[0])
    if backend == "auto":
        backend = "triton" if q.is_cuda else "reference"
    if backend == "triton":
        from gemcore.kernels import jagged_attention_triton  # imported lazily: needs triton

        return jagged_attention_triton.jagged_attention_triton(
            q, k, v, offsets, kv_offsets=kv_offsets, activation=activation, causal=causal,
            scale=scale, norm=norm, num_targets=num_targets, window=window, max_seqlen=max_seqlen)
    return jagged_attention_reference(
        q, k, v, offsets, kv_offsets=kv_offsets, activation=activation, causal=causal, scale=scale,
        norm=norm, num_targets=num_targets, window=window, max_seqlen=max_seqlen)


def make_attention(config: Any, backend: str = "auto", activation: str | None = None):
    """Bind an :class:`gemcore.config.AttentionConfig` into the attention hook's callable."""
    act = activation or config.activation
    scale = config.scale or None
    norm = config.norm or None

    def attend(q, k, v, offsets, *, causal=True, num_targets=None, max_seqlen=None):
        return jagged_attention(q, k, v, offsets, activation=act, causal=causal, scale=scale,
                                norm=norm, num_targets=num_targets, max_seqlen=max_seqlen,
                                backend=backend)

    return attend
