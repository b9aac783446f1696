"""Helpers shared by the communication benchmarks (``gem bench comms``, ``gem bench comms_overlap``):
byte sizes, the bf16 GEMM loop and its arithmetic, and robust statistics over repeats."""
from __future__ import annotations

import re
import statistics

import torch

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str, name: str = "size") -> int:
    """``"1K"`` -> 1024, ``"64M"``, ``"1G"``, ``"4096"`` (binary units, like nccl-tests)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)I?B?\s*", str(text).upper())
    if not m:
        raise ValueError(f"{name}: cannot read {text!r} as bytes (e.g. 1K, 64M, 1G)")
    return int(m.group(1)) * _UNITS[m.group(2)]


def gemm_flops(n: int) -> float:
    """Floating-point operations of one ``(n, n) @ (n, n)`` GEMM: 2·n³."""
    return 2.0 * n ** 3


def tflops(flops: float, seconds: float) -> float:
    """TFLOP/s (1e12) of ``flops`` done in ``seconds``."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    return flops / seconds / 1e12


def slowdown_pct(alone: float, during: float) -> float:
    """How much slower (in %) a rate ``during`` is than ``alone``: 100·(alone − during)/alone."""
    if alone <= 0:
        raise ValueError(f"alone must be positive, got {alone}")
    return 100.0 * (alone - during) / alone


def coverage(inner: tuple[float, float], outer: tuple[float, float]) -> float:
    """Share of interval ``inner`` (start, end) that ``outer`` overlaps, in [0, 1]."""
    i0, i1 = inner
    o0, o1 = outer
    if i1 < i0 or o1 < o0:
        raise ValueError(f"intervals must have start <= end, got {inner} and {outer}")
    if i1 == i0:
        return 1.0 if o0 <= i0 <= o1 else 0.0
    return max(0.0, min(i1, o1) - max(i0, o0)) / (i1 - i0)


def check_gemm_args(n: int, iters: int) -> None:
    if n < 1:
        raise ValueError(f"--gemm-n must be >= 1, got {n}")
    if iters < 1:
        raise ValueError(f"--gemm-iters must be >= 1, got {iters}")


# ---------------------------------------------------------------------- the GEMM loop
class GemmLoop:
    """``iters`` GEMMs ``a @ b`` (n x n bfloat16) enqueued on their own stream."""

    def __init__(self, device: torch.device, n: int = 8192, iters: int = 40) -> None:
        check_gemm_args(n, iters)
        self.device, self.n, self.iters = device, n, iters
        self.stream = torch.cuda.Stream(device)
        g = torch.Generator(device=device).manual_seed(0)
        self.a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
        self.b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
        self.out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def enqueue(self) -> None:
        """Queue the loop (returns at once); :meth:`tflops` after ``end`` completes."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.start.record()
            for _ in range(self.iters):
                torch.matmul(self.a, self.b, out=self.out)
            self.end.record()

    def tflops(self) -> float:
        self.end.synchronize()
        return tflops(gemm_flops(self.n) * self.iters, self.start.elapsed_time(self.end) / 1e3)

    def alone(self, warmup: int = 1) -> float:
        """TFLOP/s of the loop with nothing else running (after ``warmup`` unmeasured loops)."""
        for _ in range(warmup):
            self.enqueue()
        self.enqueue()
        return self.tflops()


# ---------------------------------------------------------------------- repeats and noise
def median_spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of ``values`` (at least one)."""
    if not values:
        raise ValueError("median_spread needs at least one value")
    return statistics.median(values), min(values), max(values)


def noise_pct(*runs: list[float]) -> float:
    """The measurement's noise in %: the widest range (max - min) of any of ``runs`` (repeated
    measurements of one quantity each), relative to that run's median."""
    widest = 0.0
    for values in runs:
        mid, lo, hi = median_spread(values)
        if mid:
            widest = max(widest, 100.0 * (hi - lo) / abs(mid))
    return widest


def slowdown_verdict(slowdown: float, noise: float, goal: float) -> str:
    """``met`` / ``NOT met`` for a slowdown goal (all in %), or ``no verdict: why`` when the noise
    decides: a verdict needs the noise below the goal and the whole interval
    ``slowdown ± noise`` on one side of it; a speed-up beyond the noise is suspect, not a pass."""
    if noise >= goal:
        return f"no verdict: the noise (±{noise:.2f}%) is not below the goal ({goal:g}%)"
    if slowdown < -noise:
        return f"no verdict: {-slowdown:.2f}% faster during the transfer, beyond the noise (±{noise:.2f}%): suspect"
    if slowdown + noise <= goal:
        return "met"
    if slowdown - noise > goal:
        return "NOT met"
    return f"no verdict: {slowdown:.2f}% ± {noise:.2f}% straddles the goal ({goal:g}%)"
