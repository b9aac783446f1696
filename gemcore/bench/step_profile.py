"""Where a training step's GPU time goes: kernel time per step, by kind of kernel (torch.profiler).

``gem bench train --profile`` prints one line per configuration (``--profile-top N`` adds its N
costliest kernels), e.g.
``gemm 21.4 | attention 9.6 | fp8 casts 9.1 | compiled elementwise 10.6 | optimizer 7.8 | ...``
(ms per step, summed kernel time: kernels on two streams at once count twice). Kinds are told
apart by kernel name (:data:`KINDS`, first match wins).
"""
from __future__ import annotations

import re
from typing import Callable

#: (kind, pattern searched in the lower-cased kernel name), first match wins
KINDS: tuple[tuple[str, re.Pattern], ...] = tuple((kind, re.compile(pattern)) for kind, pattern in (
    # gemcore's jagged attention and its work lists, FlashAttention (varlen_attn), FlexAttention
    ("attention", r"jagged_attn|work_list|flash|fmha|flex_attention|attn_fwd|attn_bwd"),
    # gemcore's FP8 casts (the SwiGLU one included), before "gemm" and "fp8" GEMM names
    ("fp8 casts", r"_fp8_block_cast|_swiglu_cast"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|_fp8_block_mm|_mx_mm|scaled_mm"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("compiled elementwise", r"^triton_(poi|red|per)_"),
    ("embedding", r"embedding|index_select|indexselect|indexing_backward|index_put|scatter|gather"),
    ("copy and fill", r"memcpy|memset|copy|fill"),
))


def kernel_kind(name: str) -> str:
    """The kind of the CUDA kernel called ``name`` (:data:`KINDS`), else "other"."""
    lowered = name.lower()
    for kind, pattern in KINDS:
        if pattern.search(lowered):
            return kind
    return "other"


def gpu_ms_by_kind(kernels: list[tuple[str, float]], steps: int) -> dict[str, float]:
    """{kind: ms per step} of (kernel name, total µs) pairs recorded over ``steps`` steps, the
    largest first, plus "total"."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    sums: dict[str, float] = {}
    for name, us in kernels:
        kind = kernel_kind(name)
        sums[kind] = sums.get(kind, 0.0) + us / 1e3 / steps
    out = dict(sorted(sums.items(), key=lambda kv: -kv[1]))
    out["total"] = sum(sums.values())
    return out


def top_kernels(kernels: list[tuple[str, float, int]], steps: int, n: int) -> list[dict]:
    """The ``n`` kernels with the most time of (kernel name, total µs, calls) recorded over
    ``steps`` steps, the largest first: name, kind, ms and calls per step, µs per call."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    rows = sorted(kernels, key=lambda k: -k[1])[:max(0, n)]
    return [{"name": name, "kind": kernel_kind(name), "ms_per_step": us / 1e3 / steps,
             "calls_per_step": calls / steps, "us_per_call": us / calls if calls else 0.0}
            for name, us, calls in rows]


def profile_steps(run: Callable[[], None], steps: int,
                  top: int = 0) -> tuple[dict[str, float], list[dict], float]:
    """(:func:`gpu_ms_by_kind`, :func:`top_kernels` of the ``top`` largest, kernels a step) of
    ``run()``, which runs ``steps`` training steps on a CUDA GPU."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = [(e.key, e.self_device_time_total, e.count) for e in prof.key_averages()
               if e.device_type == DeviceType.CUDA]
    return (gpu_ms_by_kind([(name, us) for name, us, _ in kernels], steps), top_kernels(kernels, steps, top),
            sum(calls for _, _, calls in kernels) / steps)


def format_top(rows: list[dict]) -> list[str]:
    """One line a kernel: ms per step, calls per step, µs per call, kind, name (cut to 90 characters)."""
    return [f"{r['ms_per_step']:7.2f} ms {r['calls_per_step']:6.1f}x {r['us_per_call']:8.1f} us  "
            f"{r['kind']:20s} {r['name'][:90]}" for r in rows]


def format_breakdown(ms_by_kind: dict[str, float], step_ms: float | None = None,
                     kernels: float | None = None) -> str:
    """One line: ``GPU busy 50.1 ms (95 % of the 52.7 ms step) | gemm 21.4 | attention 9.6 | ...``,
    then, given the kernels a step, ``| 1,800 kernels, idle 1.4 us each`` (the step's idle time
    over its kernels: what each launch leaves the GPU waiting, on average)."""
    total = ms_by_kind.get("total", 0.0)
    head = f"GPU busy {total:.1f} ms"
    if step_ms:
        head += f" ({100 * total / step_ms:.0f} % of the {step_ms:.1f} ms step)"
    parts = [f"{kind} {ms:.1f}" for kind, ms in ms_by_kind.items() if kind != "total"]
    if kernels:
        idle = f", idle {1e3 * max(step_ms - total, 0.0) / kernels:.1f} us each" if step_ms else ""
        parts.append(f"{kernels:,.0f} kernels{idle}")
    return " | ".join([head] + parts)
