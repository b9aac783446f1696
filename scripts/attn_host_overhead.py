"""Host time per call of gemcore's jagged attention and of varlen_attn on a tiny input (one
sequence of 16 tokens, H=4, D=128, bf16): the GPU work is microseconds, so back-to-back calls run
at the host's pace. Prints microseconds per forward and per forward+backward call.
Run on the GPU: ``python3 scripts/attn_host_overhead.py``."""
from __future__ import annotations

import time

import torch

from gemcore.kernels import jagged_attention


def per_call_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (torch.randn(16, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    off = torch.tensor([0, 16], device="cuda", dtype=torch.int64)
    off32 = off.to(torch.int32)
    grad = torch.randn(16, 4, 128, device="cuda", dtype=torch.bfloat16)
    calls = {
        "gemcore softmax": lambda: jagged_attention(q, k, v, off, causal=True, max_seqlen=16,
                                                    backend="triton", validate=False),
        "gemcore silu": lambda: jagged_attention(q, k, v, off, causal=True, max_seqlen=16,
                                                 activation="silu", backend="triton", validate=False),
        "varlen_attn": lambda: varlen_attn(q, k, v, off32, off32, 16, 16, window_size=(-1, 0)),
    }
    for name, f in calls.items():
        with torch.no_grad():
            fwd = per_call_us(f)
        fb = per_call_us(lambda f=f: torch.autograd.grad(f(), (q, k, v), grad))
        print(f"{name:16s} host per call: fwd {fwd:6.1f} us, fwd+bwd {fb:6.1f} us", flush=True)


if __name__ == "__main__":
    main()
