"""The ``tl.dot_scaled`` MX GEMM compiled ahead of time (no GPU needed): for Blackwell (sm_100),
where it is the native block-scaled MMA, and for Hopper (sm_90), where Triton emulates it. What it
computes is checked in test_mx_triton.py (the interpreter on a CPU, the GPU where there is one)."""
import os

import pytest

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="compiles the kernel: not under the interpreter")


@pytest.mark.parametrize("arch", [100, 90])
@pytest.mark.parametrize("a_format,b_format", [("e4m3", "e4m3"), ("e4m3", "e5m2")])
def test_the_scaled_mx_gemm_compiles(arch, a_format, b_format):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gemcore.kernels.mx_gemm import SCALED_TILE, _mx_mm_scaled

    ints = ["M", "N", "K", "stride_am", "stride_ak", "stride_asm", "stride_ask", "stride_bk", "stride_bn",
            "stride_bsk", "stride_bsn", "stride_cm", "stride_cn"]
    signature = {"a_ptr": "*u8", "as_ptr": "*u8", "b_ptr": "*u8", "bs_ptr": "*u8", "c_ptr": "*bf16",
                 **{name: "i32" for name in ints},
                 **{name: "constexpr" for name in ("A_FORMAT", "B_FORMAT", "BLOCK_M", "BLOCK_N", "KB", "GROUP_M")}}
    tile = {k: v for k, v in SCALED_TILE.items() if k not in ("num_warps", "num_stages")}
    constexprs = {"A_FORMAT": a_format, "B_FORMAT": b_format, **tile}
    kernel = triton.compile(ASTSource(_mx_mm_scaled, signature, constexprs=constexprs),
                            target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": SCALED_TILE["num_warps"], "num_stages": SCALED_TILE["num_stages"]})
    ptx = kernel.asm["ptx"]
    if arch == 100:     # the tensor cores' block-scaled MMA, scales applied inside it
        assert "tcgen05.mma" in ptx and "block_scale" in ptx, "no block-scaled tcgen05 MMA in the PTX"
    else:               # Hopper: emulated on bf16 wgmmas
        assert "wgmma.mma_async" in ptx
