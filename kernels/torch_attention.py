"""Jagged attention on PyTorch's own ops: ``varlen_attn`` (FlashAttention-2 varlen) and
FlexAttention over the packed sequence. They are the torch-native peers that ``gem bench train``
compares gemcore's kernels against, reachable through the attention hook as ``varlen`` / ``flex``.

Both compute softmax attention only: neither op can run the pointwise activations (silu, gelu...)
with no normaliser that gemcore's GDPA kernels run (a FlexAttention ``score_mod`` changes the
scores before the softmax, never the softmax itself).

* :func:`varlen_attention`: ``torch.nn.attention.varlen.varlen_attn``, CUDA only, causal via
  ``window_size=(-1, 0)``. It has no per-sequence target mask, so with ``num_targets`` it runs
  plain causal attention over each whole sequence: a candidate sees the history, itself **and the
  earlier candidates of its sequence** (gemcore's mask hides the other candidates). History rows
  are exact.
* :func:`flex_attention_jagged`: FlexAttention on the packed sequence as one batch row
  (``(1, H, T, D)``) with a block mask holding the exact mask of
  :mod:`gemcore.kernels.jagged_attention_reference`: same sequence, causal, candidates see the
  history and themselves, left window measured from the candidates' clamped position. Compiled
  (``torch.compile(flex_attention, dynamic=True)``) by default; ``compiled=False`` runs torch's
  eager FlexAttention (any device, slow: for tests on CPU).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from gemcore.kernels.jagged_attention_reference import window_bounds

#: FlexAttention's block size; the packed sequence is padded to a multiple of it
FLEX_BLOCK = 128


def _check(q, k, v, offsets, num_targets) -> None:
    """ValueError naming the argument for shapes and dtypes the peers cannot take."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a (T, H, D) tensor")
    if not (q.shape == k.shape and q.shape[:2] == v.shape[:2]):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must share (T, H) "
                         "and q, k one head dim (self-attention)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError("offsets must be a 1-D tensor of B+1 sequence starts")
    if num_targets is not None and (not isinstance(num_targets, torch.Tensor)
                                    or num_targets.shape != (offsets.numel() - 1,)):
        raise ValueError(f"num_targets must be a (B,) = ({offsets.numel() - 1},) tensor")


# --------------------------------------------------------------------------- varlen_attn
def varlen_attention(q, k, v, offsets, *, causal: bool = True, num_targets=None, max_seqlen=None,
                     scale=None) -> torch.Tensor:
    """``varlen_attn`` over jagged q, k, v: (T, H, D) float16 / bfloat16 on CUDA, offsets (B+1,).

    causal: ``window_size=(-1, 0)``. ``num_targets`` is accepted and not applied (see the module
    doc: candidates also see earlier candidates). max_seqlen: the longest sequence (read from
    the offsets, one host sync, when None). Returns (T, H, D) in q's dtype.
    """
    _check(q, k, v, offsets, num_targets)
    if not q.is_cuda:
        raise ValueError(f"varlen attention runs torch's varlen_attn, which needs CUDA tensors; q is on {q.device}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"varlen attention (FlashAttention) needs float16 or bfloat16, got {q.dtype}")
    from torch.nn.attention.varlen import varlen_attn

    if max_seqlen is None:
        max_seqlen = int(offsets.diff().max()) if offsets.numel() > 1 else 0
    cu = offsets.to(torch.int32)
    with torch.autocast(q.device.type, enabled=False):
        return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale,
                           window_size=(-1, 0) if causal else (-1, -1))


# --------------------------------------------------------------------------- FlexAttention
def token_tables(offsets: torch.Tensor, num_targets, T: int, padded_len: int):
    """Per-token (sequence, position in it, history length) int32 tensors of length
    ``padded_len`` for ``T`` real tokens; padding tokens form one extra sequence of their own."""
    off = offsets.to(torch.int64)
    idx = torch.arange(padded_len, device=offsets.device)
    seq = torch.searchsorted(off[1:], idx, right=True)                       # B for padding rows
    starts = torch.cat([off[:-1], off.new_tensor([T])])
    lengths = torch.cat([off.diff(), off.new_tensor([padded_len - T])])
    nt = num_targets.to(torch.int64) if num_targets is not None else torch.zeros_like(lengths[:-1])
    history = lengths - torch.cat([nt, nt.new_zeros(1)])
    return seq.to(torch.int32), (idx - starts[seq]).to(torch.int32), history[seq].to(torch.int32)


def jagged_mask_mod(seq, pos, history, *, causal: bool, targets: bool, left: int, right: int):
    """FlexAttention mask_mod of gemcore's jagged mask over the packed sequence."""

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = seq[q_idx] == seq[kv_idx]
        if causal:
            allowed = allowed & (kv_idx <= q_idx)
        if targets:
            allowed = allowed & ((pos[kv_idx] < history[kv_idx]) | (q_idx == kv_idx))
        if left >= 0:
            q_pos = torch.minimum(pos[q_idx], history[q_idx]) if targets else pos[q_idx]
            allowed = allowed & (q_pos - pos[kv_idx] <= left)
        if right >= 0:
            allowed = allowed & (pos[kv_idx] - pos[q_idx] <= right)
        return allowed

    return mask_mod


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


class _MaskCache:
    """The last block mask and the (offsets, num_targets) tensors it was built for: the blocks of
    one model step share them, so the mask is built once a step, as a FlexAttention user does."""

    key: tuple = ()
    mask = None


_mask_cache = _MaskCache()


def flex_block_mask(offsets, num_targets, T: int, padded_len: int, *, causal: bool, window, compiled: bool):
    """The BlockMask of the jagged mask for a packed sequence of ``padded_len`` tokens."""
    from torch.nn.attention.flex_attention import create_block_mask

    left, right = window_bounds(window)
    key = (offsets, offsets._version, num_targets, None if num_targets is None else num_targets._version,
           T, padded_len, causal, left, right, compiled)
    if len(_mask_cache.key) == len(key) and all(a is b if isinstance(a, torch.Tensor) else a == b
                                                for a, b in zip(_mask_cache.key, key)):
        return _mask_cache.mask
    seq, pos, history = token_tables(offsets, num_targets, T, padded_len)
    mask_mod = jagged_mask_mod(seq, pos, history, causal=causal, targets=num_targets is not None,
                               left=left, right=right)
    mask = create_block_mask(mask_mod, None, None, padded_len, padded_len, device=offsets.device,
                             BLOCK_SIZE=FLEX_BLOCK, _compile=compiled)
    _mask_cache.key, _mask_cache.mask = key, mask
    return mask


def flex_attention_jagged(q, k, v, offsets, *, causal: bool = True, num_targets=None, window=None,
                          scale=None, compiled: bool = True) -> torch.Tensor:
    """FlexAttention (softmax) over jagged q, k, v: (T, H, D), offsets (B+1,), with gemcore's exact
    mask (causal, ``num_targets`` candidates, ``window=(left, right)``; see
    :mod:`gemcore.kernels.jagged_attention_reference`). Returns (T, H, Dv) in q's dtype."""
    _check(q, k, v, offsets, num_targets)
    if num_targets is not None and not causal:
        raise ValueError("num_targets applies to causal self-attention only (causal=True)")
    if offsets.device != q.device or (num_targets is not None and num_targets.device != q.device):
        raise ValueError(f"offsets and num_targets must be on q's device ({q.device})")
    T = q.shape[0]
    padded = max(FLEX_BLOCK, -(-T // FLEX_BLOCK) * FLEX_BLOCK)
    block_mask = flex_block_mask(offsets, num_targets, T, padded, causal=causal, window=window,
                                 compiled=compiled)

    def packed(x):  # (T, H, D) -> (1, H, padded, D)
        return F.pad(x, (0, 0, 0, 0, 0, padded - T)).transpose(0, 1).unsqueeze(0)

    if compiled:
        flex = _compiled_flex()
    else:
        from torch.nn.attention.flex_attention import flex_attention as flex
    with torch.autocast(q.device.type, enabled=False):
        out = flex(packed(q), packed(k), packed(v), block_mask=block_mask, scale=scale)
    return out[0, :, :T].transpose(0, 1)


# --------------------------------------------------------------------------- hook factories
def _softmax_only(config, name: str) -> None:
    if config.activation != "softmax":
        raise ValueError(f"attention.impl={name} computes softmax attention only; set "
                         f"attention.activation=softmax (got {config.activation!r})")


def make_varlen_attention(config):
    """The attention hook's callable for ``varlen`` (config.activation must be softmax)."""
    _softmax_only(config, "varlen")
    scale = config.scale or None

    def attend(q, k, v, offsets, *, causal=True, num_targets=None, max_seqlen=None):
        return varlen_attention(q, k, v, offsets, causal=causal, num_targets=num_targets,
                                max_seqlen=max_seqlen, scale=scale)

    return attend


def make_flex_attention(config, compiled: bool = True):
    """The attention hook's callable for ``flex`` (config.activation must be softmax)."""
    _softmax_only(config, "flex")
    scale = config.scale or None

    def attend(q, k, v, offsets, *, causal=True, num_targets=None, max_seqlen=None):
        return flex_attention_jagged(q, k, v, offsets, causal=causal, num_targets=num_targets,
                                     scale=scale, compiled=compiled)

    return attend
