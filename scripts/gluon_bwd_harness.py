"""Shared harness of the Gluon backward prototypes (``gluon_attn_bwd_prototype.py`` for dK/dV,
``gluon_attn_bwd_dq_prototype.py`` for dQ): the jagged test problem with its float64 gradients,
softmax's LSE and delta, the ahead-of-time compile for sm_90, and the GPU timing beside
gemcore's whole Triton backward."""
from __future__ import annotations

import math
from typing import Callable

import torch

HEAD_D = 128


def parity_lengths(device: str) -> list[int]:
    """Jagged lengths across the 64-row tile borders, with empty and length-1 sequences (the
    longest ones only on a GPU: the CPU emulation is a Python loop)."""
    short = [0, 1, 2, 63, 64, 65, 127, 128, 129, 300, 5]
    return short if device == "cpu" else short[:-1] + [1000, 2048, 5]


def problem(lengths, device, seed=0):
    """bf16 (q, k, v, dO), all (T, 2, 128), offsets (B+1,) and max_len for causal attention."""
    g = torch.Generator(device=device).manual_seed(seed)
    T, H = sum(lengths), 2
    q, k, v, do = (torch.randn(T, H, HEAD_D, generator=g, device=device).to(torch.bfloat16) for _ in range(4))
    offsets = torch.nn.functional.pad(torch.tensor(lengths, device=device).cumsum(0), (1, 0))
    return q, k, v, do, offsets, max(lengths)


def reference(q, k, v, do, offsets, activation):
    """(out bf16, dq, dk, dv float64) of causal attention in float64 (silu: scale 1/D, HSTU's norm)."""
    from gemcore.kernels.jagged_attention_reference import jagged_attention_reference

    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    out = jagged_attention_reference(q64, k64, v64, offsets, causal=True, activation=activation,
                                     scale=None if activation == "softmax" else 1.0 / q.shape[2])
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), do.double())
    return out.detach().to(torch.bfloat16), dq, dk, dv


def lse2_delta(q, k, out, do, offsets):
    """Softmax's base-2 LSE of the scaled causal scores and delta = rowsum(dO·O), (T, H) float32."""
    T, H, D = q.shape
    lse2 = torch.zeros(T, H, dtype=torch.float64, device=q.device)
    for b in range(offsets.numel() - 1):
        s, e = int(offsets[b]), int(offsets[b + 1])
        if e > s:
            qk = torch.einsum("ihd,jhd->hij", q[s:e].double(), k[s:e].double()) / math.sqrt(D)
            qk = qk.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
            lse2[s:e] = (torch.logsumexp(qk, -1) / math.log(2)).T
    delta = (do.double() * out.double()).sum(-1)
    return lse2.float(), delta.float()


def relative_error(got, want) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def aot_compile(kernel, signature: dict, constexprs: dict, maxnreg: int, label: str) -> None:
    """Compile ``kernel`` for sm_90 ahead of time (no GPU needed) and print what ptxas reports."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from gluon_attn_fwd_prototype import ptxas_report   # the module beside this one

    src = GluonASTSource(kernel, signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": maxnreg})
    print(f"triton {triton.__version__}, {label}: {ptxas_report(compiled)}")


def time_beside_triton_backward(variants: dict[str, Callable], flops_factor: float) -> None:
    """On dense95 and heavytail, softmax and silu: gemcore's whole Triton backward, then each
    ``variants[label](q, k, v, out, do, lse2, delta, offsets, max_len, activation)`` alone, in GPU
    time; its TFLOP/s count ``flops_factor`` x the forward's FLOPs (its MMAs)."""
    from attn_experiment_harness import workload_inputs   # the module beside this one
    from gemcore.bench.attention import GPU_TIME_SPACER_CYCLES
    from gemcore.bench.timing import median_ms
    from gemcore.kernels import jagged_attention

    timing = dict(launch_hidden=True, spacer_cycles=GPU_TIME_SPACER_CYCLES)
    for workload in ("dense95", "heavytail"):
        for activation in ("softmax", "silu"):
            q, k, v, offsets, max_len, flops, kw = workload_inputs(workload, activation)
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            out = jagged_attention(q, k, v, offsets, validate=False, **kw)
            do = torch.randn_like(out)
            ms = median_ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), **timing)
            print(f"{workload} {activation}: gemcore triton backward (dQ + dK/dV) {ms:.2f} ms "
                  f"({2.5 * flops / ms / 1e9:.0f} TFLOP/s)", flush=True)
            # lse2 zeros: the timing does not depend on the values
            lse2 = torch.zeros(q.shape[0], q.shape[1], device="cuda")
            delta = (do.float() * out.float()).sum(-1)
            args = (q.detach(), k.detach(), v.detach(), out.detach(), do, lse2, delta, offsets, max_len, activation)
            for label, fn in variants.items():
                ms = median_ms(lambda fn=fn: fn(*args), **timing)
                print(f"  {label}: {ms:.2f} ms ({flops_factor * flops / ms / 1e9:.0f} TFLOP/s)", flush=True)
