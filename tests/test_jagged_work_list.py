"""The work-list kernel of the persistent Gluon attention kernels, compiled for sm_90 ahead of time
(no GPU needed; what it computes is checked in test_jagged_attention_triton.py, in the interpreter
on a CPU and on the GPU)."""
import os

import pytest

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="compiles the kernel: not under the interpreter")


@pytest.mark.parametrize("query,key,one_chunk", [(True, False, True), (False, True, False), (True, True, True),
                                                (True, True, False)])
def test_the_list_kernel_compiles_for_sm90(query, key, one_chunk):
    """Ahead of time, no GPU needed: every variant the launchers use (the interpreter above checks
    what they compute)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gemcore.kernels.jagged_work_list import _work_list_kernel

    signature = {"offsets": "*i64", "q_work": "*i32", "q_listed": "*i32", "k_work": "*i32", "k_listed": "*i32",
                 "B": "i32", "n_levels": "i32", "QUERY": "constexpr", "KEY": "constexpr", "TILE": "constexpr",
                 "BLOCK_B": "constexpr", "ONE_CHUNK": "constexpr"}
    constexprs = {"QUERY": query, "KEY": key, "TILE": 128, "BLOCK_B": 256, "ONE_CHUNK": one_chunk}
    kernel = triton.compile(ASTSource(_work_list_kernel, signature, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert "st.global" in kernel.asm["ptx"]
