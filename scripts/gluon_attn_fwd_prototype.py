"""Prototype, NOT part of gemcore and never run on a GPU: a Gluon (Triton 3.6) jagged causal
attention forward for Hopper with FA3's intra-warpgroup overlap — the next tile's QKᵀ is issued as
an asynchronous wgmma before this tile's softmax (or activation), so the tensor cores work while
the warps do the exponentials (session 14's Nsight Compute: the Triton kernels are latency-bound
on the MMA → softmax → MMA chain, 57–71 % of cycles with no eligible warp).

Scope: bf16, D = 128, causal self-attention, softmax or silu (GDPA / HSTU), no targets / window;
tiles of 128 query × 128 or 64 key rows on 8 warps (two warpgroups of 64 rows), or 64 × 64 on one
warpgroup (``--variant``); K/V through a cp.async ring of ``STAGES`` tiles (tile j+2 loads while
tile j computes). Same grid
and outputs as ``gemcore.kernels.jagged_attention_triton``'s forward (out, base-2 LSE).

    python scripts/gluon_attn_fwd_prototype.py --emulate        # the schedule in PyTorch, on a CPU
    python scripts/gluon_attn_fwd_prototype.py --compile-only   # AOT for sm_90: registers, spills
    python scripts/gluon_attn_fwd_prototype.py                  # on an H100/H200: parity + timing

Compile-only works without a GPU (Triton ships ptxas); on this repo's CPU machines point
PYTHONPATH at a Triton 3.6 install, the device machine's version.
"""
from __future__ import annotations

import argparse
import math
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import ampere, hopper

HEAD_D = 128
#: name -> (query rows, key rows, cp.async ring stages, warps); the ring needs >= 3 stages (tile
#: j+2 loads while j computes). 128x128: 3 x 2 x 32 KiB + Q = 224 KiB, the most that fits;
#: 64x64 on one warpgroup: 112 KiB, so two CTAs share an SM (their MMAs and softmaxes interleave)
VARIANTS = {"m128n128": (128, 128, 3, 8), "m128n64": (128, 64, 4, 8), "m64n64": (64, 64, 3, 4)}


@gluon.jit
def _issue_kv_load(k_ring, v_ring, K, V, kv_row0, n0, seq_len, stage, stride_t,
                   BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, layout: gl.constexpr):
    """cp.async of key/value rows [n0, n0 + BLOCK_N) of one sequence (rows past its end: zeros)."""
    rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, layout))
    offs = (kv_row0 + rows)[:, None] * stride_t + cols[None, :]
    ok = (rows < seq_len)[:, None]
    ampere.async_copy.async_copy_global_to_shared(k_ring.index(stage), K + offs, mask=ok)
    ampere.async_copy.async_copy_global_to_shared(v_ring.index(stage), V + offs, mask=ok)
    ampere.async_copy.commit_group()


@gluon.jit
def _silu_fast(x):
    """x·sigmoid(x) with sigmoid(x) = (1 + tanh(x/2)) / 2 on the hardware tanh (one MUFU op), as
    gemcore's Triton kernels do for 16-bit inputs."""
    t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [0.5 * x], dtype=gl.float32,
                                  is_pure=True, pack=1)
    return x * (0.5 + 0.5 * t)


@gluon.jit
def _gluon_attn_fwd(Q, K, V, O, LSE2, offsets, stride_t, stride_h, H, qk_scale, inv_norm,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                    STAGES: gl.constexpr, SILU: gl.constexpr):
    """SILU=False: softmax (``qk_scale`` = scale·log2 e; writes the base-2 LSE); SILU=True: GDPA /
    HSTU, out = Σ silu(scale·q·k) v · inv_norm (``qk_scale`` = scale; LSE2 untouched)."""
    gl.static_assert(BLOCK_M % BLOCK_N == 0)   # the diagonal spans BLOCK_M // BLOCK_N key tiles
    num_warps: gl.constexpr = gl.num_warps()
    io: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_D], gl.bfloat16)

    pid_bh = gl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    m0 = (gl.num_programs(1) - 1 - gl.program_id(1)) * BLOCK_M    # heaviest tiles first
    start = gl.load(offsets + b)
    seq_len = (gl.load(offsets + b + 1) - start).to(gl.int32)
    if m0 < seq_len:
        Qh = Q + h * stride_h
        Kh = K + h * stride_h
        Vh = V + h * stride_h
        n_full = m0 // BLOCK_N                     # wholly visible key tiles
        n_tiles = gl.minimum(n_full + BLOCK_M // BLOCK_N, gl.cdiv(seq_len, BLOCK_N))  # + the diagonal's

        k_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_D], smem)
        v_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_D], smem)
        _issue_kv_load(k_ring, v_ring, Kh, Vh, start, 0, seq_len, 0, stride_t, BLOCK_N, HEAD_D, io)
        _issue_kv_load(k_ring, v_ring, Kh, Vh, start, BLOCK_N, seq_len, 1, stride_t, BLOCK_N, HEAD_D, io)

        q_rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, io))
        cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, io))
        q = gl.load(Qh + (start + q_rows)[:, None] * stride_t + cols[None, :],
                    mask=(q_rows < seq_len)[:, None], other=0.0)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, HEAD_D], smem, q)

        # tile 0 landed (tile 1 may be in flight); each thread fences its own writes (cp.async and
        # the Q store) for the async proxy that wgmma reads through, then all meet
        ampere.async_copy.wait_group(1)
        hopper.fence_async_shared()
        gl.thread_barrier()
        s_tok = hopper.warpgroup_mma(q_smem, k_ring.index(0).permute((1, 0)),
                                     gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                                     use_acc=False, is_async=True)
        s = hopper.warpgroup_mma_wait(0, deps=[s_tok])

        acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
        rows_s = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        for j in range(n_tiles):
            stage = j % STAGES
            # tile j+2 goes into the stage tile j-1 used: every warpgroup must be past that tile's
            # PV wgmma (each waited for its own at the end of the last iteration) before any thread
            # overwrites it. A group is always committed (empty past the end), so wait_group(1)
            # below always means "tile j+1 landed".
            gl.thread_barrier()
            if j + 2 < n_tiles:
                _issue_kv_load(k_ring, v_ring, Kh, Vh, start, (j + 2) * BLOCK_N, seq_len,
                               (j + 2) % STAGES, stride_t, BLOCK_N, HEAD_D, io)
            else:
                ampere.async_copy.commit_group()
            ampere.async_copy.wait_group(1)
            hopper.fence_async_shared()
            gl.thread_barrier()
            # the next tile's scores start on the tensor cores now (past the end: a stale stage,
            # its result unused) ...
            s_next_tok = hopper.warpgroup_mma(q_smem, k_ring.index((j + 1) % STAGES).permute((1, 0)),
                                              gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                                              use_acc=False, is_async=True)
            # ... while this tile's softmax (or activation) runs on the CUDA cores
            s = s * qk_scale
            if SILU:
                p = _silu_fast(s)
                if j >= n_full:                    # the diagonal's tiles: key <= query
                    keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                    p = gl.where(keys[None, :] <= rows_s[:, None], p, 0.0)
            else:
                if j >= n_full:
                    keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                    s = gl.where(keys[None, :] <= rows_s[:, None], s, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, 1))
                p = gl.exp2(s - m_new[:, None])
                alpha = gl.exp2(m_i - m_new)
                l_i = l_i * alpha + gl.sum(p, 1)
                m_i = m_new
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
            o_tok = hopper.warpgroup_mma(p_op, v_ring.index(stage), acc, is_async=True)
            s, acc = hopper.warpgroup_mma_wait(0, deps=[s_next_tok, o_tok])

        ampere.async_copy.wait_group(0)
        if SILU:
            acc = acc * inv_norm
        else:
            acc = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
            lse_rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            gl.store(LSE2 + (start + lse_rows) * H + h, m_i + gl.log2(l_i), mask=lse_rows < seq_len)
        out = gl.convert_layout(acc.to(gl.bfloat16), io)
        gl.store(O + h * stride_h + (start + q_rows)[:, None] * stride_t + cols[None, :], out,
                 mask=(q_rows < seq_len)[:, None])


def emulate(q, k, v, offsets, variant: str, activation: str):
    """The kernel's schedule in PyTorch on any device, tile for tile and in the kernel's order: the
    same query-tile grid, n_full / n_tiles, ring stages, one-ahead scores and diagonal masks, so
    index and masking mistakes show up on a CPU (Gluon has no interpreter). Not Gluon semantics:
    layouts, barriers and async completion are the GPU run's to check. Returns out (T, H, D)."""
    import torch

    T, H, D = q.shape
    block_m, block_n, stages, _ = VARIANTS[variant]
    scale = 1 / math.sqrt(D)
    silu = activation == "silu"
    max_len = int((offsets[1:] - offsets[:-1]).max()) if offsets.numel() > 1 else 0
    inv_norm = 1.0 / max(max_len, 1)
    out = torch.zeros(T, H, D, dtype=torch.float32)
    n_m = math.ceil(max_len / block_m)
    for b in range(offsets.numel() - 1):
        start, seq_len = int(offsets[b]), int(offsets[b + 1] - offsets[b])
        for h in range(H):
            for pid1 in range(n_m):
                m0 = (n_m - 1 - pid1) * block_m
                if not m0 < seq_len:
                    continue

                def tile(x, n0):                   # rows [n0, n0 + BLOCK_N) of the sequence, zeros past it
                    t = torch.zeros(block_n, D)
                    rows = torch.arange(n0, n0 + block_n)
                    ok = rows < seq_len
                    t[ok] = x[start + rows[ok], h].float()
                    return t

                n_full = m0 // block_n
                n_tiles = min(n_full + block_m // block_n, -(-seq_len // block_n))
                ring_k, ring_v = [None] * stages, [None] * stages
                ring_k[0], ring_v[0] = tile(k, 0), tile(v, 0)
                ring_k[1], ring_v[1] = tile(k, block_n), tile(v, block_n)
                rows = torch.arange(m0, m0 + block_m)
                qt = torch.zeros(block_m, D)
                ok = rows < seq_len
                qt[ok] = q[start + rows[ok], h].float()
                s = qt @ ring_k[0].T
                acc = torch.zeros(block_m, D)
                m_i = torch.full((block_m,), float("-inf"))
                l_i = torch.zeros(block_m)
                for j in range(n_tiles):
                    stage = j % stages
                    if j + 2 < n_tiles:
                        n0 = (j + 2) * block_n
                        ring_k[(j + 2) % stages], ring_v[(j + 2) % stages] = tile(k, n0), tile(v, n0)
                    nxt = ring_k[(j + 1) % stages]
                    s_next = qt @ nxt.T if nxt is not None else None
                    s = s * (scale if silu else scale * 1.4426950408889634)
                    keys = j * block_n + torch.arange(block_n)
                    visible = keys[None, :] <= rows[:, None]
                    if silu:
                        p = torch.nn.functional.silu(s)
                        if j >= n_full:
                            p = torch.where(visible, p, 0.0)
                    else:
                        if j >= n_full:
                            s = torch.where(visible, s, float("-inf"))
                        m_new = torch.maximum(m_i, s.max(1).values)
                        p = torch.exp2(s - m_new[:, None])
                        alpha = torch.exp2(m_i - m_new)
                        l_i = l_i * alpha + p.sum(1)
                        m_i = m_new
                        acc = acc * alpha[:, None]
                    acc = acc + p.to(torch.bfloat16).float() @ ring_v[stage]
                    s = s_next
                acc = acc * inv_norm if silu else acc / l_i[:, None]
                out[start + rows[ok], h] = acc[ok]
    return out


def check_emulation() -> int:
    """The schedule against gemcore's reference on a CPU: both activations, every variant."""
    import torch

    from gemcore.kernels.jagged_attention_reference import jagged_attention_reference

    failed = 0
    gen = torch.Generator().manual_seed(0)
    lengths = [0, 1, 2, 63, 64, 65, 127, 128, 129, 200, 300]
    offsets = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0))
    q, k, v = (torch.randn(sum(lengths), 2, HEAD_D, generator=gen).to(torch.bfloat16) for _ in range(3))
    for activation in ("softmax", "silu"):
        want = jagged_attention_reference(q.double(), k.double(), v.double(), offsets, causal=True,
                                          activation=activation).float()
        for variant in VARIANTS:
            got = emulate(q, k, v, offsets, variant, activation)
            err = ((got - want).norm() / want.norm()).item()
            print(f"emulated schedule, {activation}, {variant}: relative error {err:.2e}")
            failed |= not err < 1e-2
    return int(failed)


def compile_only(variant: str, silu: bool) -> None:
    """AOT-compile for sm_90 (no GPU needed) and print registers and spills per thread."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE2": "*fp32", "offsets": "*i64",
           "stride_t": "i32", "stride_h": "i32", "H": "i32", "qk_scale": "fp32", "inv_norm": "fp32",
           "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "HEAD_D": "constexpr", "STAGES": "constexpr",
           "SILU": "constexpr"}
    # what a JIT launch specialises: pointers and the two strides divisible by 16 (16-byte rows)
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(8)}
    block_m, block_n, stages, warps = VARIANTS[variant]
    src = GluonASTSource(_gluon_attn_fwd, sig, constexprs={"BLOCK_M": block_m, "BLOCK_N": block_n,
                                                           "HEAD_D": HEAD_D, "STAGES": stages,
                                                           "SILU": silu},
                         attrs=aligned)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    print(f"triton {triton.__version__}, {'silu' if silu else 'softmax'}, {variant}: {ptxas_report(kernel)}")


def ptxas_report(kernel) -> str:
    """Registers and spills per thread from ptxas itself (the loaded-kernel counters need a GPU),
    shared memory and the wgmma count of a ``triton.compile``d sm_90 kernel."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    wgmma = sum("wgmma.mma_async" in line for line in kernel.asm["ptx"].splitlines())
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        info = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f.name, "-o", "/dev/null"],
                              capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    return (f"compiled for sm_90, {regs.group(1) if regs else '?'} registers, "
            f"{spills.group(1) if spills else '?'} B spill stores, {kernel.metadata.shared} B shared, "
            f"{wgmma} wgmma in the PTX")


def run_on_gpu(variant: str) -> int:
    """This kernel's ``variant`` through ``check_and_time``. Returns 1 if a parity check fails."""
    import torch

    block_m, block_n, stages, warps = VARIANTS[variant]

    def launch(q, k, v, offsets, max_len, activation):
        T, H, D = q.shape
        out = torch.empty_like(q)
        lse2 = torch.empty(T, H, device=q.device, dtype=torch.float32)
        silu = activation == "silu"
        scale = 1 / math.sqrt(D)
        grid = (offsets.numel() - 1) * H, math.ceil(max_len / block_m)
        _gluon_attn_fwd[grid](q, k, v, out, lse2, offsets, q.stride(0), q.stride(1), H,
                              scale if silu else scale * 1.4426950408889634, 1.0 / max_len,
                              BLOCK_M=block_m, BLOCK_N=block_n, HEAD_D=HEAD_D,
                              STAGES=stages, SILU=silu, num_warps=warps)
        return out

    return check_and_time(launch, variant)


def check_and_time(launch, label: str) -> int:
    """Per activation (softmax, silu with HSTU's norm = max_seqlen): parity of ``launch(q, k, v,
    offsets, max_len, activation) -> out`` against gemcore's reference on jagged lengths, then its
    forward GPU time on dense95 and heavytail beside gemcore's Triton kernel in the same process.
    Returns 1 if any parity check fails."""
    import torch

    from attn_experiment_harness import workload_inputs  # the module beside this script
    from gemcore.bench.attention import GPU_TIME_SPACER_CYCLES
    from gemcore.bench.timing import median_ms
    from gemcore.kernels import jagged_attention
    from gemcore.kernels.jagged_attention_reference import jagged_attention_reference

    failed = 0
    for activation in ("softmax", "silu"):
        torch.manual_seed(0)
        lengths = [0, 1, 2, 127, 128, 129, 300, 1000, 2048, 5]
        offsets = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).cuda()
        q, k, v = (torch.randn(sum(lengths), 4, HEAD_D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        try:
            got = launch(q, k, v, offsets, max(lengths), activation).float()
        except Exception as exc:  # a variant that does not compile or launch here
            print(f"{activation}, {label}: failed {type(exc).__name__}: {str(exc)[:400]}", flush=True)
            failed = 1
            continue
        want = jagged_attention_reference(q.double(), k.double(), v.double(), offsets, causal=True,
                                          activation=activation).float()
        err = ((got - want).norm() / want.norm()).item()
        print(f"{activation}, {label}: parity: relative error {err:.2e} (bf16: expect < 1e-2)", flush=True)
        if not err < 1e-2:
            failed = 1
            continue
        for workload in ("dense95", "heavytail"):
            q, k, v, offsets, max_len, flops, _ = workload_inputs(workload, activation, D=HEAD_D)
            timing = dict(launch_hidden=True, spacer_cycles=GPU_TIME_SPACER_CYCLES)
            ms_gluon = median_ms(lambda: launch(q, k, v, offsets, max_len, activation), **timing)
            ms_triton = median_ms(lambda: jagged_attention(
                q, k, v, offsets, causal=True, activation=activation, max_seqlen=max_len,
                backend="triton", validate=False), **timing)
            print(f"  {workload}: gluon {label} {flops / ms_gluon / 1e9:.0f} TFLOP/s, "
                  f"gemcore triton {flops / ms_triton / 1e9:.0f} TFLOP/s (forward, GPU time)", flush=True)
    return failed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--emulate", action="store_true", help="check the schedule in PyTorch on a CPU")
    ap.add_argument("--variant", choices=sorted(VARIANTS), nargs="+", default=list(VARIANTS))
    args = ap.parse_args()
    if args.emulate:
        return check_emulation()
    if args.compile_only:
        for silu in (False, True):
            for variant in args.variant:
                compile_only(variant, silu)
        return 0
    return max(run_on_gpu(variant) for variant in args.variant)


if __name__ == "__main__":
    sys.exit(main())
