"""Triton MX GEMM through Blackwell's block-scaled MMA.

``C = A @ B`` with A: (M, K) MX blocked along K and B: (K, N) MX blocked along K, float32
accumulation, mirroring :func:`mx_reference.mx_matmul_reference`.

``_mx_mm_scaled``: ``tl.dot_scaled``, the block-scaled MMA that Blackwell's tensor cores run
natively (the scales applied inside the MMA); Triton emulates it elsewhere. Checked in the
interpreter and compiled for sm_100 ahead of time; no Blackwell GPU has run it. On Hopper the
default MX GEMM is the Triton dequantize plus cuBLAS bf16 (:func:`gemcore.kernels.mx.mx_matmul`,
backend ``"dequant_mm"``), the fastest exact path measured there.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl



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


#: ``tl.dot_scaled``'s tile: not tuned (no Blackwell GPU has run it); tests pin small ones
SCALED_TILE = dict(BLOCK_M=128, BLOCK_N=128, KB=4, GROUP_M=8, num_warps=4, num_stages=3)


def _elem_name(data: torch.Tensor) -> str:
    return "e4m3" if data.dtype == torch.float8_e4m3fn else "e5m2"


def mx_matmul_triton(a_data, a_scale, b_data, b_scale, out_dtype=torch.bfloat16,
                     tile: dict | None = None) -> torch.Tensor:
    """a_data: (M, K) with a_scale (M, ceil(K/32)); b_data: (K, N) with b_scale (ceil(K/32), N)
    -> (M, N) in ``out_dtype``, through ``tl.dot_scaled`` (``tile`` overrides :data:`SCALED_TILE`)."""
    M, K = a_data.shape
    N = b_data.shape[1]
    c = torch.empty((M, N), dtype=out_dtype, device=a_data.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    a8, b8 = a_data.view(torch.uint8), b_data.view(torch.uint8)
    t = dict(SCALED_TILE, **(tile or {}))
    grid = (triton.cdiv(M, t["BLOCK_M"]) * triton.cdiv(N, t["BLOCK_N"]),)
    _mx_mm_scaled[grid](a8, a_scale, b8, b_scale, c, M, N, K, *a8.stride(), *a_scale.stride(), *b8.stride(),
                        *b_scale.stride(), *c.stride(), A_FORMAT=_elem_name(a_data), B_FORMAT=_elem_name(b_data), **t)
    return c
