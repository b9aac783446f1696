"""The block-scaled FP8 kernels compiled ahead of time for Hopper (sm_90) and Ada (sm_89), no GPU
needed: the GEMM must issue FP8 (e4m3) tensor-core MMAs, the casts must compile in every mode.
What they compute is checked in test_fp8_block_triton.py (interpreter on a CPU, or a GPU)."""
import os

import pytest

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="compiles the kernels: not under the interpreter")


def _compile(fn, signature, constexprs, arch, num_warps, num_stages=3):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    return triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


@pytest.mark.parametrize("arch", [90, 89])
@pytest.mark.parametrize("b_rows", [1, 128])
def test_the_gemm_compiles_to_fp8_mma(arch, b_rows):
    from gemcore.kernels.fp8_block_triton import MM_TILE, _fp8_block_mm

    ints = ["M", "N", "K", "stride_am", "stride_ak", "stride_asm", "stride_ask", "stride_bn", "stride_bk",
            "stride_bsn", "stride_bsk", "stride_cm", "stride_cn"]
    tile = {k: v for k, v in MM_TILE.items() if k not in ("num_warps", "num_stages")}
    signature = {"a_ptr": "*u8", "as_ptr": "*fp32", "b_ptr": "*u8", "bs_ptr": "*fp32", "c_ptr": "*bf16",
                 **{n: "i32" for n in ints}, **{n: "constexpr" for n in ("B_ROWS", "DOT_F32", *tile)}}
    kernel = _compile(_fp8_block_mm, signature, {"B_ROWS": b_rows, "DOT_F32": False, **tile}, arch,
                      MM_TILE["num_warps"], MM_TILE["num_stages"])
    ptx = kernel.asm["ptx"]
    if arch == 90:
        assert "wgmma.mma_async" in ptx and "e4m3.e4m3" in ptx, "no FP8 wgmma in the PTX"
    else:
        assert "mma.sync" in ptx and "e4m3" in ptx, "no FP8 mma in the PTX"


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("mode", ["rows", "rows+cols", "square", "square+transpose"])
def test_the_cast_compiles(mode, dtype):
    """Each mode compiles for sm_90 with the hardware conversion and the flushing multiply, from
    bf16 (16-bit tiles) and from float32."""
    from gemcore.kernels.fp8_block_triton import FULL_TILE, ROWS_TILE, SQUARE_TILE, _fp8_block_cast

    rows, cols, square = mode.startswith("rows"), mode.endswith("cols") or mode.endswith("transpose"), \
        mode.startswith("square")
    tile = ROWS_TILE if mode == "rows" else SQUARE_TILE if square else FULL_TILE
    ints = ["R", "C", "R_PAD", "C_PAD", "stride_xr", "stride_xc", "stride_rsr", "stride_rsc", "stride_csr",
            "stride_csc"]
    signature = {"x_ptr": f"*{dtype}", "rdata_ptr": "*u8", "rscale_ptr": "*fp32", "cdata_ptr": "*u8",
                 "cscale_ptr": "*fp32", **{n: "i32" for n in ints},
                 **{n: "constexpr" for n in ("ROWS", "COLS", "SQUARE", "BLOCK_R", "SOFT_ROUND", "B16")}}
    constexprs = {"ROWS": rows, "COLS": cols, "SQUARE": square, "BLOCK_R": tile["BLOCK_R"], "SOFT_ROUND": False,
                  "B16": dtype == "bf16"}
    kernel = _compile(_fp8_block_cast, signature, constexprs, 90, tile["num_warps"])
    ptx = kernel.asm["ptx"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "mul.rn.ftz.f32" in ptx
