"""The training step's GPU time by kind of kernel (gem bench train --profile): the name rules and the sums."""
import pytest

from gemcore.bench.step_profile import format_breakdown, format_top, gpu_ms_by_kind, kernel_kind, top_kernels


@pytest.mark.parametrize("name, kind", [
    ("_jagged_attn_fwd_hopper", "attention"),
    ("_jagged_attn_bwd_dkdv", "attention"),
    ("_work_list_kernel", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention"),
    ("triton_tem_fused_flex_attention_0", "attention"),
    ("_fp8_block_cast", "fp8 casts"),
    ("_swiglu_cast", "fp8 casts"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NNT", "gemm"),
    ("_fp8_block_mm", "gemm"),
    ("void at::native::(anonymous namespace)::fused_adamw_kernel<float>", "optimizer"),
    ("void at::native::multi_tensor_apply_kernel<TensorListMetadata<4>>", "optimizer"),
    ("triton_poi_fused__to_copy_add_mul_0", "compiled elementwise"),
    ("triton_red_fused_mean_pow_1", "compiled elementwise"),
    ("triton_per_fused_add_2", "compiled elementwise"),
    ("void at::native::indexSelectLargeIndex<float, long, unsigned int, 2, 2, -2, true>", "embedding"),
    ("void at::native::(anonymous namespace)::embedding_backward_feature_kernel<float>", "embedding"),
    ("Memset (Device)", "copy and fill"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "copy and fill"),
    ("void at::native::reduce_kernel<512, 1>", "other"),
])
def test_kernel_names_sort_into_kinds(name, kind):
    assert kernel_kind(name) == kind


def test_breakdown_sums_per_step_largest_first():
    kernels = [("nvjet_gemm_a", 3000.0), ("_jagged_attn_fwd_hopper", 1000.0), ("nvjet_gemm_b", 1000.0),
               ("triton_poi_fused_add_0", 2000.0), ("reduce_kernel", 500.0)]
    out = gpu_ms_by_kind(kernels, steps=2)
    assert list(out) == ["gemm", "compiled elementwise", "attention", "other", "total"]
    assert out["gemm"] == pytest.approx(2.0) and out["attention"] == pytest.approx(0.5)
    assert out["total"] == pytest.approx(3.75)
    line = format_breakdown(out, step_ms=5.0)
    assert line.startswith("GPU busy 3.8 ms (75 % of the 5.0 ms step)") and "gemm 2.0" in line
    assert "total" not in line


def test_breakdown_refuses_no_steps():
    with pytest.raises(ValueError, match="steps must be >= 1"):
        gpu_ms_by_kind([], steps=0)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        top_kernels([], steps=0, n=3)


def test_top_kernels_are_the_costliest_per_step():
    kernels = [("triton_poi_fused_add_0", 800.0, 8), ("_swiglu_cast", 4000.0, 4), ("nvjet_gemm", 2000.0, 20)]
    rows = top_kernels(kernels, steps=2, n=2)
    assert [r["name"] for r in rows] == ["_swiglu_cast", "nvjet_gemm"]
    assert rows[0] == {"name": "_swiglu_cast", "kind": "fp8 casts", "ms_per_step": pytest.approx(2.0),
                       "calls_per_step": 2.0, "us_per_call": 1000.0}
    assert top_kernels(kernels, steps=2, n=0) == []
    line = format_top(rows)[1]
    assert "1.00 ms" in line and "10.0x" in line and "100.0 us" in line and line.endswith("nvjet_gemm")


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU (profiles CUDA kernels)")
def test_profile_of_real_steps_sorts_their_kernels():
    """A step with a GEMM, an elementwise op and a fused AdamW: their kernels land in those kinds,
    and the per-step sum is the profiled kernel time over the steps."""
    import torch

    from gemcore.bench.step_profile import profile_steps

    w = torch.nn.Parameter(torch.randn(1024, 1024, device="cuda"))
    opt = torch.optim.AdamW([w], fused=True)
    x = torch.randn(2048, 1024, device="cuda")

    def steps():
        for _ in range(3):
            (x @ w).relu().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    steps()
    torch.cuda.synchronize()
    out, top, kernels = profile_steps(steps, 3, top=2)
    assert kernels >= 3  # a GEMM forward, its backward and the optimizer at least
    assert out["gemm"] > 0 and out["optimizer"] > 0
    assert len(top) == 2 and top[0]["ms_per_step"] >= top[1]["ms_per_step"] > 0
    assert out["total"] == pytest.approx(sum(v for kind, v in out.items() if kind != "total"))
