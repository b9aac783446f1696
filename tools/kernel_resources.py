"""Registers and spills of gemcore's GPU kernels, built ahead of time: no GPU needed.

Each kernel is compiled for an NVIDIA target (default sm_90, Hopper) by the installed Triton, and
the cubin's resource usage is read with the ``cuobjdump`` that ships in Triton's NVIDIA backend.
A kernel that spills (``stack`` > 0: bytes of local memory a thread) moves extra bytes through
the caches, which is what to look at first when a memory-bound kernel runs below the copy speed.

    python tools/kernel_resources.py                        # every kernel, its default warps
    python tools/kernel_resources.py --kernels swiglu_fwd,swiglu_bwd --warps 4,8,16

Prints one line a kernel and warp count: registers a thread, stack (spill) bytes a thread and
static shared memory bytes. Triton versions differ: build with the Triton the GPU machine runs
(``PYTHONPATH`` to a side install works) to read what that machine will run.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Callable

_USAGE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)")


@dataclass
class Resources:
    kernel: str
    warps: int
    registers: int
    stack_bytes: int
    shared_bytes: int


def cuobjdump() -> str:
    """The ``cuobjdump`` of Triton's NVIDIA backend.

    :raises FileNotFoundError: this Triton has none (not an NVIDIA build).
    """
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no cuobjdump in triton {triton.__version__}'s NVIDIA backend ({path})")
    return path


def cubin_resources(cubin: bytes) -> tuple[int, int, int]:
    """(registers, stack bytes, shared bytes) of a cubin's one kernel, from ``cuobjdump``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    match = _USAGE.search(out)
    if match is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {out[-300:]!r}")
    return tuple(int(v) for v in match.groups())


def _triton_build(fn, signature: dict, constexprs: dict, arch: int, warps: int, **options):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    return triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps, **options})


def _cast(mode: str) -> Callable:
    def build(arch: int, warps: int | None):
        from gemcore.kernels import fp8_block_triton as ft

        tile = {"rows": ft.ROWS_TILE, "rows_cols": ft.FULL_TILE, "weight": ft.SQUARE_TILE}[mode]
        ints = ["R", "C", "R_PAD", "C_PAD", "stride_xr", "stride_xc", "stride_rsr", "stride_rsc", "stride_csr",
                "stride_csc"]
        signature = {"x_ptr": "*fp32" if mode == "weight" else "*bf16", "rdata_ptr": "*u8", "rscale_ptr": "*fp32",
                     "cdata_ptr": "*u8", "cscale_ptr": "*fp32", **dict.fromkeys(ints, "i32"),
                     **dict.fromkeys(("ROWS", "COLS", "SQUARE", "BLOCK_R", "SOFT_ROUND", "B16"), "constexpr")}
        constexprs = {"ROWS": mode != "weight", "COLS": mode != "rows", "SQUARE": mode == "weight",
                      "BLOCK_R": tile["BLOCK_R"], "SOFT_ROUND": False, "B16": mode != "weight"}
        w = warps or tile["num_warps"]
        return _triton_build(ft._fp8_block_cast, signature, constexprs, arch, w), w
    return build


def _swiglu(backward: bool) -> Callable:
    def build(arch: int, warps: int | None):
        from gemcore.kernels import fp8_swiglu_triton as sw

        ints = ["M", "F", "R_PAD", "C_PAD", "stride_gm", "stride_gc", "stride_dm", "stride_dc", "stride_rsr",
                "stride_rsc", "stride_csr", "stride_csc"]
        signature = dict(gu_ptr="*bf16", dh_ptr="*bf16", rdata_ptr="*u8", rscale_ptr="*fp32", cdata_ptr="*u8",
                         cscale_ptr="*fp32", **dict.fromkeys(ints, "i32"), BACKWARD="constexpr",
                         BLOCK_R="constexpr", SOFT_ROUND="constexpr")
        w = warps or sw.SWIGLU_WARPS["backward" if backward else "forward"]
        constexprs = {"BACKWARD": backward, "BLOCK_R": sw.SWIGLU_TILE["BLOCK_R"], "SOFT_ROUND": False}
        return _triton_build(sw._swiglu_cast, signature, constexprs, arch, w), w
    return build


def _descriptor_type(rows: int, head_dim: int = 128) -> str:
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.bfloat16)
    return f"tensordesc<bf16[{rows}, {head_dim}],{layout!r}>"


def _attention(part: str) -> Callable:
    """The Gluon attention kernels, softmax, causal with targets, D = 128, persistent (4 warps a
    partition; their warp count is fixed by the kernel)."""
    def build(arch: int, warps: int | None):
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.experimental.gluon._runtime import GluonASTSource

        from gemcore.kernels import jagged_attention_gluon as fwd
        from gemcore.kernels import jagged_attention_gluon_bwd as bwd

        flags = dict(ACTIVATION=0, CAUSAL=True, HAS_TARGETS=True, PERSISTENT=True)
        scalars = dict(n_listed="*i32", n_seq="i32")
        if part == "fwd":
            block_n, stages = fwd.TILES["softmax"]
            fn = fwd._jagged_attn_fwd_hopper
            signature = dict(q_desc=_descriptor_type(64), k_desc=_descriptor_type(block_n),
                             v_desc=_descriptor_type(block_n), O="*bf16", LSE2="*fp32", kv_offsets="*i64",
                             num_targets="*i64", stride_t="i32", H="i32", work="*i32", **scalars,
                             qk_scale="fp32", inv_norm="fp32")
            flags.update(STAGES=stages, CROSS=False)
        elif part == "dq":
            _, slot, stages = bwd.DQ_TILE
            fn = bwd._jagged_attn_bwd_dq_hopper
            signature = dict(q_desc=_descriptor_type(64), do_desc=_descriptor_type(64),
                             k_desc=_descriptor_type(slot), v_desc=_descriptor_type(slot), DQ="*bf16", O="*bf16",
                             LSE2="*fp32", DELTA="*fp32", num_targets="*i64", stride_t="i32", stride_o="i32",
                             H="i32", work="*i32", **scalars, scale="fp32", qk_scale="fp32", inv_norm="fp32")
            flags.update(STAGES=stages)
        else:
            _, slot, stages = bwd.DKDV_TILE
            fn = bwd._jagged_attn_bwd_dkdv_hopper
            signature = dict(k_desc=_descriptor_type(64), v_desc=_descriptor_type(64),
                             q_desc=_descriptor_type(slot), do_desc=_descriptor_type(slot), DK="*bf16", DV="*bf16",
                             LSE2="*fp32", DELTA="*fp32", num_targets="*i64", stride_t="i32", H="i32",
                             work="*i32", **scalars, scale="fp32", qk_scale="fp32", inv_norm="fp32")
            flags.update(STAGES=stages)
        signature.update(dict.fromkeys(flags, "constexpr"))
        kernel = triton.compile(GluonASTSource(fn, signature, constexprs=flags), target=GPUTarget("cuda", arch, 32),
                                options={"num_warps": 4, "maxnreg": fwd.MAXNREG})
        return kernel, 4
    return build


#: kernel name -> builder(arch, warps or None for the kernel's own) -> (compiled kernel, warps)
KERNELS: dict[str, Callable] = {
    "fp8_cast_rows": _cast("rows"),
    "fp8_cast_rows_cols": _cast("rows_cols"),
    "fp8_cast_weight": _cast("weight"),
    "swiglu_fwd": _swiglu(False),
    "swiglu_bwd": _swiglu(True),
    "attention_fwd": _attention("fwd"),
    "attention_bwd_dq": _attention("dq"),
    "attention_bwd_dkdv": _attention("dkdv"),
}
#: the kernels whose warp count is fixed by their design (``--warps`` leaves them as they are)
FIXED_WARPS = ("attention_fwd", "attention_bwd_dq", "attention_bwd_dkdv")


def measure(name: str, arch: int = 90, warps: int | None = None) -> Resources:
    """Build kernel ``name`` (:data:`KERNELS`) for sm_``arch`` with ``warps`` (None: its own) and
    read its resources."""
    if name not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {name!r}")
    kernel, used = KERNELS[name](arch, None if name in FIXED_WARPS else warps)
    return Resources(name, used, *cubin_resources(kernel.asm["cubin"]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default=",".join(KERNELS), help=f"comma list of {', '.join(KERNELS)}")
    ap.add_argument("--warps", default="", help="comma list of warp counts to build the Triton kernels with "
                                                 "(default: each kernel's own)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: Hopper)")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.kernels.split(",") if n.strip()]
    unknown = [n for n in names if n not in KERNELS]
    if unknown:
        ap.error(f"--kernels: unknown {', '.join(unknown)}; choose from {', '.join(KERNELS)}")
    try:
        warp_counts = [int(w) for w in args.warps.split(",") if w.strip()] or [None]
    except ValueError:
        ap.error(f"--warps must be a comma list of integers, got {args.warps!r}")
    if any(w is not None and (w < 1 or w & (w - 1)) for w in warp_counts):
        ap.error(f"--warps: each count must be a power of two, got {args.warps!r}")
    import triton

    print(f"triton {triton.__version__}, sm_{args.arch}: registers and spills a thread")
    for name in names:
        for w in (warp_counts if name not in FIXED_WARPS else [None]):
            r = measure(name, args.arch, w)
            print(f"{r.kernel:20s} warps {r.warps:2d}  registers {r.registers:3d}  stack (spill) {r.stack_bytes:5d} B"
                  f"  static shared {r.shared_bytes} B", flush=True)


if __name__ == "__main__":
    main()
