"""Triton jagged attention forward: one program per (sequence, head, query tile).

Softmax keeps the running max and sum (online softmax) and stores the base-2 log-sum-exp for
the backward; other activations accumulate act(scale q.k) v and divide by norm at the end.
"""
from __future__ import annotations

import triton
import triton.language as tl

from gemcore.kernels.jagged_attention_triton_common import (
    _act,
    _allowed,
    _full_keys,
    _key_range,
    _part,
    _sequence,
)


@triton.jit
def _fwd_loop(acc, m_i, l_i, q, k_base, v_base, offs_m, lo, hi, stride_kt, stride_vt, q_len,
              kv_len, history, left, right, scale, qk_scale, D_QK: tl.constexpr, D_V: tl.constexpr,
              BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
              ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, MASKED: tl.constexpr,
              INPUT_PRECISION: tl.constexpr, FAST_ACT: tl.constexpr):
    """Key tiles [lo, hi) of one query tile; MASKED=False only for wholly visible tiles."""
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + offs_n0
        if MASKED:
            kt = tl.load(k_base + offs_n[None, :] * stride_kt + offs_dqk[:, None],
                         mask=(offs_n[None, :] < kv_len) & (offs_dqk[:, None] < D_QK), other=0.0)
            v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_dv[None, :],
                        mask=(offs_n[:, None] < kv_len) & (offs_dv[None, :] < D_V), other=0.0)
        else:
            kt = tl.load(k_base + offs_n[None, :] * stride_kt + offs_dqk[:, None],
                         mask=offs_dqk[:, None] < D_QK, other=0.0)
            v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_dv[None, :],
                        mask=offs_dv[None, :] < D_V, other=0.0)
        s = tl.dot(q, kt, input_precision=INPUT_PRECISION)
        if ACTIVATION == 0:
            s = s * qk_scale
            if MASKED:
                allowed = _allowed(offs_m[:, None], offs_n[None, :], q_len, kv_len, history,
                                   left, right, CAUSAL, HAS_TARGETS, HAS_LEFT, HAS_RIGHT)
                s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            m_i = m_new
        else:
            p = _act(s * scale, ACTIVATION, FAST_ACT)
            if MASKED:
                allowed = _allowed(offs_m[:, None], offs_n[None, :], q_len, kv_len, history,
                                   left, right, CAUSAL, HAS_TARGETS, HAS_LEFT, HAS_RIGHT)
                p = tl.where(allowed, p, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _jagged_attn_fwd(
    Q, K, V, O, LSE2, q_offsets, kv_offsets, num_targets,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    H, NQ_POOLED, n_m_tiles, scale, inv_norm, left, right,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACTIVATION: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, POOLED: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    FAST_ACT: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    m0 = (n_m_tiles - 1 - tl.program_id(1)) * BLOCK_M
    q_start, o_start, q_len, kv_start, kv_len, history = _sequence(
        b, q_offsets, kv_offsets, num_targets, NQ_POOLED, POOLED, HAS_TARGETS)
    if m0 >= q_len:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + (q_start + offs_m[:, None]) * stride_qt + h * stride_qh + offs_dqk[None, :],
                mask=(offs_m[:, None] < q_len) & (offs_dqk[None, :] < D_QK), other=0.0)
    k_base = K + kv_start * stride_kt + h * stride_kh
    v_base = V + kv_start * stride_vt + h * stride_vh
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634
    lo, hi = _key_range(m0, kv_len, history, left, right, BLOCK_M, BLOCK_N, CAUSAL, HAS_TARGETS,
                        HAS_LEFT, HAS_RIGHT)
    f_lo, f_hi = _full_keys(m0, lo, hi, q_len, kv_len, history, left, right, BLOCK_M, BLOCK_N,
                            CAUSAL, HAS_TARGETS, HAS_LEFT, HAS_RIGHT)
    for part in tl.static_range(3):
        p_lo, p_hi = _part(part, lo, f_lo, f_hi, hi)
        acc, m_i, l_i = _fwd_loop(
            acc, m_i, l_i, q, k_base, v_base, offs_m, p_lo, p_hi, stride_kt, stride_vt, q_len,
            kv_len, history, left, right, scale, qk_scale, D_QK, D_V, BLOCK_DQK, BLOCK_DV,
            BLOCK_N, ACTIVATION, CAUSAL, HAS_TARGETS, HAS_LEFT, HAS_RIGHT, part != 0,
            INPUT_PRECISION, FAST_ACT)
    row_ok = offs_m < q_len
    if ACTIVATION == 0:
        empty = l_i == 0.0
        acc = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse2 = tl.where(empty, float("inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
        tl.store(LSE2 + (o_start + offs_m) * H + h, lse2, mask=row_ok)
    else:
        acc = acc * inv_norm
    tl.store(O + (o_start + offs_m[:, None]) * stride_ot + h * stride_oh + offs_dv[None, :],
             acc.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < D_V))
