"""Block-scaled FP8 (DeepSeek-V3's recipe) in plain PyTorch: the ground truth of the kernels.

DeepSeek-V3 (arXiv 2412.19437, section 3.3) trains with FP8 E4M3 operands in every GEMM:
activations and output gradients in 1x128 tiles (one scale per token per 128 channels), weights in
128x128 blocks, and the GEMM promotes each 128-wide K block's partial sum to float32, where the two
scales are applied.

Scales here are float32 powers of two: a block with largest magnitude ``amax`` gets the smallest
2^E with amax <= 448 * 2^E (E4M3's largest normal is 448 = 1.75 * 2^8), clamped to
E in [-126, 127] so that the scale is a normal float32. Nothing saturates, dividing by the scale is
exact, and an element times its scale is exact in float32 and in bf16's range. A block holding NaN
or +-Inf gets a NaN scale and NaN elements. An all-zero block gets 2^-126 and zero elements.
Inputs below float32's smallest normal (2^-126) are read as zero of the same sign, as GPUs that
flush subnormals do.

Elements are x / 2^E rounded to nearest, ties to even, on the E4M3 grid (subnormals included), the
same rounding as :func:`gemcore.kernels.mx_reference.round_to_elem`.
"""
from __future__ import annotations

import torch

from gemcore.kernels.mx_reference import FORMATS, pow2, round_to_elem

BLOCK = 128
E4M3 = FORMATS["e4m3"]
E_MIN, E_MAX = -126, 127


def block_exponent(amax: torch.Tensor) -> torch.Tensor:
    """E (int32) of blocks with finite largest magnitude ``amax`` >= 0: the smallest E with
    amax <= 1.75 * 2^(8 + E), clamped to [-126, 127]. frexp gives amax = m * 2^e, m in [0.5, 1)."""
    mantissa, exponent = torch.frexp(amax.to(torch.float64))
    e = exponent.to(torch.int32) - 1 - E4M3.emax + (mantissa > 0.875).to(torch.int32)
    e = torch.where(amax == 0, torch.full_like(e, E_MIN), e)
    return e.clamp(E_MIN, E_MAX)


def _quantize_blocks(blocks: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``blocks`` with the block's elements along ``dims`` -> (E4M3 elements, float32 scale
    with ``dims`` kept as size 1)."""
    blocks = torch.where(blocks.abs() < 2.0**-126, blocks * 0.0, blocks)  # subnormals -> signed zero
    amax = blocks.abs().amax(dim=dims, keepdim=True)
    bad = ~torch.isfinite(amax)
    e = block_exponent(torch.where(bad, 0.0, amax))
    scaled = blocks * pow2(-e, torch.float32)
    elems = round_to_elem(scaled, E4M3)
    elems = torch.where(bad, torch.nan, elems).to(E4M3.dtype)
    scale = torch.where(bad, torch.nan, pow2(e, torch.float32))
    return elems, scale


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, C), C a multiple of 128 -> (data (R, C) E4M3, scale (R, C/128) float32): 1x128 blocks."""
    R, C = x.shape
    blocks = x.to(torch.float32).reshape(R, C // BLOCK, BLOCK)
    elems, scale = _quantize_blocks(blocks, (2,))
    return elems.reshape(R, C), scale.reshape(R, C // BLOCK)


def quantize_square_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (R, C), both multiples of 128 -> (data (R, C) E4M3, scale (R/128, C/128)): 128x128 blocks."""
    R, C = w.shape
    blocks = w.to(torch.float32).reshape(R // BLOCK, BLOCK, C // BLOCK, BLOCK)
    elems, scale = _quantize_blocks(blocks, (1, 3))
    return elems.reshape(R, C), scale.reshape(R // BLOCK, C // BLOCK)


def dequantize_reference(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """data (R, C) times its blocks' scales; ``scale`` (R, C/128) for 1x128 blocks or
    (R/128, C/128) for 128x128 blocks. Exact in float32, then rounded once to ``dtype``."""
    R, C = data.shape
    rows_per_block = 1 if scale.shape[0] == R else BLOCK
    s = scale.to(torch.float32).repeat_interleave(rows_per_block, 0).repeat_interleave(BLOCK, 1)
    out = data.to(torch.float32) * s
    return out.to(dtype)


def fp8_block_mm_reference(a_data, a_scale, b_data, b_scale, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """a (M, K) in 1x128 blocks times b (N, K)^T in 1x128 or 128x128 blocks -> (M, N): both
    dequantized (exact), multiplied with float32 accumulation, rounded once to ``out_dtype``."""
    a = dequantize_reference(a_data, a_scale)
    b = dequantize_reference(b_data, b_scale)
    return (a @ b.t()).to(out_dtype)
