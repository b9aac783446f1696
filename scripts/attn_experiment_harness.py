"""Shared harness of the device experiments on the jagged attention forward
(scripts/attn_fwd_experiment.py, scripts/attn_pipelined_experiment.py): ANCHORS.md's workload
inputs and the sweep that times each variant against gemcore's output."""
from __future__ import annotations

import time
from typing import Callable, Iterable

import torch

from gemcore.bench.attention import useful_fwd_flops, workload_lengths
from gemcore.bench.timing import median_ms


def workload_inputs(workload: str, act: str, H: int = 4, D: int = 128):
    """(q, k, v, offsets, max_len, flops, kw): bf16 inputs of ``workload`` on the GPU, its useful
    causal forward FLOPs, and gemcore's ``jagged_attention`` keywords for ``act`` (the non-softmax
    activations with scale 1/D and norm max_len, as the experiments' kernels take them)."""
    lengths, _ = workload_lengths(workload)
    torch.manual_seed(0)
    T = int(lengths.sum())
    q, k, v = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64, device="cuda")
    offsets[1:] = lengths.cumsum(0).cuda()
    max_len = int(lengths.max())
    kw = dict(activation=act, causal=True, backend="triton", max_seqlen=max_len)
    if act != "softmax":
        kw.update(scale=1.0 / D, norm=max_len)
    return q, k, v, offsets, max_len, useful_fwd_flops(lengths, None, H, D, causal=True), kw


def sweep(configs: Iterable[tuple], make_fn: Callable[[tuple], Callable[[], torch.Tensor]],
          ref: torch.Tensor, flops: float, deadline: float) -> bool:
    """Time every config's kernel (``make_fn(cfg)`` returns the call) and print its useful TFLOP/s
    and max |diff| against ``ref``; a config that fails to compile prints why. False once
    ``deadline`` (time.time()) has passed."""
    for cfg in configs:
        if time.time() > deadline:
            print("deadline reached", flush=True)
            return False
        try:
            fn = make_fn(cfg)
            out = fn()
            torch.cuda.synchronize()
            err = (out.float() - ref.float()).abs().max().item()
            ms = median_ms(fn)
            print(f"  {cfg}: {flops / ms / 1e9:.0f} TFLOP/s  max|diff| {err:.2e}", flush=True)
        except Exception as exc:  # a variant that does not compile here
            print(f"  {cfg}: failed {type(exc).__name__}: {str(exc)[:160]}", flush=True)
    return True
