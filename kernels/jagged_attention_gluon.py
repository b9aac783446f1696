"""Hopper forward of jagged self-attention in Gluon (Triton's low-level dialect), warp-specialized
as FlashAttention-3 describes it; the backward (``jagged_attention_gluon_bwd`` on Hopper, else the
Triton kernels) reads this forward's output and base-2 log-sum-exp in the Triton forward's layout.

Persistent: one CTA per SM loops over work items (sequence, head, 128 query rows), heaviest query
tiles first, so one item's epilogue overlaps the next one's loads:
- a producer warp loads an item's query tile (once the consumers' last Q·Kᵀ of the item before
  is done) and its key/value tiles through TMA into a ring of slots
  (sizes per activation kind in ``TILES``), signalled by mbarriers (keys and values separately);
- two consumer warpgroups own 64 query rows each and share the ring (a slot is free once both
  have released it); they are otherwise unsynchronized, so one's activation overlaps the other's
  wgmmas;
- inside a consumer, Q·K_{j+1}ᵀ and P_j·V_j go out as asynchronous wgmmas and tile j+1's
  activation runs while P_j·V_j is on the tensor cores.

TMA reads whole tiles: rows past a sequence's end belong to the next sequence (zeros past T), and
meet only masked scores or masked stores. Scope (:func:`unsupported_reason` says what is not
covered; the Triton forward takes those): self-attention, causal (with or without targets) or
full, every activation, bf16 / fp16, head dim 64 or 128 for q, k and v, no window; q, k, v with
heads packed in rows (contiguous, or views of a fused qkv projection).
Needs an sm_90 GPU and a Triton with Gluon's Hopper ops (3.6 and 3.9 checked).
"""
from __future__ import annotations

import functools
import math
import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gemcore.kernels.jagged_attention_triton_common import ACTIVATION_CODES
from gemcore.kernels.jagged_work_list import cached_lists
from gemcore.kernels.kernel_launch import LaunchCache

# Triton 3.6 names the TMA load async_copy_global_to_shared; later versions async_load
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

BLOCK_M = 128                    #: query rows per CTA: two consumer warpgroups of 64
#: activation kind -> (key rows per tile, K/V ring slots), from the H200 sweep
#: of key tile and ring depth: softmax 128 x 3 (404 against 379 TFLOP/s for
#: 64 x 4 on dense95), the pointwise activations 64 x 4 (412 against 403 for 128 x 3)
TILES = {"softmax": (128, 3), "pointwise": (64, 4)}
_BLOCK_M = gl.constexpr(BLOCK_M)
_CONSUMER_REGS, _PRODUCER_REGS = gl.constexpr(240), gl.constexpr(24)
#: per-thread register cap of the whole kernel: two consumer warpgroups and the producer's share
#: the SM's 64 Ki registers; the default partition gets what the workers leave
MAXNREG = 168
#: the Triton forward is kept for short histories: mean length below these, per activation kind.
#: Measured on the H200 at mean 494 (heavytail) and 1945 (dense95): both kinds gain at both (silu
#: at 494: +3 %). Below 494 not measured.
MIN_MEAN_LEN = {"softmax": 256, "pointwise": 256}
HEAD_DIMS = (64, 128)
_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@gluon.jit
def _tanh_fast(x):
    """Hardware tanh (one MUFU op, ~2^-11 absolute error: below 16-bit rounding)."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _pointwise_and_grad(x, ACTIVATION: gl.constexpr):
    """(act(x), act'(x)) of the non-softmax activations, codes as ACTIVATION_CODES (x float32): the
    one Gluon definition of their math, the Gluon forward's and backward's; a caller that uses one
    of the two leaves the other to dead-code elimination."""
    if ACTIVATION == 1:                            # silu; sigmoid(x) = (1 + tanh(x/2)) / 2
        sg = 0.5 + 0.5 * _tanh_fast(0.5 * x)
        y = x * sg
        g = sg + y * (1.0 - sg)
    elif ACTIVATION == 2:                          # gelu, erf form
        cdf = 0.5 * (1.0 + gl.erf(x * 0.7071067811865476))
        y = x * cdf
        g = cdf + x * 0.3989422804014327 * gl.exp(-0.5 * x * x)
    elif ACTIVATION == 3:                          # gelu, tanh form: x·sg, sg = (1 + tanh u) / 2
        sg = 0.5 + 0.5 * _tanh_fast(0.7978845608028654 * (x + 0.044715 * x * x * x))
        y = x * sg
        g = sg + y * 2.0 * (1.0 - sg) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    elif ACTIVATION == 4:
        y = gl.maximum(x, 0.0)
        g = gl.where(x > 0.0, 1.0, 0.0)
    elif ACTIVATION == 5:
        r = gl.maximum(x, 0.0)
        y = r * r
        g = 2.0 * r
    else:
        y = x
        g = gl.full(x.shape, 1.0, gl.float32, x.type.layout)
    return y, g


@gluon.jit
def _sequence(offsets, num_targets, b, HAS_TARGETS: gl.constexpr):
    """(start, seq_len, history) of sequence b; its rows from ``history`` on are candidates."""
    start = gl.load(offsets + b).to(gl.int32)
    seq_len = gl.load(offsets + b + 1).to(gl.int32) - start
    history = seq_len
    if HAS_TARGETS:
        history = seq_len - gl.load(num_targets + b).to(gl.int32)
    return start, seq_len, history


@gluon.jit
def _key_tiles(m0, seq_len, history, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(n_full, n_tiles) of query rows [m0, m0 + BLOCK_M): key tiles below n_full are visible to
    every row whole; the rest, up to the diagonal (causal; with targets a candidate's own key lies
    past the history) or the sequence's end, are masked."""
    if CAUSAL:
        n_full = gl.minimum(m0, history) // BLOCK_N
        n_tiles = gl.cdiv(gl.minimum(m0 + BLOCK_M, seq_len), BLOCK_N)
    else:
        n_full = seq_len // BLOCK_N
        n_tiles = gl.cdiv(seq_len, BLOCK_N)
    return n_full, n_tiles


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr):
    """(first_ready, second_ready, empty), STAGES mbarriers each, initialised: a ring slot's two
    TMA loads signal on the ready ones; both consumer warpgroups release it on empty (count 2)."""
    first_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    second_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(first_ready.index(i), count=1)
        mbarrier.init(second_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    return first_ready, second_ready, empty


@gluon.jit
def _stream_tiles(a_desc, b_desc, a_ring, b_ring, a_ready, b_ready, empty, first_row, n_tiles, col, base):
    """Producer loop: tiles j = 0 .. n_tiles-1 of rows [first_row + j·R, +R) (R the ring's tile
    rows), columns [col, col + D), from both descriptors into ring slot (base + j) % STAGES (base:
    tiles streamed before, by earlier work items), each signalled on its ready barrier once the
    slot's previous tile was released on ``empty``."""
    STAGES: gl.constexpr = a_ring.type.shape[0]
    ROWS: gl.constexpr = a_ring.type.shape[1]
    for j in range(n_tiles):
        stage = (base + j) % STAGES
        mbarrier.wait(empty.index(stage), (((base + j) // STAGES) & 1) ^ 1)   # fresh barriers: passes
        row = first_row + j * ROWS
        mbarrier.expect(a_ready.index(stage), a_desc.block_type.nbytes)
        _tma_load(a_desc, [row, col], a_ready.index(stage), a_ring.index(stage))
        mbarrier.expect(b_ready.index(stage), b_desc.block_type.nbytes)
        _tma_load(b_desc, [row, col], b_ready.index(stage), b_ring.index(stage))


@gluon.jit
def _allowed(rows, keys, seq_len, history, CAUSAL: gl.constexpr, HAS_TARGETS: gl.constexpr):
    """Which (row, key) pairs attend, for broadcastable index tensors: causal, key <= row, and
    with targets (key < history or key == row): rows from ``history`` on are candidates; full,
    key < seq_len. Rows past seq_len are the caller's to mask."""
    if CAUSAL:
        allowed = keys <= rows
        if HAS_TARGETS:
            allowed = allowed & ((keys < history) | (keys == rows))
    else:
        allowed = (keys < seq_len) & (rows >= 0)
    return allowed


@gluon.jit
def _activate(s, j, rows, seq_len, history, m_i, l_i, n_full, qk_scale, ACTIVATION: gl.constexpr,
              CAUSAL: gl.constexpr, HAS_TARGETS: gl.constexpr, BLOCK_N: gl.constexpr,
              s_layout: gl.constexpr):
    """Scores (64, BLOCK_N) of key tile j -> (p, m_i, l_i, alpha). Softmax: online, base 2
    (``qk_scale`` = scale·log2 e > 0; m_i in scaled units; alpha rescales the accumulator).
    Others: act(scale·s), masked (``qk_scale`` = scale; m_i, l_i, alpha unused). Tiles from
    n_full on are masked (:func:`_allowed`). The scale goes into one fused multiply-add per score
    where it can (the activation's arithmetic is what limits this kernel beside the wgmmas)."""
    keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    allowed = _allowed(rows[:, None], keys[None, :], seq_len, history, CAUSAL, HAS_TARGETS)
    if ACTIVATION == 0:
        if j >= n_full:
            s = gl.where(allowed, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)   # = the max of the scaled scores
        m_use = m_new
        if HAS_TARGETS:    # a candidate sees no key in the tiles between the history and itself
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * qk_scale - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
    else:
        if ACTIVATION == 1:    # silu(x) = x sigmoid(x) = h + h tanh(h), h = x / 2
            half = s * (0.5 * qk_scale)
            p = half + half * _tanh_fast(half)
        else:
            p, _ = _pointwise_and_grad(s * qk_scale, ACTIVATION)
        if j >= n_full:
            p = gl.where(allowed, p, 0.0)
        alpha = m_i
    return p, m_i, l_i, alpha


@gluon.jit
def _dealt(r):
    """This CTA's work index in dealing round r: a snake over the P CTAs (CTA p takes p in round
    0, 2P - 1 - p in round 1, ...), so the costliest-first list lands evenly."""
    p = gl.program_id(0)
    n_ctas = gl.num_programs(0)
    i = p
    if r % 2 == 1:
        i = n_ctas - 1 - p
    return r * n_ctas + i


@gluon.jit
def _listed(work, w, H, n_seq, num_targets, HAS_TARGETS: gl.constexpr):
    """Work index w -> (t, b, h, start, seq_len, history): entry w // H of the list
    (:mod:`jagged_work_list`: (t·B + b, b's start, b's length), tile t of sequence b, B = n_seq),
    head w % H."""
    entry = w // H
    pair = gl.load(work + 3 * entry)
    start = gl.load(work + 3 * entry + 1)
    seq_len = gl.load(work + 3 * entry + 2)
    b = pair % n_seq
    history = seq_len
    if HAS_TARGETS:
        history = seq_len - gl.load(num_targets + b).to(gl.int32)
    return pair // n_seq, b, w % H, start, seq_len, history


@gluon.jit
def _work_item(w, work, n_seq, kv_offsets, num_targets, H, CAUSAL: gl.constexpr,
               HAS_TARGETS: gl.constexpr, CROSS: gl.constexpr, BLOCK_N: gl.constexpr):
    """Work index w of the list (:func:`_listed`) -> (h, m0, start, seq_len, kv_start, kv_len,
    history, n_full, n_tiles): query rows [m0, m0 + 128) of head h against the key rows
    [kv_start, kv_start + kv_len) (its own sequence's, or with CROSS the kv sequence's)."""
    t, b, h, start, seq_len, history = _listed(work, w, H, n_seq, num_targets, HAS_TARGETS)
    m0 = t * _BLOCK_M
    kv_start = start
    kv_len = seq_len
    if CROSS:
        kv_start, kv_len, _ = _sequence(kv_offsets, num_targets, b, False)
    n_full, n_tiles = _key_tiles(m0, kv_len, history, _BLOCK_M, BLOCK_N, CAUSAL)
    return h, m0, start, seq_len, kv_start, kv_len, history, n_full, n_tiles


@gluon.jit
def _store_no_keys(wg: gl.constexpr, O, LSE2, start, seq_len, m0, h, H, stride_t, ACTIVATION: gl.constexpr,
                   D: gl.constexpr):
    """Query rows [m0 + 64·wg, +64) that meet no key: output zeros and, softmax, LSE +inf (so the
    backward's probabilities are 0), as the Triton forward writes them."""
    io: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = m0 + wg * (_BLOCK_M // 2) + gl.arange(0, _BLOCK_M // 2, layout=gl.SliceLayout(1, io))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, io))
    gl.store(O + h * D + (start + rows)[:, None] * stride_t + cols[None, :],
             gl.zeros([_BLOCK_M // 2, D], O.dtype.element_ty, io), mask=(rows < seq_len)[:, None])
    if ACTIVATION == 0:
        gl.store(LSE2 + (start + rows) * H + h, gl.full([_BLOCK_M // 2], float("inf"), gl.float32,
                                                        gl.SliceLayout(1, io)), mask=rows < seq_len)


@gluon.jit
def _attend(wg: gl.constexpr, q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, v_ready, kv_empty, O, LSE2,
            start, seq_len, kv_len, history, m0, h, H, stride_t, qk_scale, inv_norm, n_full, n_tiles, base, item,
            ACTIVATION: gl.constexpr, CAUSAL: gl.constexpr, HAS_TARGETS: gl.constexpr):
    """One warpgroup, one work item: query rows [m0 + 64·wg, +64) (of seq_len) against key tiles
    0..n_tiles-1 (of kv_len keys), which sit in ring slots from ``base`` on (``item``: the CTA's
    items before). Causal, the first warpgroup's rows end 64 rows before the diagonal tile does,
    so it takes only the keys it can see: with 64-key tiles it skips the last tile, with 128-key
    tiles it takes the last tile's first half alone (``HALF``)."""
    WG_M: gl.constexpr = _BLOCK_M // 2
    STAGES: gl.constexpr = k_ring.type.shape[0]
    BLOCK_N: gl.constexpr = k_ring.type.shape[1]
    D: gl.constexpr = k_ring.type.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    TRIM: gl.constexpr = CAUSAL and wg == 0
    HALF: gl.constexpr = TRIM and BLOCK_N == 2 * WG_M
    q_w = q_smem.index(wg)
    rows = m0 + wg * WG_M + gl.arange(0, WG_M, layout=gl.SliceLayout(1, s_layout))
    n_main = n_tiles                               # whole key tiles taken
    if TRIM:
        if HALF:
            n_main = n_tiles - 1
        else:
            n_main = gl.minimum(n_tiles, gl.cdiv(m0 + WG_M, BLOCK_N))
    last = base + n_tiles - 1

    m_i = gl.full([WG_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([WG_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([WG_M, D], gl.float32, o_layout)
    mbarrier.wait(q_bar, item & 1)
    if n_main > 0:
        mbarrier.wait(k_ready.index(base % STAGES), (base // STAGES) & 1)
        s = warpgroup_mma(q_w, k_ring.index(base % STAGES).permute((1, 0)),
                          gl.zeros([WG_M, BLOCK_N], gl.float32, s_layout), use_acc=False)
        p, m_i, l_i, alpha = _activate(s, 0, rows, kv_len, history, m_i, l_i, n_full, qk_scale, ACTIVATION,
                                       CAUSAL, HAS_TARGETS, BLOCK_N, s_layout)
        for j in range(n_main - 1):
            nxt = base + j + 1
            mbarrier.wait(k_ready.index(nxt % STAGES), (nxt // STAGES) & 1)
            # (the zeros made here, not hoisted: a loop-carried zero tile would hold BLOCK_N / 2
            # registers per thread for nothing)
            s_tok = warpgroup_mma(q_w, k_ring.index(nxt % STAGES).permute((1, 0)),
                                  gl.zeros([WG_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
            stage = (base + j) % STAGES
            mbarrier.wait(v_ready.index(stage), ((base + j) // STAGES) & 1)
            o_tok = warpgroup_mma(gl.convert_layout(p.to(k_ring.dtype), p_layout), v_ring.index(stage), acc,
                                  is_async=True)
            s = warpgroup_mma_wait(1, deps=[s_tok])    # Q·K_{j+1}ᵀ is done; P_j·V_j may still run ...
            # ... under tile j+1's activation
            p, m_i, l_i, alpha = _activate(s, j + 1, rows, kv_len, history, m_i, l_i, n_full, qk_scale,
                                           ACTIVATION, CAUSAL, HAS_TARGETS, BLOCK_N, s_layout)
            acc = warpgroup_mma_wait(0, deps=[o_tok])
            mbarrier.arrive(kv_empty.index(stage), count=1)
            if ACTIVATION == 0:
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        if not HALF:
            mbarrier.arrive(q_empty, count=1)     # every Q·Kᵀ is done: the producer may load the next Q
        tail = base + n_main - 1
        mbarrier.wait(v_ready.index(tail % STAGES), (tail // STAGES) & 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(k_ring.dtype), p_layout), v_ring.index(tail % STAGES), acc)
        mbarrier.arrive(kv_empty.index(tail % STAGES), count=1)
    if HALF:                                       # the diagonal tile's first 64 keys
        h_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, WG_M, 16])
        h_rows: gl.constexpr = gl.SliceLayout(1, h_layout)
        mbarrier.wait(k_ready.index(last % STAGES), (last // STAGES) & 1)
        s = warpgroup_mma(q_w, k_ring.index(last % STAGES).slice(0, WG_M).permute((1, 0)),
                          gl.zeros([WG_M, WG_M], gl.float32, h_layout), use_acc=False)
        mbarrier.arrive(q_empty, count=1)
        p, m_h, l_h, alpha = _activate(s, 2 * (n_tiles - 1), m0 + gl.arange(0, WG_M, layout=h_rows), kv_len,
                                       history, gl.convert_layout(m_i, h_rows), gl.convert_layout(l_i, h_rows),
                                       2 * n_full, qk_scale, ACTIVATION, CAUSAL, HAS_TARGETS, WG_M, h_layout)
        m_i = gl.convert_layout(m_h, gl.SliceLayout(1, s_layout))
        l_i = gl.convert_layout(l_h, gl.SliceLayout(1, s_layout))
        if ACTIVATION == 0:
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(k_ring.dtype), p_layout),
                            v_ring.index(last % STAGES).slice(0, WG_M), acc)
        mbarrier.arrive(kv_empty.index(last % STAGES), count=1)
    elif TRIM:
        if n_main < n_tiles:                       # the skipped tile: released once it has landed
            mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
            mbarrier.arrive(kv_empty.index(last % STAGES), count=1)

    o_rows = m0 + wg * WG_M + gl.arange(0, WG_M, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    if ACTIVATION == 0:
        acc = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
        gl.store(LSE2 + (start + rows) * H + h, m_i + gl.log2(l_i), mask=rows < seq_len)
    else:
        acc = acc * inv_norm
    gl.store(O + h * D + (start + o_rows)[:, None] * stride_t + cols[None, :],
             acc.to(O.dtype.element_ty), mask=(o_rows < seq_len)[:, None])


@gluon.jit
def _consumer(wg: gl.constexpr, q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, v_ready, kv_empty, O, LSE2,
              kv_offsets, num_targets, stride_t, H, work, n_listed, n_seq, qk_scale, inv_norm,
              ACTIVATION: gl.constexpr, CAUSAL: gl.constexpr, HAS_TARGETS: gl.constexpr, CROSS: gl.constexpr):
    """One warpgroup: its 64 query rows of every work item of this CTA (:func:`_attend`)."""
    BLOCK_N: gl.constexpr = k_ring.type.shape[1]
    base = 0
    item = 0
    n_work = gl.load(n_listed) * H
    for r in range(gl.cdiv(n_work, gl.num_programs(0))):
        w = _dealt(r)
        if w < n_work:
            h, m0, start, seq_len, kv_start, kv_len, history, n_full, n_tiles = _work_item(
                w, work, n_seq, kv_offsets, num_targets, H, CAUSAL, HAS_TARGETS, CROSS, BLOCK_N)
            has_keys = True
            if CROSS:                              # (self-attention: every row sees a key)
                if n_tiles == 0:                   # an empty kv sequence
                    _store_no_keys(wg, O, LSE2, start, seq_len, m0, h, H, stride_t, ACTIVATION,
                                   k_ring.type.shape[2])
                has_keys = n_tiles > 0
            if has_keys:
                _attend(wg, q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, v_ready, kv_empty, O, LSE2, start,
                        seq_len, kv_len, history, m0, h, H, stride_t, qk_scale, inv_norm, n_full, n_tiles, base,
                        item, ACTIVATION, CAUSAL, HAS_TARGETS)
                base += n_tiles
                item += 1


@gluon.jit
def _second_consumer(q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, v_ready, kv_empty, q_desc, k_desc, v_desc,
                     O, LSE2, kv_offsets, num_targets, stride_t, H, work, n_listed, n_seq, qk_scale, inv_norm,
                     ACTIVATION: gl.constexpr, CAUSAL: gl.constexpr, HAS_TARGETS: gl.constexpr,
                     CROSS: gl.constexpr):
    """Worker partition: the consumer of query rows 64..127 (workers share one signature)."""
    _consumer(1, q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, v_ready, kv_empty, O, LSE2, kv_offsets,
              num_targets, stride_t, H, work, n_listed, n_seq, qk_scale, inv_norm, ACTIVATION, CAUSAL, HAS_TARGETS,
              CROSS)


@gluon.jit
def _producer(q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, v_ready, kv_empty, q_desc, k_desc, v_desc,
              O, LSE2, kv_offsets, num_targets, stride_t, H, work, n_listed, n_seq, qk_scale, inv_norm,
              ACTIVATION: gl.constexpr, CAUSAL: gl.constexpr, HAS_TARGETS: gl.constexpr, CROSS: gl.constexpr):
    """Worker partition, one warp: for each work item that meets keys, both query halves (once
    the consumers are done with the last ones), then its key/value tiles."""
    BLOCK_N: gl.constexpr = k_ring.type.shape[1]
    D: gl.constexpr = k_ring.type.shape[2]
    base = 0
    item = 0
    n_work = gl.load(n_listed) * H
    for r in range(gl.cdiv(n_work, gl.num_programs(0))):
        w = _dealt(r)
        if w < n_work:
            h, m0, start, seq_len, kv_start, kv_len, history, n_full, n_tiles = _work_item(
                w, work, n_seq, kv_offsets, num_targets, H, CAUSAL, HAS_TARGETS, CROSS, BLOCK_N)
            if n_tiles > 0:                        # (only cross attention's empty kv sequences have none)
                col = h * D
                mbarrier.wait(q_empty, (item & 1) ^ 1)     # fresh barrier: passes
                mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
                _tma_load(q_desc, [start + m0, col], q_bar, q_smem.index(0))
                _tma_load(q_desc, [start + m0 + _BLOCK_M // 2, col], q_bar, q_smem.index(1))
                _stream_tiles(k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, kv_empty, kv_start, n_tiles, col,
                              base)
                base += n_tiles
                item += 1


@gluon.jit
def _jagged_attn_fwd_hopper(q_desc, k_desc, v_desc, O, LSE2, kv_offsets, num_targets, stride_t, H, work,
                            n_listed, n_seq, qk_scale, inv_norm, STAGES: gl.constexpr, ACTIVATION: gl.constexpr,
                            CAUSAL: gl.constexpr, HAS_TARGETS: gl.constexpr, CROSS: gl.constexpr,
                            PERSISTENT: gl.constexpr):
    """Work items: the first n_listed entries of ``work`` (:mod:`jagged_work_list`: t·B + b,
    costliest first; B = n_seq) times H heads, dealt to the P CTAs in a snake (:func:`_dealt`).
    Persistent: P is the SM count and a consumer's epilogue overlaps the next item's loads; else
    P covers every possible item and a CTA past the list returns at once.
    Descriptors over the (T, H·D) views, blocks (64, D) for q and (BLOCK_N, D) for k and v;
    O (T, H, D) contiguous; LSE2 (T, H) float32, softmax only; q's sequences come from the list;
    kv_offsets (B+1,) of k's and v's, read only when CROSS (not causal); num_targets (B,) int64,
    read only when HAS_TARGETS (causal)."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    gl.static_assert(_BLOCK_M % BLOCK_N == 0)
    gl.static_assert(not (CROSS and CAUSAL))
    if PERSISTENT:
        active = True
    else:
        active = gl.program_id(0) < gl.load(n_listed) * H
    if active:
        _launch_partitions(q_desc, k_desc, v_desc, O, LSE2, kv_offsets, num_targets, stride_t, H, work,
                           n_listed, n_seq, qk_scale, inv_norm, STAGES, ACTIVATION, CAUSAL, HAS_TARGETS, CROSS)


@gluon.jit
def _launch_partitions(q_desc, k_desc, v_desc, O, LSE2, kv_offsets, num_targets, stride_t, H, work, n_listed,
                       n_seq, qk_scale, inv_norm, STAGES: gl.constexpr, ACTIVATION: gl.constexpr,
                       CAUSAL: gl.constexpr, HAS_TARGETS: gl.constexpr, CROSS: gl.constexpr):
    """Shared memory, barriers and the three partitions of :func:`_jagged_attn_fwd_hopper`."""
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(q_empty, count=2)
    k_ready, v_ready, kv_empty = _ring_barriers(STAGES)
    # the argument tuples are written out: a tuple bound to a name first loses its constexprs
    gl.warp_specialize([
        (_consumer, (0, q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, v_ready, kv_empty, O, LSE2,
                     kv_offsets, num_targets, stride_t, H, work, n_listed, n_seq, qk_scale, inv_norm, ACTIVATION,
                     CAUSAL, HAS_TARGETS, CROSS)),
        (_second_consumer, (q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, v_ready, kv_empty, q_desc, k_desc,
                            v_desc, O, LSE2, kv_offsets, num_targets, stride_t, H, work, n_listed, n_seq,
                            qk_scale, inv_norm, ACTIVATION, CAUSAL, HAS_TARGETS, CROSS)),
        (_producer, (q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, v_ready, kv_empty, q_desc, k_desc, v_desc,
                     O, LSE2, kv_offsets, num_targets, stride_t, H, work, n_listed, n_seq, qk_scale, inv_norm,
                     ACTIVATION, CAUSAL, HAS_TARGETS, CROSS)),
    ], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])


# --------------------------------------------------------------------------- host side
#: the forward's compiled binaries, launched without the JIT's per-call binding (kernel_launch)
_FWD_LAUNCHES = LaunchCache(_jagged_attn_fwd_hopper)
#: launch options of every Hopper attention kernel
_OPTIONS = dict(num_warps=4, maxnreg=MAXNREG)


def unsupported_reason(q, k, v, offsets, kv_offsets, num_targets, causal: bool, window_left: int,
                       window_right: int) -> str | None:
    """Why this forward cannot take these inputs (None: it can), device aside."""
    if offsets is None:
        return "pooled attention"
    if kv_offsets is not None:
        if causal:
            return "causal cross attention"
        if k.shape[0] == 0:
            return "no keys"
    if window_left >= 0 or window_right >= 0:
        return "a window"
    if num_targets is not None and not causal:
        return "targets without causal"
    if q.dtype not in _DTYPES or not (q.dtype == k.dtype == v.dtype):
        return f"dtype {q.dtype} (bf16 / fp16 only)"
    D = q.shape[2]
    if D not in HEAD_DIMS or k.shape[2] != D or v.shape[2] != D:
        return f"head dims {q.shape[2]}/{k.shape[2]}/{v.shape[2]} (one of {HEAD_DIMS} for all three)"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not packed_rows(x):
            return f"{name}'s heads not packed rows with 16-byte aligned start and row stride"
    return None


def packed_rows(x: torch.Tensor) -> bool:
    """Whether x (T, H, D) is what TMA reads as a (T, H·D) row view: rows of H·D contiguous
    elements, 16-byte aligned start and row stride (a view of a fused qkv projection qualifies)."""
    T, H, D = x.shape
    row_bytes = x.stride(0) * x.element_size()
    return x.stride(2) == 1 and x.stride(1) == D and x.data_ptr() % 16 == 0 and row_bytes % 16 == 0


def _kind(activation: str) -> str:
    return "softmax" if activation == "softmax" else "pointwise"


@functools.lru_cache(maxsize=None)
def _device_facts(device: torch.device) -> tuple[tuple[int, int], int]:
    """(compute capability, SM count) of a CUDA device, asked of the driver once per device (each
    attention call asks both)."""
    props = torch.cuda.get_device_properties(device)
    return (props.major, props.minor), props.multi_processor_count


def on_hopper(x: torch.Tensor) -> bool:
    """Whether x lives on an sm_90 GPU (H100 / H200), where the Gluon kernels run."""
    return x.is_cuda and _device_facts(x.device)[0] == (9, 0)


def gluon_forward_applies(q, k, v, offsets, kv_offsets, num_targets, causal: bool, window_left: int,
                          window_right: int, activation: str) -> bool:
    """Whether the Triton backend's forward should run here: an sm_90 GPU, inputs in scope, a
    mean history of at least MIN_MEAN_LEN, and GEMCORE_GLUON_ATTENTION not set to 0."""
    if os.environ.get("GEMCORE_GLUON_ATTENTION", "1") == "0" or not on_hopper(q):
        return False
    if unsupported_reason(q, k, v, offsets, kv_offsets, num_targets, causal, window_left, window_right):
        return False
    return q.shape[0] >= MIN_MEAN_LEN[_kind(activation)] * (offsets.numel() - 1)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a GPU: the persistent kernels' CTA count."""
    return _device_facts(device)[1]


@functools.lru_cache(maxsize=None)
def _tile_layout(rows: int, D: int, dtype: torch.dtype):
    """The shared-memory layout of a (rows, D) tile (computed once: ~5 µs of host time a call,
    paid by every descriptor of every attention call otherwise)."""
    return gl.NVMMASharedLayout.get_default_for([rows, D], _DTYPES[dtype])


def descriptor(x: torch.Tensor, rows: int):
    """TMA descriptor over x's (T, H·D) row view (row stride x.stride(0)), blocks of (rows, D)."""
    T, H, D = x.shape
    return TensorDescriptor(x, [T, H * D], [x.stride(0), 1], [rows, D], _tile_layout(rows, D, x.dtype))


def _descriptors(q, k, v, block_n: int):
    """The forward's descriptors: q in (64, D) blocks, k and v in (block_n, D)."""
    return [descriptor(q, BLOCK_M // 2), descriptor(k, block_n), descriptor(v, block_n)]


def jagged_attention_fwd_hopper(q, k, v, offsets, activation: str, causal: bool, scale: float,
                                inv_norm: float, max_seqlen: int, num_targets=None, *, kv_offsets=None,
                                block_n: int | None = None, stages: int | None = None, persistent: bool = True):
    """(out (T, H, D) contiguous in q's dtype, lse2 (T, H) float32 base-2 log-sum-exp, empty
    (0, H) unless softmax), as the Triton forward returns them. Inputs as
    :func:`unsupported_reason` accepts; offsets (B+1,) int64 and num_targets (B,) int64 (causal
    only) on the GPU; kv_offsets (B+1,) int64 for cross attention (k and v hold the kv
    sequences; not causal; max_seqlen at least the longest q sequence). ``block_n`` (64 or 128)
    and ``stages``: the key tile and ring depth, for experiments (default: TILES); shared memory
    must hold 2·64·D + 2·stages·block_n·D elements. ``persistent``: one CTA per SM looping over
    the work items (default), else one per item."""
    T, H, D = q.shape
    tile_n, tile_stages = TILES[_kind(activation)]
    block_n, stages = block_n or tile_n, stages or tile_stages
    B = offsets.numel() - 1
    out = q.new_empty(T, H, D)                    # the kernel stores rows of H·D
    softmax = activation == "softmax"
    lse2 = torch.empty(T if softmax else 0, H, device=q.device, dtype=torch.float32)
    n_levels = math.ceil(max_seqlen / BLOCK_M)
    if B * H == 0 or n_levels == 0 or T == 0:
        return out, lse2
    qk_scale = scale * 1.4426950408889634 if softmax else scale
    (work, n_listed), = cached_lists(offsets, max_seqlen, T, query=True, key=False)
    n_items = B * H * n_levels                     # at most
    ctas = min(n_items, sm_count(q.device)) if persistent else n_items
    _FWD_LAUNCHES.launch(
        (ctas,),
        (*_descriptors(q, k, v, block_n), out, lse2, offsets if kv_offsets is None else kv_offsets,
         offsets if num_targets is None else num_targets, out.stride(0), H, work, n_listed, B, qk_scale, inv_norm),
        dict(STAGES=stages, ACTIVATION=ACTIVATION_CODES[activation], CAUSAL=bool(causal),
             HAS_TARGETS=num_targets is not None, CROSS=kv_offsets is not None, PERSISTENT=persistent),
        _OPTIONS)
    return out, lse2
