"""``gem plan --calibrate``: measure this machine's rates and plan with them instead of datasheets.

Measured: a square GEMM (bf16 on CUDA, fp32 on CPU), causal scaled-dot-product attention
forward + backward, a device copy (memory bandwidth) and, when a process group is initialised
(``torchrun``), an all-reduce's bus bandwidth, used for both intra- and inter-node links. On a CPU
without a launcher the link figures stay the GPU table's: nothing can be measured there.
The measured GEMM rate becomes the peak (efficiency 1), so MFU is relative to what was measured.
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F

from gemcore.planner.cluster import Cluster


def _timed(fn, repeats: int = 5) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure(size: int | None = None) -> dict[str, float]:
    """Rates of this device: gemm_flops, attention_flops (fwd+bwd, causal), copy_bytes_per_s and,
    under a process group, allreduce_busbw (bytes/s)."""
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    n = size or (8192 if cuda else 512)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    out = {"gemm_flops": 2 * n ** 3 / _timed(lambda: a @ b)}
    B, H, L, D = (4, 16, 4096, 128) if cuda else (2, 4, 512, 64)
    q, k, v = (torch.randn(B, H, L, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

    def attention():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    out["attention_flops"] = 3.5 * 2 * B * H * L * L * D / _timed(attention)  # 4·L²·D·H·B / 2 fwd
    src = torch.empty(64 * 2 ** 20 // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    out["copy_bytes_per_s"] = 2 * src.numel() * 4 / _timed(lambda: dst.copy_(src))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        buf = torch.ones(16 * 2 ** 20 // 4, device=device)
        world = dist.get_world_size()
        t = _timed(lambda: dist.all_reduce(buf))
        out["allreduce_busbw"] = buf.numel() * 4 / t * 2 * (world - 1) / world
    return out


def calibrate_cluster(cluster: Cluster, rates: dict[str, float] | None = None) -> tuple[Cluster, dict]:
    """``cluster`` with its GPU figures replaced by measured ``rates`` (measured now if None)."""
    rates = rates or measure()
    gpu = dataclasses.replace(
        cluster.gpu, name=cluster.gpu.name + "-calibrated",
        peak_bf16_tflops=rates["gemm_flops"] / 1e12, gemm_efficiency=1.0,
        attention_efficiency=min(1.0, rates["attention_flops"] / rates["gemm_flops"]),
        hbm_gbps=rates["copy_bytes_per_s"] / 1e9, memory_efficiency=1.0)
    if "allreduce_busbw" in rates:
        gbps = rates["allreduce_busbw"] / 1e9
        gpu = dataclasses.replace(gpu, intra_node_gbps=gbps, inter_node_gbps=gbps, link_efficiency=1.0)
    summary = {k: float(f"{v:.4g}") for k, v in rates.items()}
    return dataclasses.replace(cluster, gpu=gpu), summary


__all__ = ["measure", "calibrate_cluster"]
