"""Prototype, NOT part of gemcore: a warp-specialized Gluon (Triton 3.6) jagged causal attention
forward for Hopper, the next step after ``gluon_attn_fwd_prototype.py`` (whose one-partition
kernel, correct on the H200, ran at 0.78-1.01x gemcore's Triton forward: two CTA-wide barriers per
key tile kept its warpgroups in lockstep, and nothing overlapped the P·V wgmma).

FA3's structure, written from its paper's description:
- a producer warp (24 registers) loads Q once and K/V tiles through TMA into a ring of ``STAGES``
  slots, signalled by mbarriers (K and V separately, so Q·Kᵀ starts before V lands);
- two consumer warpgroups, each its own partition (the default one and a worker), each owning 64 of
  the CTA's 128 query rows; they share the K/V ring (a slot is free once both have arrived on its
  ``empty`` barrier) but are otherwise unsynchronized, so the warp scheduler interleaves one's
  softmax with the other's wgmmas (FA3's ping-pong, left to the scheduler);
- inside each consumer, FA3's intra-warpgroup pipelining: Q·K_{j+1}ᵀ and P_j·V_j go out as
  asynchronous wgmmas, then the activation of tile j+1 runs while P_j·V_j is still on the tensor
  cores.

Scope as the first prototype: bf16, D = 128, causal self-attention, softmax or silu (GDPA / HSTU),
contiguous (T, H, D) inputs. TMA reads whole tiles: rows past a sequence's end belong to the next
sequence (or are zeros past T); they only ever meet masked scores or masked stores.

    python scripts/gluon_attn_fwd_ws_prototype.py --compile-only   # AOT for sm_90: registers, spills
    python scripts/gluon_attn_fwd_ws_prototype.py                  # on an H100/H200: parity + timing
"""
from __future__ import annotations

import argparse
import math
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from gluon_attn_fwd_prototype import _silu_fast, check_and_time, ptxas_report  # the module beside this one

HEAD_D = 128
BLOCK_M = 128           # query rows per CTA: two consumer warpgroups of 64
_HEAD_D, _BLOCK_M = gl.constexpr(HEAD_D), gl.constexpr(BLOCK_M)   # the kernels' view of them
#: name -> (key rows per tile, ring slots). Shared memory: Q 32 KiB + slots x 2 x BLOCK_N x 256 B
VARIANTS = {"ws_n128s2": (128, 2), "ws_n128s3": (128, 3), "ws_n64s4": (64, 4)}
CONSUMER_REGS, PRODUCER_REGS = gl.constexpr(240), gl.constexpr(24)
#: per-thread register cap of the whole kernel: 3 warpgroups (2 consumers + the producer's) share
#: the 64 Ki registers; the default partition gets what the workers leave
MAXNREG = 168


@gluon.jit
def _activate(s, j, rows, m_i, l_i, n_full, qk_scale, SILU: gl.constexpr, BLOCK_N: gl.constexpr,
              s_layout: gl.constexpr):
    """Scores (64, BLOCK_N) of key tile j -> (p, m_i, l_i, alpha): softmax with the running max
    and sum in base 2 (alpha rescales the accumulator), or silu (m_i, l_i, alpha unused)."""
    s = s * qk_scale
    if SILU:
        p = _silu_fast(s)
        if j >= n_full:                            # the diagonal's tiles: key <= query
            keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            p = gl.where(keys[None, :] <= rows[:, None], p, 0.0)
        alpha = m_i
    else:
        if j >= n_full:
            keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = gl.where(keys[None, :] <= rows[:, None], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        p = gl.exp2(s - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
    return p, m_i, l_i, alpha


@gluon.jit
def _consumer(wg: gl.constexpr, q_smem, k_ring, v_ring, q_bar, k_ready, v_ready, kv_empty,
              k_desc, O, LSE2, start, seq_len, m0, h, H, stride_t, qk_scale, inv_norm, n_full, n_tiles,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SILU: gl.constexpr):
    """One warpgroup: query rows [m0 + 64·wg, m0 + 64·wg + 64) against key tiles 0..n_tiles-1."""
    WG_M: gl.constexpr = _BLOCK_M // 2
    D: gl.constexpr = _HEAD_D
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q_w = q_smem.index(wg)
    rows = m0 + wg * WG_M + gl.arange(0, WG_M, layout=gl.SliceLayout(1, s_layout))
    zeros_s = gl.zeros([WG_M, BLOCK_N], gl.float32, s_layout)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q_w, k_ring.index(0).permute((1, 0)), zeros_s, use_acc=False)
    m_i = gl.full([WG_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([WG_M], gl.float32, gl.SliceLayout(1, s_layout))
    p, m_i, l_i, alpha = _activate(s, 0, rows, m_i, l_i, n_full, qk_scale, SILU, BLOCK_N, s_layout)
    acc = gl.zeros([WG_M, D], gl.float32, o_layout)
    for j in range(n_tiles - 1):
        nxt = j + 1
        mbarrier.wait(k_ready.index(nxt % STAGES), (nxt // STAGES) & 1)
        s_tok = warpgroup_mma(q_w, k_ring.index(nxt % STAGES).permute((1, 0)), zeros_s,
                              use_acc=False, is_async=True)
        stage = j % STAGES
        mbarrier.wait(v_ready.index(stage), (j // STAGES) & 1)
        o_tok = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_layout), v_ring.index(stage), acc,
                              is_async=True)
        s = warpgroup_mma_wait(1, deps=[s_tok])    # Q·K_{j+1}ᵀ is done; P_j·V_j may still run ...
        p, m_i, l_i, alpha = _activate(s, nxt, rows, m_i, l_i, n_full, qk_scale, SILU, BLOCK_N,
                                       s_layout)  # ... under tile j+1's activation
        acc = warpgroup_mma_wait(0, deps=[o_tok])
        mbarrier.arrive(kv_empty.index(stage), count=1)
        if not SILU:
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    last = n_tiles - 1
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_layout), v_ring.index(last % STAGES), acc)
    mbarrier.arrive(kv_empty.index(last % STAGES), count=1)

    o_rows = m0 + wg * WG_M + gl.arange(0, WG_M, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    if SILU:
        acc = acc * inv_norm
    else:
        acc = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
        gl.store(LSE2 + (start + rows) * H + h, m_i + gl.log2(l_i), mask=rows < seq_len)
    gl.store(O + h * D + (start + o_rows)[:, None] * stride_t + cols[None, :], acc.to(gl.bfloat16),
             mask=(o_rows < seq_len)[:, None])


@gluon.jit
def _second_consumer(q_smem, k_ring, v_ring, q_bar, k_ready, v_ready, kv_empty, q_desc, k_desc, v_desc,
                     O, LSE2, start, seq_len, m0, h, H, stride_t, qk_scale, inv_norm, n_full, n_tiles,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SILU: gl.constexpr):
    """Worker partition: the consumer of query rows 64..127 (workers share one signature)."""
    _consumer(1, q_smem, k_ring, v_ring, q_bar, k_ready, v_ready, kv_empty, k_desc, O, LSE2, start,
              seq_len, m0, h, H, stride_t, qk_scale, inv_norm, n_full, n_tiles, BLOCK_N, STAGES, SILU)


@gluon.jit
def _producer(q_smem, k_ring, v_ring, q_bar, k_ready, v_ready, kv_empty, q_desc, k_desc, v_desc,
              O, LSE2, start, seq_len, m0, h, H, stride_t, qk_scale, inv_norm, n_full, n_tiles,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SILU: gl.constexpr):
    """Worker partition, one warp: TMA loads of both Q halves, then K/V tiles into the ring."""
    WG_M: gl.constexpr = _BLOCK_M // 2
    col = h * _HEAD_D
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [start + m0, col], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [start + m0 + WG_M, col], q_bar, q_smem.index(1))
    for j in range(n_tiles):
        stage = j % STAGES
        mbarrier.wait(kv_empty.index(stage), ((j // STAGES) & 1) ^ 1)   # fresh barriers: passes
        row = start + j * BLOCK_N
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, col], k_ready.index(stage), k_ring.index(stage))
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, col], v_ready.index(stage), v_ring.index(stage))


@gluon.jit
def _gluon_ws_attn_fwd(q_desc, k_desc, v_desc, O, LSE2, offsets, stride_t, H, qk_scale, inv_norm,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SILU: gl.constexpr):
    """Grid (B·H, cdiv(max_len, 128)), heaviest query tiles first. q/k/v descriptors over the
    (T, H·D) views with blocks (64, D) / (BLOCK_N, D). SILU=False: softmax (``qk_scale`` =
    scale·log2 e; writes the base-2 LSE); SILU=True: out = Σ silu(scale·q·k) v · inv_norm."""
    gl.static_assert(_BLOCK_M % BLOCK_N == 0)
    pid_bh = gl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    m0 = (gl.num_programs(1) - 1 - gl.program_id(1)) * _BLOCK_M
    start = gl.load(offsets + b).to(gl.int32)
    seq_len = gl.load(offsets + b + 1).to(gl.int32) - start
    if m0 < seq_len:
        n_full = m0 // BLOCK_N
        n_tiles = gl.minimum(n_full + _BLOCK_M // BLOCK_N, gl.cdiv(seq_len, BLOCK_N))
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [2] + q_desc.block_type.shape, q_desc.layout)
        k_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)     # both consumers release a slot
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_ring, v_ring, q_bar, k_ready, v_ready, kv_empty, k_desc, O, LSE2,
                         start, seq_len, m0, h, H, stride_t, qk_scale, inv_norm, n_full, n_tiles,
                         BLOCK_N, STAGES, SILU)),
            (_second_consumer, (q_smem, k_ring, v_ring, q_bar, k_ready, v_ready, kv_empty, q_desc, k_desc,
                                v_desc, O, LSE2, start, seq_len, m0, h, H, stride_t, qk_scale, inv_norm,
                                n_full, n_tiles, BLOCK_N, STAGES, SILU)),
            (_producer, (q_smem, k_ring, v_ring, q_bar, k_ready, v_ready, kv_empty, q_desc, k_desc,
                         v_desc, O, LSE2, start, seq_len, m0, h, H, stride_t, qk_scale, inv_norm,
                         n_full, n_tiles, BLOCK_N, STAGES, SILU)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _descriptors(q, k, v, block_n: int):
    """TMA descriptors over the (T, H·D) views: Q in (64, D) blocks, K and V in (block_n, D)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    T, H, D = q.shape
    descs = []
    for x, rows in ((q, BLOCK_M // 2), (k, block_n), (v, block_n)):
        layout = gl.NVMMASharedLayout.get_default_for([rows, D], gl.bfloat16)
        descs.append(TensorDescriptor.from_tensor(x.view(T, H * D), [rows, D], layout))
    return descs


def launch(q, k, v, offsets, max_len: int, activation: str, variant: str):
    """out (T, H, D) of the warp-specialized forward; q, k, v contiguous bf16 (T, H, 128)."""
    import torch

    T, H, D = q.shape
    block_n, stages = VARIANTS[variant]
    out = torch.empty_like(q)
    lse2 = torch.empty(T, H, device=q.device, dtype=torch.float32)
    silu = activation == "silu"
    scale = 1 / math.sqrt(D)
    grid = (offsets.numel() - 1) * H, math.ceil(max_len / BLOCK_M)
    _gluon_ws_attn_fwd[grid](*_descriptors(q, k, v, block_n), out, lse2, offsets, q.stride(0), H,
                             scale if silu else scale * 1.4426950408889634, 1.0 / max(max_len, 1),
                             BLOCK_N=block_n, STAGES=stages, SILU=silu, num_warps=4, maxnreg=MAXNREG)
    return out


def compile_only(variant: str, silu: bool) -> None:
    """AOT-compile for sm_90 (no GPU needed) and print what ptxas reports."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    block_n, stages = VARIANTS[variant]
    x = torch.zeros(256, 4 * HEAD_D, dtype=torch.bfloat16)   # any 16-byte aligned tensor: only the type counts
    q_desc, k_desc, v_desc = _descriptors(*(x.view(256, 4, HEAD_D),) * 3, block_n)
    sig = {"q_desc": mangle_type(q_desc), "k_desc": mangle_type(k_desc), "v_desc": mangle_type(v_desc),
           "O": "*bf16", "LSE2": "*fp32", "offsets": "*i64", "stride_t": "i32", "H": "i32",
           "qk_scale": "fp32", "inv_norm": "fp32",
           "BLOCK_N": "constexpr", "STAGES": "constexpr", "SILU": "constexpr"}
    aligned = {(i,): [["tt.divisibility", 16]] for i in (3, 4, 5, 6)}
    src = GluonASTSource(_gluon_ws_attn_fwd, sig,
                         constexprs={"BLOCK_N": block_n, "STAGES": stages, "SILU": silu}, attrs=aligned)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "maxnreg": MAXNREG})
    print(f"triton {triton.__version__}, {'silu' if silu else 'softmax'}, {variant}: {ptxas_report(kernel)}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--variant", choices=sorted(VARIANTS), nargs="+", default=list(VARIANTS))
    args = ap.parse_args()
    if args.compile_only:
        for silu in (False, True):
            for variant in args.variant:
                compile_only(variant, silu)
        return 0
    failed = 0
    for variant in args.variant:
        failed |= check_and_time(lambda *a, variant=variant: launch(*a, variant=variant), variant)
    return failed


if __name__ == "__main__":
    sys.exit(main())
