"""Prototype, NOT part of gemcore and never run on a GPU: an exact MX GEMM for Hopper in Gluon,
warp-specialized like gemcore's attention forward (``kernels/jagged_attention_gluon.py``).

Issue 4 asks for ``mx_matmul`` at cuBLAS bf16 speed or better on Hopper. The FP8 tensor cores
multiply one 32-wide K block per wgmma (m64nNk32); the MX definition then needs each block's
partial product scaled by 2^(Ea[m] + Eb[n]) before it joins the float32 sum: per output element
and block, one FMUL (the scale product) and one FFMA, on the CUDA cores. That is 2 FP32 operations
per 64 tensor FLOPs: an SM does 128 FP32 operations per clock against about 7.6k FP8 tensor FLOPs,
so the CUDA cores bound the kernel at about half the FP8 peak (~1000 TFLOP/s), above the 705 of
cuBLAS bf16, but only if they run while the tensor cores do. gemcore's straightforward Triton FP8
kernel serialises the two (100 TFLOP/s, ANCHORS.md); its dequantize-to-bf16 kernel reaches 0.92x
cuBLAS bf16 at best.

Here, per CTA of 128 x BN outputs:
- a producer warp TMA-loads, per 32-wide K block, A's two 64-row halves and B's (BN, 32) tile
  (B given as Bᵀ, K-major, as the FP8 wgmma wants it) into a ring of ``STAGES`` slots;
- two consumer warpgroups (64 rows each, unsynchronised, so one's FMAs run under the other's
  wgmmas) issue block k+1's wgmma asynchronously, then fold block k's partial product into their
  accumulator: ``acc += t · sa[row] · sb[col]``, sa / sb built from the E8M0 bytes by an integer
  shift (no MUFU), NaN for byte 0xFF, 2^-127 for byte 0.

    python scripts/gluon_mx_gemm_prototype.py --emulate        # the schedule in PyTorch, on a CPU
    python scripts/gluon_mx_gemm_prototype.py --compile-only   # AOT for sm_90: registers, spills
    python scripts/gluon_mx_gemm_prototype.py                  # on an H100/H200: parity + timing
"""
from __future__ import annotations

import argparse
import math
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from gemcore.kernels.jagged_attention_gluon import _tma_load   # the TMA load under both Triton names


BLOCK_M = 128            # two consumer warpgroups of 64 rows
MX_BLOCK = 32            # K per MX block, and per FP8 wgmma
_MX_BLOCK = gl.constexpr(MX_BLOCK)
_CONSUMER_REGS, _PRODUCER_REGS = gl.constexpr(240), gl.constexpr(24)
MAXNREG = 168
#: name -> (BN, ring slots); a slot holds 128 x 32 of A and BN x 32 of B (FP8 bytes)
VARIANTS = {"n128s8": (128, 8), "n128s12": (128, 12), "n64s8": (64, 8)}
GROUP_M = 8


@gluon.jit
def _e8m0_to_float(e):
    """2^(e - 127) from biased E8M0 bytes (int32): exponent bits by a shift; byte 0 is 2^-127
    (a float32 subnormal), byte 255 is NaN."""
    bits = e << 23
    bits = gl.where(e == 0, 0x00400000, bits)
    bits = gl.where(e == 255, 0x7FC00000, bits)
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def _consumer(wg: gl.constexpr, a_ring, b_ring, ready, empty, A_SC_T, B_SC_T, C, M, N, n_kb, m0, n0,
              stride_cm):
    """Rows [m0 + 64·wg, +64) x columns [n0, n0 + BN) over the n_kb K blocks."""
    BN: gl.constexpr = b_ring.type.shape[1]
    STAGES: gl.constexpr = b_ring.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BN, _MX_BLOCK])
    rows = m0 + wg * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
    cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
    row_ok = rows < M
    col_ok = cols < N
    acc = gl.zeros([64, BN], gl.float32, acc_layout)
    mbarrier.wait(ready.index(0), 0)
    t = warpgroup_mma(a_ring.index(wg), b_ring.index(0).permute((1, 0)),
                      gl.zeros([64, BN], gl.float32, acc_layout), use_acc=False)
    for kb in range(n_kb - 1):
        nxt = kb + 1
        mbarrier.wait(ready.index(nxt % STAGES), (nxt // STAGES) & 1)
        t_tok = warpgroup_mma(a_ring.index(2 * (nxt % STAGES) + wg), b_ring.index(nxt % STAGES).permute((1, 0)),
                              gl.zeros([64, BN], gl.float32, acc_layout), use_acc=False, is_async=True)
        mbarrier.arrive(empty.index(kb % STAGES), count=1)      # block kb's wgmma is done
        sa = _e8m0_to_float(gl.load(A_SC_T + kb * M + rows, mask=row_ok, other=127).to(gl.int32))
        sb = _e8m0_to_float(gl.load(B_SC_T + kb * N + cols, mask=col_ok, other=127).to(gl.int32))
        acc = acc + (t * sb[None, :]) * sa[:, None]             # under block kb+1's wgmma
        t = warpgroup_mma_wait(0, deps=[t_tok])
    last = n_kb - 1
    mbarrier.arrive(empty.index(last % STAGES), count=1)
    sa = _e8m0_to_float(gl.load(A_SC_T + last * M + rows, mask=row_ok, other=127).to(gl.int32))
    sb = _e8m0_to_float(gl.load(B_SC_T + last * N + cols, mask=col_ok, other=127).to(gl.int32))
    acc = acc + (t * sb[None, :]) * sa[:, None]
    gl.store(C + rows[:, None] * stride_cm + cols[None, :], acc.to(C.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@gluon.jit
def _second_consumer(a_ring, b_ring, ready, empty, a_desc, b_desc, A_SC_T, B_SC_T, C, M, N, n_kb, m0, n0,
                     stride_cm):
    _consumer(1, a_ring, b_ring, ready, empty, A_SC_T, B_SC_T, C, M, N, n_kb, m0, n0, stride_cm)


@gluon.jit
def _producer(a_ring, b_ring, ready, empty, a_desc, b_desc, A_SC_T, B_SC_T, C, M, N, n_kb, m0, n0,
              stride_cm):
    """One warp: per K block, A's two 64-row halves and Bᵀ's (BN, 32) tile."""
    STAGES: gl.constexpr = b_ring.type.shape[0]
    for kb in range(n_kb):
        stage = kb % STAGES
        mbarrier.wait(empty.index(stage), ((kb // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(stage), 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        k0 = kb * _MX_BLOCK
        _tma_load(a_desc, [m0, k0], ready.index(stage), a_ring.index(2 * stage))
        _tma_load(a_desc, [m0 + 64, k0], ready.index(stage), a_ring.index(2 * stage + 1))
        _tma_load(b_desc, [n0, k0], ready.index(stage), b_ring.index(stage))


@gluon.jit
def _gluon_mx_gemm(a_desc, b_desc, A_SC_T, B_SC_T, C, M, N, K, stride_cm, STAGES: gl.constexpr,
                   GROUP: gl.constexpr):
    """C (M, N) = Σ_kb 2^(Ea+Eb) A_kb Bᵀ_kbᵀ. a_desc over A (M, K) FP8 in (64, 32) blocks; b_desc
    over Bᵀ (N, K) FP8 in (BN, 32) blocks; A_SC_T (K/32, M) and B_SC_T (K/32, N) uint8 E8M0."""
    BN: gl.constexpr = b_desc.block_type.shape[0]
    pid = gl.program_id(0)
    n_m = gl.cdiv(M, 128)
    n_n = gl.cdiv(N, BN)
    group = GROUP * n_n                              # grouped tile order: neighbours share A in L2
    first_m = (pid // group) * GROUP
    size_m = gl.minimum(n_m - first_m, GROUP)
    m0 = (first_m + (pid % group) % size_m) * 128
    n0 = ((pid % group) // size_m) * BN
    n_kb = gl.cdiv(K, _MX_BLOCK)
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    gl.warp_specialize([
        (_consumer, (0, a_ring, b_ring, ready, empty, A_SC_T, B_SC_T, C, M, N, n_kb, m0, n0, stride_cm)),
        (_second_consumer, (a_ring, b_ring, ready, empty, a_desc, b_desc, A_SC_T, B_SC_T, C, M, N, n_kb,
                            m0, n0, stride_cm)),
        (_producer, (a_ring, b_ring, ready, empty, a_desc, b_desc, A_SC_T, B_SC_T, C, M, N, n_kb, m0, n0,
                     stride_cm)),
    ], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])


def _descriptors(a_data, bt_data, bn: int):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    descs = []
    for x, rows in ((a_data, 64), (bt_data, bn)):
        layout = gl.NVMMASharedLayout.get_default_for([rows, MX_BLOCK], gl.float8e4nv)
        descs.append(TensorDescriptor.from_tensor(x, [rows, MX_BLOCK], layout))
    return descs


def mx_matmul_gluon(a, b, out_dtype=torch.bfloat16, variant: str = "n128s8"):
    """a: MXTensor (M, K) along K; b: MXTensor (K, N) along K whose data is K-major (a transposed
    view of an (N, K) tensor, as MXLinear's weights are). -> (M, N) in ``out_dtype``. The scale
    transposes (K/32 x (M + N) bytes) are counted in the call."""
    bn, stages = VARIANTS[variant]
    M, K = a.data.shape
    N = b.data.shape[1]
    bt = b.data.t()
    if not bt.is_contiguous():
        raise ValueError("b's data must be K-major (a transposed view of an (N, K) tensor)")
    a_sc_t = a.scale.t().contiguous()                  # (K/32, M)
    b_sc_t = b.scale.contiguous()                      # (K/32, N)
    c = torch.empty(M, N, device=a.data.device, dtype=out_dtype)
    grid = (math.ceil(M / BLOCK_M) * math.ceil(N / bn),)
    _gluon_mx_gemm[grid](*_descriptors(a.data, bt, bn), a_sc_t, b_sc_t, c, M, N, K, c.stride(0),
                         STAGES=stages, GROUP=GROUP_M, num_warps=4, maxnreg=MAXNREG)
    return c


def emulate(a, b, variant: str = "n128s8"):
    """The kernel's arithmetic in PyTorch (float32, any device): per output tile and warpgroup,
    block k's FP8 partial product scaled by sa[row]·sb[col] (via the E8M0 bit trick) and added
    in K order. Returns (M, N) float32."""
    bn, _ = VARIANTS[variant]
    M, K = a.data.shape
    N = b.data.shape[1]
    A, B = a.data.float(), b.data.float()

    def e8m0(e):
        bits = e.to(torch.int32) << 23
        bits = torch.where(e == 0, torch.tensor(0x00400000, dtype=torch.int32), bits)
        bits = torch.where(e == 255, torch.tensor(0x7FC00000, dtype=torch.int32), bits)
        return bits.view(torch.float32)

    c = torch.zeros(M, N)
    for m0 in range(0, M, BLOCK_M):
        for n0 in range(0, N, bn):
            for wg in range(2):
                r0 = m0 + 64 * wg
                if r0 >= M:
                    continue
                rows, cols = slice(r0, min(r0 + 64, M)), slice(n0, min(n0 + bn, N))
                acc = torch.zeros(rows.stop - rows.start, cols.stop - cols.start)
                for kb in range(math.ceil(K / MX_BLOCK)):
                    ks = slice(kb * MX_BLOCK, min(kb * MX_BLOCK + MX_BLOCK, K))
                    t = A[rows, ks] @ B[ks, cols]
                    acc = acc + (t * e8m0(b.scale[kb, cols])[None, :]) * e8m0(a.scale[rows, kb])[:, None]
                c[rows, cols] = acc
    return c


def _operands(M, K, N, device, seed=0, spread=True):
    from gemcore.kernels import mx

    g = torch.Generator(device=device).manual_seed(seed)
    a16 = torch.randn(M, K, generator=g, device=device)
    w16 = torch.randn(N, K, generator=g, device=device)
    if spread:   # magnitudes across rows and along K (inside blocks too); weights (N, K): b K-major
        a16 = a16 * torch.exp2(torch.randint(-6, 7, (M, 1), generator=g, device=device).float())
        w16 = w16 * torch.exp2(torch.randint(-6, 7, (1, K), generator=g, device=device).float())
    a = mx.quantize_mx(a16.to(torch.bfloat16), axis=-1, scale_rule="rceil")
    b = mx.quantize_mx(w16.to(torch.bfloat16), axis=-1, scale_rule="rceil").t()
    return a, b


def check(run, device: str) -> int:
    """``run(a, b) -> (M, N)`` against the float64 product of the dequantized operands (the spec's
    test: relative error <= 1e-4), on shapes with tails in M, N and K (K a multiple of 16: TMA
    wants 16-byte row strides), on plain normal data and on data whose magnitudes spread over
    2^±6 across rows and along K. Hopper's FP8 wgmma does not accumulate in full float32 (DeepSeek-V3
    reports about 14 bits kept), so the spread data is printed, not held to 1e-4."""
    failed = 0
    for M, K, N in ((128, 64, 128), (200, 112, 136), (256, 512, 256), (512, 2048, 384)):
        for spread in (False, True):
            a, b = _operands(M, K, N, device, spread=spread)
            want = a.dequantize(torch.float64) @ b.dequantize(torch.float64)
            got = run(a, b).double()
            err = float((got - want).norm() / want.norm())
            print(f"{M}x{K}x{N} {'spread' if spread else 'normal'}: relative error {err:.2e} "
                  f"(float32 accumulation: expect <= 1e-4)", flush=True)
            failed |= not spread and not err <= 1e-4
    return int(failed)


def compile_only(variant: str) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from gluon_attn_fwd_prototype import ptxas_report   # the module beside this one

    bn, stages = VARIANTS[variant]
    x = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    a_desc, b_desc = _descriptors(x, x, bn)
    sig = {"a_desc": mangle_type(a_desc), "b_desc": mangle_type(b_desc), "A_SC_T": "*u8", "B_SC_T": "*u8",
           "C": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_cm": "i32", "STAGES": "constexpr",
           "GROUP": "constexpr"}
    src = GluonASTSource(_gluon_mx_gemm, sig, constexprs={"STAGES": stages, "GROUP": GROUP_M})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": MAXNREG})
    print(f"triton {triton.__version__}, {variant}: {ptxas_report(kernel)}")


def run_on_gpu(variants) -> int:
    """Parity per variant, then TFLOP/s on 8192³ and two training shapes beside cuBLAS bf16,
    torch._scaled_mm FP8 and gemcore's current mx_matmul, in the same process."""
    from gemcore.bench.timing import median_ms
    from gemcore.kernels import mx

    failed, launched = 0, []
    for variant in variants:
        print(f"== {variant}", flush=True)
        try:
            failed |= check(lambda a, b: mx_matmul_gluon(a, b, torch.float32, variant), "cuda")
            launched.append(variant)
        except Exception as exc:  # a variant that does not compile or launch
            print(f"failed {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            failed = 1
    variants = launched    # timed even when parity failed: the figures say whether it is worth mending
    for M, K, N in ((8192, 8192, 8192), (16384, 4096, 4096), (16384, 8192, 8192)):
        flops = 2.0 * M * N * K
        a16 = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        a, b = mx.quantize_mx(a16, axis=-1, scale_rule="rceil"), mx.quantize_mx(w16, axis=-1, scale_rule="rceil").t()
        one = torch.ones((), device="cuda")
        a8, w8 = a16.to(torch.float8_e4m3fn), w16.to(torch.float8_e4m3fn)
        rows = {"cuBLAS bf16 a @ b": median_ms(lambda: a16 @ w16.t()),
                "torch._scaled_mm fp8 (ceiling)": median_ms(lambda: torch._scaled_mm(
                    a8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)),
                "gemcore mx_matmul (auto)": median_ms(lambda: mx.mx_matmul(a, b))}
        for variant in variants:
            rows[f"gluon mx {variant}"] = median_ms(lambda variant=variant: mx_matmul_gluon(a, b, variant=variant))
        print(f"{M}x{K}x{N}: " + ", ".join(f"{k} {flops / ms / 1e9:.0f}" for k, ms in rows.items())
              + " TFLOP/s", flush=True)
    return failed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--emulate", action="store_true")
    ap.add_argument("--variant", choices=sorted(VARIANTS), nargs="+", default=list(VARIANTS))
    args = ap.parse_args()
    if args.emulate:
        return check(lambda a, b: emulate(a, b, args.variant[0]), "cpu")
    if args.compile_only:
        for variant in args.variant:
            compile_only(variant)
        return 0
    return run_on_gpu(args.variant)


if __name__ == "__main__":
    sys.exit(main())
