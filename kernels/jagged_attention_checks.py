"""Input checks of jagged attention: static ones (shapes, dtypes, options) and value ones.

Static checks run in the public entry and are free under torch.compile. Value checks (offsets'
values, num_targets against lengths, max_seqlen against the longest sequence) read the device
once (a single host sync) and run inside the Triton custom op, or before the reference.
"""
from __future__ import annotations

import torch

from gemcore.kernels.jagged_attention_reference import ACTIVATIONS

BACKENDS = ("auto", "triton", "reference")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_static(q, k, v, offsets, kv_offsets, activation, causal, scale, norm, num_targets,
                 window, max_seqlen, backend) -> None:
    """Raise ValueError naming the argument for any problem visible without reading values."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if activation != "softmax" and activation not in ACTIVATIONS:
        raise ValueError(f"activation must be 'softmax' or one of {sorted(ACTIVATIONS)}, got {activation!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a (T, H, D) tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError(f"heads differ: q has {q.shape[1]}, k {k.shape[1]}, v {v.shape[1]}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k's head dim {k.shape[2]} differs from q's {q.shape[2]}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v has {v.shape[0]} tokens but k has {k.shape[0]}")
    for name, off in (("offsets", offsets), ("kv_offsets", kv_offsets)):
        if off is None:
            continue
        if not isinstance(off, torch.Tensor) or off.dim() != 1 or off.numel() < 1:
            raise ValueError(f"{name} must be a 1-D tensor of B+1 starts, got "
                             f"{tuple(off.shape) if isinstance(off, torch.Tensor) else type(off).__name__}")
        if off.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {off.dtype}")
        if off.device != q.device:
            raise ValueError(f"{name} is on {off.device} but q is on {q.device}")
    if offsets is None:
        if kv_offsets is None:
            raise ValueError("kv_offsets is required for pooled attention (offsets=None)")
        if causal:
            raise ValueError("causal applies to self-attention only; pooled attention (offsets=None) cannot be causal")
    elif kv_offsets is None:
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"self-attention needs as many k tokens as q tokens ({q.shape[0]}), got {k.shape[0]}; "
                             "pass kv_offsets for cross attention")
    else:
        if causal:
            raise ValueError("causal applies to self-attention only, but kv_offsets was given")
        if kv_offsets.numel() != offsets.numel():
            raise ValueError(f"kv_offsets has {kv_offsets.numel() - 1} sequences but offsets has "
                             f"{offsets.numel() - 1}")
    if num_targets is not None:
        if not causal or kv_offsets is not None:
            raise ValueError("num_targets applies to causal self-attention only (causal=True, no kv_offsets)")
        if not isinstance(num_targets, torch.Tensor) or num_targets.dim() != 1 or \
                num_targets.numel() != offsets.numel() - 1:
            raise ValueError(f"num_targets must be a (B,) = ({offsets.numel() - 1},) tensor, got "
                             f"{tuple(num_targets.shape) if isinstance(num_targets, torch.Tensor) else type(num_targets).__name__}")
        if num_targets.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"num_targets must be int32 or int64, got {num_targets.dtype}")
        if num_targets.device != q.device:
            raise ValueError(f"num_targets is on {num_targets.device} but q is on {q.device}")
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2 or not all(
                w is None or (isinstance(w, int) and not isinstance(w, bool)) for w in window):
            raise ValueError(f"window must be (left, right) ints or None, got {window!r}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a number, got {type(scale).__name__}")
    if norm is not None:
        if activation == "softmax":
            raise ValueError("norm applies to non-softmax activations only")
        if not isinstance(norm, (int, float)) or not norm > 0:
            raise ValueError(f"norm must be a positive number, got {norm!r}")
    if max_seqlen is not None and (not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool)
                                   or max_seqlen < 0):
        raise ValueError(f"max_seqlen must be a non-negative int, got {max_seqlen!r}")


def _summary(off: torch.Tensor) -> torch.Tensor:
    """[first, last, smallest step, largest step] as one int64 tensor."""
    off = off.to(torch.int64)
    steps = off.diff() if off.numel() > 1 else off.new_zeros(1)
    return torch.stack([off[0], off[-1], steps.min(), steps.max()])


def check_values(q, k, offsets, kv_offsets, num_targets, max_seqlen: int) -> int:
    """Check the offsets' values, num_targets and max_seqlen; one host sync.

    Returns ``max_seqlen``, resolved to the longest q or kv sequence when it is negative.
    """
    parts, names = [], []
    for name, off, total in (("offsets", offsets, q.shape[0]), ("kv_offsets", kv_offsets, k.shape[0])):
        if off is not None:
            parts.append(_summary(off))
            names.append((name, total))
    if num_targets is not None:
        lengths = offsets.to(torch.int64).diff()
        nt = num_targets.to(torch.int64)
        parts.append(torch.stack([nt.min(), (nt - lengths).max()]) if nt.numel() else
                     torch.zeros(2, dtype=torch.int64, device=nt.device))
    values = torch.cat(parts).tolist()
    longest = 0
    for idx, (name, total) in enumerate(names):
        first, last, smallest, largest = values[4 * idx: 4 * idx + 4]
        if first != 0:
            raise ValueError(f"{name} must start at 0, got {first}")
        if smallest < 0:
            raise ValueError(f"{name} must be non-decreasing")
        if last != total:
            raise ValueError(f"{name} must end at the number of tokens ({total}), got {last}")
        longest = max(longest, largest)
    if num_targets is not None:
        smallest, excess = values[4 * len(names):]
        if smallest < 0:
            raise ValueError(f"num_targets must be non-negative, got {smallest}")
        if excess > 0:
            raise ValueError(f"num_targets exceeds its sequence's length (by {excess} tokens)")
    if max_seqlen < 0:
        return longest
    if max_seqlen < longest:
        raise ValueError(f"max_seqlen ({max_seqlen}) is shorter than the longest sequence ({longest})")
    return max_seqlen
