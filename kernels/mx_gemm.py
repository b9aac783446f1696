"""Triton MX GEMMs: for GPUs without block-scaled matrix instructions (Hopper), and Blackwell's.

``C = A @ B`` with A: (M, K) MX blocked along K and B: (K, N) MX blocked along K, float32
accumulation, each mirroring :func:`mx_reference.mx_matmul_reference`.

* ``_mx_mm_dequant``: each tile's elements are multiplied by their block's scale in registers and
  converted to bf16, then a bf16 MMA accumulates in float32. Exact: an FP8 element times a power
  of two fits bf16 (8 significant bits) unless the product leaves bf16's normal range (scales
  beyond about 2^+-117), and bf16 products are exact in float32.
* ``_mx_mm_fp8``: the FP8 tensor cores multiply one 32-wide K block at a time; the partial product
  is scaled by 2^(Ea + Eb) and added to the float32 accumulator (the MX definition, step by step).
* ``_mx_mm_scaled``: ``tl.dot_scaled``, the block-scaled MMA that Blackwell's tensor cores run
  natively (the scales applied inside the MMA); Triton emulates it elsewhere. Checked in the
  interpreter and compiled for sm_100 ahead of time; no Blackwell GPU has run it.

The interpreter multiplies bf16 wrongly, so under ``TRITON_INTERPRET=1`` the dequant kernel is
run with ``DOT_DTYPE=tl.float32`` (same loads, scales and masks; only the MMA type differs).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gemcore.kernels.mx_triton import _TL_ELEM, _scale_factor


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped ordering of output tiles so neighbouring programs share A rows in L2."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * n_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    return pid_m, pid_n


@triton.jit
def _tile_rows_cols(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output rows (BLOCK_M,) and columns (BLOCK_N,), int64 (:func:`_tile_ids`)."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    return offs_m, offs_n


@triton.jit
def _store_tile(c_ptr, acc, offs_m, offs_n, M, N, stride_cm, stride_cn):
    """acc (BLOCK_M, BLOCK_N) float32 into C's rows offs_m and columns offs_n, in C's dtype."""
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _mx_mm_dequant(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K,
                   stride_am, stride_ak, stride_asm, stride_ask,
                   stride_bk, stride_bn, stride_bsk, stride_bsn, stride_cm, stride_cn,
                   A_ELEM: tl.constexpr, B_ELEM: tl.constexpr, DOT_DTYPE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr,
                   GROUP_M: tl.constexpr):
    """KB MX blocks (KB * 32 of K) per step."""
    offs_m, offs_n = _tile_rows_cols(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    kb = tl.arange(0, KB)
    j = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, 32), KB):
        # A: (BLOCK_M, KB, 32)
        ka = (k0 + kb)[None, :, None] * 32 + j[None, None, :]
        a = tl.load(a_ptr + offs_m[:, None, None] * stride_am + ka * stride_ak,
                    mask=(offs_m[:, None, None] < M) & (ka < K), other=0)
        sa = tl.load(as_ptr + offs_m[:, None] * stride_asm + (k0 + kb)[None, :] * stride_ask,
                     mask=(offs_m[:, None] < M) & ((k0 + kb)[None, :] * 32 < K), other=127)
        a = a.to(A_ELEM, bitcast=True).to(tl.float32) * _scale_factor(sa)[:, :, None]
        a = tl.reshape(a, (BLOCK_M, KB * 32)).to(DOT_DTYPE)
        # B: (KB, 32, BLOCK_N)
        kbb = (k0 + kb)[:, None, None] * 32 + j[None, :, None]
        b = tl.load(b_ptr + kbb * stride_bk + offs_n[None, None, :] * stride_bn,
                    mask=(kbb < K) & (offs_n[None, None, :] < N), other=0)
        sb = tl.load(bs_ptr + (k0 + kb)[:, None] * stride_bsk + offs_n[None, :] * stride_bsn,
                     mask=((k0 + kb)[:, None] * 32 < K) & (offs_n[None, :] < N), other=127)
        b = b.to(B_ELEM, bitcast=True).to(tl.float32) * _scale_factor(sb)[:, None, :]
        b = tl.reshape(b, (KB * 32, BLOCK_N)).to(DOT_DTYPE)
        acc = tl.dot(a, b, acc)
    _store_tile(c_ptr, acc, offs_m, offs_n, M, N, stride_cm, stride_cn)


@triton.jit
def _mx_mm_fp8(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K,
               stride_am, stride_ak, stride_asm, stride_ask,
               stride_bk, stride_bn, stride_bsk, stride_bsn, stride_cm, stride_cn,
               A_ELEM: tl.constexpr, B_ELEM: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """One 32-wide K block per step: FP8 MMA, then the partial times 2^(Ea + Eb) into acc."""
    offs_m, offs_n = _tile_rows_cols(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    j = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, 32)):
        k = kb * 32 + j
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=(k[:, None] < K) & (offs_n[None, :] < N), other=0)
        sa = tl.load(as_ptr + offs_m * stride_asm + kb * stride_ask, mask=offs_m < M, other=127)
        sb = tl.load(bs_ptr + kb * stride_bsk + offs_n * stride_bsn, mask=offs_n < N, other=127)
        partial = tl.dot(a.to(A_ELEM, bitcast=True), b.to(B_ELEM, bitcast=True))
        acc += partial * (_scale_factor(sa)[:, None] * _scale_factor(sb)[None, :])
    _store_tile(c_ptr, acc, offs_m, offs_n, M, N, stride_cm, stride_cn)


@triton.jit
def _mx_mm_scaled(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K,
                  stride_am, stride_ak, stride_asm, stride_ask,
                  stride_bk, stride_bn, stride_bsk, stride_bsn, stride_cm, stride_cn,
                  A_FORMAT: tl.constexpr, B_FORMAT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr, GROUP_M: tl.constexpr):
    """KB MX blocks per step through ``tl.dot_scaled`` (the block-scaled MMA: native on
    Blackwell, where the tensor cores apply the E8M0 scales; elsewhere Triton emulates it). Past
    K: elements 0 under scale byte 127 (1.0), so they add nothing."""
    offs_m, offs_n = _tile_rows_cols(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    kb = tl.arange(0, KB)
    k = tl.arange(0, KB * 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, 32), KB):
        ka = k0 * 32 + k
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + ka[None, :] * stride_ak,
                    mask=(offs_m[:, None] < M) & (ka[None, :] < K), other=0)
        b = tl.load(b_ptr + ka[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=(ka[:, None] < K) & (offs_n[None, :] < N), other=0)
        blocks = k0 + kb
        sa = tl.load(as_ptr + offs_m[:, None] * stride_asm + blocks[None, :] * stride_ask,
                     mask=(offs_m[:, None] < M) & (blocks[None, :] * 32 < K), other=127)
        # (BLOCK_N, KB): dot_scaled takes the rhs scales per output column
        sb = tl.load(bs_ptr + blocks[None, :] * stride_bsk + offs_n[:, None] * stride_bsn,
                     mask=(blocks[None, :] * 32 < K) & (offs_n[:, None] < N), other=127)
        acc = tl.dot_scaled(a, sa, A_FORMAT, b, sb, B_FORMAT, acc)
    _store_tile(c_ptr, acc, offs_m, offs_n, M, N, stride_cm, stride_cn)


#: default tiles: the fastest of `gem bench mx --sweep` on an H200 (2026-12-02); tests pin small ones
DEQUANT_TILE = dict(BLOCK_M=128, BLOCK_N=256, KB=2, GROUP_M=8, num_warps=8, num_stages=3)
FP8_TILE = dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, num_warps=8, num_stages=3)
#: ``tl.dot_scaled``'s tile: not tuned (no Blackwell GPU has run it)
SCALED_TILE = dict(BLOCK_M=128, BLOCK_N=128, KB=4, GROUP_M=8, num_warps=4, num_stages=3)


def _elem_name(data: torch.Tensor) -> str:
    return "e4m3" if data.dtype == torch.float8_e4m3fn else "e5m2"


def mx_matmul_triton(a_data, a_scale, b_data, b_scale, out_dtype=torch.bfloat16, kernel="dequant",
                     tile: dict | None = None) -> torch.Tensor:
    """a_data: (M, K) with a_scale (M, ceil(K/32)); b_data: (K, N) with b_scale (ceil(K/32), N).

    ``kernel``: ``"dequant"`` (bf16 MMA on dequantized tiles), ``"fp8"`` (FP8 MMA per K block) or
    ``"scaled"`` (``tl.dot_scaled``: Blackwell's block-scaled MMA).
    """
    M, K = a_data.shape
    N = b_data.shape[1]
    c = torch.empty((M, N), dtype=out_dtype, device=a_data.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    a8, b8 = a_data.view(torch.uint8), b_data.view(torch.uint8)
    common = (a8, a_scale, b8, b_scale, c, M, N, K, *a8.stride(), *a_scale.stride(), *b8.stride(),
              *b_scale.stride(), *c.stride())
    elems = dict(A_ELEM=_TL_ELEM[_elem_name(a_data)], B_ELEM=_TL_ELEM[_elem_name(b_data)])
    if kernel == "dequant":
        t = dict(DEQUANT_TILE, **(tile or {}))
        grid = (triton.cdiv(M, t["BLOCK_M"]) * triton.cdiv(N, t["BLOCK_N"]),)
        dot_dtype = tl.float32 if _interpreting() else tl.bfloat16
        _mx_mm_dequant[grid](*common, **elems, DOT_DTYPE=dot_dtype, **t)
    elif kernel == "fp8":
        t = dict(FP8_TILE, **(tile or {}))
        grid = (triton.cdiv(M, t["BLOCK_M"]) * triton.cdiv(N, t["BLOCK_N"]),)
        _mx_mm_fp8[grid](*common, **elems, **t)
    elif kernel == "scaled":
        t = dict(SCALED_TILE, **(tile or {}))
        grid = (triton.cdiv(M, t["BLOCK_M"]) * triton.cdiv(N, t["BLOCK_N"]),)
        _mx_mm_scaled[grid](*common, A_FORMAT=_elem_name(a_data), B_FORMAT=_elem_name(b_data), **t)
    else:
        raise ValueError(f"kernel must be 'dequant', 'fp8' or 'scaled', got {kernel!r}")
    return c
