"""OCP Microscaling (MX v1.0) in plain PyTorch: the ground truth the Triton kernels are tested against.

A tensor is cut along one axis into blocks of ``block`` (= 32) elements; each block shares one E8M0
scale 2^E (stored as the biased byte E + 127) and holds FP8 elements x / 2^E.

* ``floor`` (the spec): E = floor(log2(amax)) - emax.
* ``rceil``: the smallest E with amax <= max_normal * 2^E (no element saturates).
* E is clamped to [-127, 127]. An all-zero block gets byte 0; a block holding NaN or +-Inf gets
  byte 0xFF and elements 0x7F (NaN in both element formats), and dequantizes to NaN throughout.
* Elements are x / 2^E rounded to nearest even in the element format (subnormals included),
  saturated to +-max_normal. The sign of zero is kept.
* The last block along the axis may be short.

Everything here is exact. The cast runs in float32 (float64 for float64 input): scaling by 2^-E
is exact except where the result falls below 2^-126, and such values round to (signed) zero either
way; dividing by the element quantum (a power of two) and ``torch.round`` (half to even) are exact.
Dequantizing multiplies an element (at most 4 significant bits) by 2^E in float32, which is exact
(or overflows to Inf exactly when the true value exceeds float32), then rounds once to the target.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK = 32
SCALE_NAN = 0xFF
ELEM_NAN = 0x7F  # NaN in float8_e4m3fn and in float8_e5m2


@dataclass(frozen=True)
class ElemFormat:
    """An FP8 element format. ``max_normal = 1.75 * 2^emax`` for both formats."""

    name: str
    dtype: torch.dtype
    mbits: int  # mantissa bits
    emax: int  # exponent of the largest normal
    emin: int  # exponent of the smallest normal
    bias: int
    max_normal: float


FORMATS = {
    "e4m3": ElemFormat("e4m3", torch.float8_e4m3fn, mbits=3, emax=8, emin=-6, bias=7, max_normal=448.0),
    "e5m2": ElemFormat("e5m2", torch.float8_e5m2, mbits=2, emax=15, emin=-14, bias=15, max_normal=57344.0),
}
SCALE_RULES = ("floor", "rceil")


def scale_exponent(amax: torch.Tensor, fmt: ElemFormat, scale_rule: str) -> torch.Tensor:
    """Shared exponent E (int32, clamped to [-127, 127]) of blocks with largest magnitude ``amax``.

    ``amax`` is finite and >= 0. frexp gives amax = m * 2^e with m in [0.5, 1), so
    floor(log2 amax) = e - 1; max_normal = 1.75 * 2^emax, so amax <= max_normal * 2^E first holds
    at E = e - 1 - emax, or one higher when 2m > 1.75.
    """
    mantissa, exponent = torch.frexp(amax.to(torch.float64))
    e = exponent.to(torch.int32) - 1 - fmt.emax
    if scale_rule == "rceil":
        e = e + (mantissa > 0.875).to(torch.int32)
    e = torch.where(amax == 0, torch.full_like(e, -127), e)
    return e.clamp(-127, 127)


def round_to_elem(y: torch.Tensor, fmt: ElemFormat) -> torch.Tensor:
    """Round ``y`` to nearest even on the element grid, saturating at +-max_normal.

    The grid spacing (quantum) of |y| is 2^(max(floor(log2|y|), emin) - mbits). Returns
    values that the element dtype holds exactly (sign of zero kept).
    """
    a = y.abs().clamp(max=fmt.max_normal)
    _, exponent = torch.frexp(a)
    quantum = pow2(torch.clamp(exponent - 1, min=fmt.emin) - fmt.mbits, y.dtype)
    rounded = torch.round(a / quantum) * quantum
    return torch.copysign(rounded, y)


def _blocks_last(x: torch.Tensor, block: int) -> torch.Tensor:
    """(..., L) -> (..., ceil(L / block), block), zero-padded."""
    length = x.shape[-1]
    nblocks = -(-length // block)
    pad = nblocks * block - length
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], nblocks, block)


def quantize_mx_reference(x: torch.Tensor, elem: str = "e4m3", block: int = BLOCK, axis: int = -1,
                          scale_rule: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """MX-quantize ``x`` along ``axis``. Returns ``(data, scale)``.

    data: x's shape, the element dtype; scale: uint8 biased exponents, x's shape with ``axis``
    ceil-divided by ``block``. Arguments are assumed valid (the public entry checks them).
    """
    fmt = FORMATS[elem]
    axis = axis % x.dim()
    moved = x.movedim(axis, -1).to(_compute_dtype(x.dtype))
    length = moved.shape[-1]
    blocks = _blocks_last(moved, block)
    amax = blocks.abs().amax(dim=-1)  # NaN propagates, Inf stays Inf
    bad = ~torch.isfinite(amax)
    e = scale_exponent(torch.where(bad, 0.0, amax), fmt, scale_rule)
    scaled = blocks * pow2(-e, blocks.dtype).unsqueeze(-1)
    elems = round_to_elem(scaled, fmt).to(fmt.dtype).view(torch.uint8)
    elems = torch.where(bad.unsqueeze(-1), torch.full_like(elems, ELEM_NAN), elems)
    scale = torch.where(bad, SCALE_NAN, e + 127).to(torch.uint8)
    data = elems.reshape(*elems.shape[:-2], blocks.shape[-2] * block)[..., :length].view(fmt.dtype)
    return data.movedim(-1, axis).contiguous(), scale.movedim(-1, axis).contiguous()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 input, else float32 (which holds every bf16/fp16/fp32 value)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def pow2(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2^e for integer ``e`` in [-127, 128], exact in ``dtype`` (2^-127 is a float32 subnormal)."""
    return torch.exp2(e.to(torch.float64)).to(dtype)


def scale_to_float(scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Biased E8M0 bytes -> 2^(byte - 127) in ``dtype`` (byte 0xFF -> NaN)."""
    value = pow2(scale.to(torch.int32) - 127, dtype)
    return torch.where(scale == SCALE_NAN, math.nan, value)


def dequantize_mx_reference(data: torch.Tensor, scale: torch.Tensor, block: int = BLOCK, axis: int = -1,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Elements times their block's scale, in ``dtype`` (exact in float32, then rounded once)."""
    axis = axis % data.dim()
    compute = _compute_dtype(dtype)
    s = scale_to_float(scale, compute).repeat_interleave(block, dim=axis).narrow(axis, 0, data.shape[axis])
    return (data.to(compute) * s).to(dtype)


def mx_matmul_reference(a_data, a_scale, b_data, b_scale, block: int = BLOCK,
                        out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(M, K) blocked along K times (K, N) blocked along K: dequantize, multiply in float32."""
    a = dequantize_mx_reference(a_data, a_scale, block, axis=1)
    b = dequantize_mx_reference(b_data, b_scale, block, axis=0)
    return (a @ b).to(out_dtype)
