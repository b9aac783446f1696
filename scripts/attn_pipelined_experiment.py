"""Device experiment: the jagged causal attention forward with its key loop software-pipelined by
hand (FlashAttention-3's intra-warpgroup overlap): the scores of key tile j+1 are issued
(``tl.dot``, an asynchronous wgmma on Hopper) before the softmax / activation of tile j, so the
tensor cores can work while the CUDA cores and the MUFU unit do the elementwise part.

Only the wholly visible key tiles change; the diagonal tiles keep gemcore's masked loop. Prints,
per variant, useful forward TFLOP/s on ANCHORS.md's dense95 / heavytail and max |diff| against
gemcore's kernel, which is timed before and after in the same process with varlen_attn.
Run on the GPU: ``python3 scripts/attn_pipelined_experiment.py [SECONDS]``.
"""
from __future__ import annotations

import itertools
import math
import sys
import time

import torch
import triton
import triton.language as tl

from attn_experiment_harness import sweep, workload_inputs  # the module beside this script
from gemcore.bench.timing import median_ms
from gemcore.kernels import jagged_attention
from gemcore.kernels.jagged_attention_triton_common import _act
from gemcore.kernels.jagged_attention_triton_fwd import _fwd_loop


@triton.jit
def _scores_to_p(s, m_i, l_i, acc, scale, qk_scale, ACTIVATION: tl.constexpr, FAST_ACT: tl.constexpr):
    """Softmax bookkeeping (or the activation) of one unmasked score tile."""
    if ACTIVATION == 0:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
    else:
        p = _act(s * scale, ACTIVATION, FAST_ACT)
    return p, m_i, l_i, acc


@triton.jit
def _pipe_fwd(Q, K, V, O, offsets, stride_t, stride_h, H, n_m_tiles, scale, qk_scale, inv_norm,
              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              ACTIVATION: tl.constexpr, PIPE: tl.constexpr, FAST_ACT: tl.constexpr):
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    m0 = (n_m_tiles - 1 - tl.program_id(1)) * BLOCK_M
    start = tl.load(offsets + b)
    q_len = (tl.load(offsets + b + 1) - start).to(tl.int32)
    if m0 >= q_len:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + (start + offs_m[:, None]) * stride_t + h * stride_h + offs_d[None, :],
                mask=offs_m[:, None] < q_len, other=0.0)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    # wholly visible key tiles: [0, f_hi)
    f_hi = tl.minimum((q_len // BLOCK_N) * BLOCK_N, ((m0 + 1) // BLOCK_N) * BLOCK_N)
    if m0 + BLOCK_M > q_len:
        f_hi = 0
    k_base = K + start * stride_t + h * stride_h
    v_base = V + start * stride_t + h * stride_h
    offs_n0 = tl.arange(0, BLOCK_N)
    if PIPE:
        if f_hi > 0:
            kt = tl.load(k_base + offs_n0[None, :] * stride_t + offs_d[:, None])
            s = tl.dot(q, kt)
            for n0 in range(0, f_hi - BLOCK_N, BLOCK_N):
                offs_n = n0 + offs_n0
                kt_next = tl.load(k_base + (offs_n + BLOCK_N)[None, :] * stride_t + offs_d[:, None])
                s_next = tl.dot(q, kt_next)  # issued before this tile's elementwise work
                v = tl.load(v_base + offs_n[:, None] * stride_t + offs_d[None, :])
                p, m_i, l_i, acc = _scores_to_p(s, m_i, l_i, acc, scale, qk_scale, ACTIVATION, FAST_ACT)
                acc = tl.dot(p.to(v.dtype), v, acc)
                s = s_next
            offs_n = (f_hi - BLOCK_N) + offs_n0
            v = tl.load(v_base + offs_n[:, None] * stride_t + offs_d[None, :])
            p, m_i, l_i, acc = _scores_to_p(s, m_i, l_i, acc, scale, qk_scale, ACTIVATION, FAST_ACT)
            acc = tl.dot(p.to(v.dtype), v, acc)
    else:
        for n0 in range(0, f_hi, BLOCK_N):
            offs_n = n0 + offs_n0
            kt = tl.load(k_base + offs_n[None, :] * stride_t + offs_d[:, None])
            v = tl.load(v_base + offs_n[:, None] * stride_t + offs_d[None, :])
            s = tl.dot(q, kt)
            p, m_i, l_i, acc = _scores_to_p(s, m_i, l_i, acc, scale, qk_scale, ACTIVATION, FAST_ACT)
            acc = tl.dot(p.to(v.dtype), v, acc)
    hi = tl.minimum(q_len, m0 + BLOCK_M)
    acc, m_i, l_i = _fwd_loop(acc, m_i, l_i, q, k_base, v_base, offs_m, f_hi, hi, stride_t,
                              stride_t, q_len, q_len, q_len, 0, 0, scale, qk_scale, D, D, D, D,
                              BLOCK_N, ACTIVATION, True, False, False, False, True, "tf32",
                              FAST_ACT)
    row_ok = offs_m < q_len
    if ACTIVATION == 0:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    else:
        acc = acc * inv_norm
    tl.store(O + (start + offs_m[:, None]) * stride_t + h * stride_h + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=row_ok[:, None])


def run_variant(q, k, v, offsets, max_len, act, cfg):
    BM, BN, warps, stages, pipe = cfg
    T, H, D = q.shape
    out = torch.empty_like(q)
    n_m = triton.cdiv(max_len, BM)
    scale = 1 / math.sqrt(D) if act == "softmax" else 1.0 / D

    def fn():
        _pipe_fwd[(offsets.numel() - 1) * H, n_m](
            q, k, v, out, offsets, q.stride(0), q.stride(1), H, n_m, scale,
            scale * 1.4426950408889634, 1.0 / max_len, D=D, BLOCK_M=BM, BLOCK_N=BN,
            ACTIVATION=0 if act == "softmax" else 1, PIPE=pipe, FAST_ACT=act != "softmax",
            num_warps=warps, num_stages=stages)
        return out
    return fn


def main() -> None:
    deadline = time.time() + float(sys.argv[1] if len(sys.argv) > 1 else 300)
    tiles = [(128, 32, 4, 4), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2)]
    for workload, act in (("dense95", "softmax"), ("dense95", "silu"), ("heavytail", "softmax")):
        q, k, v, offsets, max_len, flops, kw = workload_inputs(workload, act)
        kw["validate"] = False
        ref = jagged_attention(q, k, v, offsets, **kw)
        cur_ms = median_ms(lambda: jagged_attention(q, k, v, offsets, **kw))
        print(f"{workload} {act} gemcore kernel: {flops / cur_ms / 1e9:.0f} TFLOP/s", flush=True)
        if act == "softmax":
            from torch.nn.attention.varlen import varlen_attn
            off32 = offsets.to(torch.int32)
            ms = median_ms(lambda: varlen_attn(q, k, v, off32, off32, max_len, max_len,
                                               window_size=(-1, 0)))
            print(f"{workload} varlen_attn: {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        configs = [(*tile, pipe) for tile, pipe in itertools.product(tiles, (False, True))
                   if not (workload == "heavytail" and tile[1] == 128 and tile[3] == 2)]
        if not sweep(configs, lambda cfg: run_variant(q, k, v, offsets, max_len, act, cfg), ref, flops, deadline):
            return
        cur_ms = median_ms(lambda: jagged_attention(q, k, v, offsets, **kw))
        print(f"{workload} {act} gemcore kernel again: {flops / cur_ms / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
