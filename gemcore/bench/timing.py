"""CUDA-event timing shared by the benchmarks: median of per-call event timings after warm-up
(the method of the anchor figures in docs/benchmarks.md)."""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch


#: GPU cycles of the spacer kernel of ``launch_hidden`` timing (~0.1 ms at H100/H200 clocks)
SPACER_CYCLES = 200_000


def median_ms(fn: Callable[[], object], iters: int | None = None, *, warmup: int = 3,
              rep_ms: float = 200.0, launch_hidden: bool = False,
              spacer_cycles: int = SPACER_CYCLES) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream.

    ``iters`` calls are timed; when None, as many as fit in about ``rep_ms`` (5 to 200), judged
    from three calls after the warm-up. ``launch_hidden``: each timed call is queued behind a
    ~0.1 ms spacer kernel, so the start event fires only after the host has issued ``fn``'s
    launches; the time is then the GPU's alone (for kernels of tens of microseconds, where the
    host's Python and launch work would otherwise be counted). ``spacer_cycles`` sets the
    spacer's length: it must outlast the host's work for one call of ``fn``.
    """
    for _ in range(max(1, warmup)):
        fn()
    torch.cuda.synchronize()
    if iters is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        end.synchronize()
        iters = max(5, min(200, int(rep_ms / max(start.elapsed_time(end) / 3, 1e-3))))
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if launch_hidden:
            torch.cuda._sleep(spacer_cycles)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


_CYCLES_PER_S: dict[int, float] = {}


def spacer_cycles_per_s(device: torch.device) -> float:
    """``torch.cuda._sleep`` cycles per second on ``device`` (measured once), to size a spacer
    that must outlast a given host time."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CYCLES_PER_S:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_S[index] = 10_000_000 / (start.elapsed_time(end) / 1e3)
    return _CYCLES_PER_S[index]


def linear_fwd_bwd(module, x, dy) -> Callable[[], None]:
    """One forward + backward of ``module`` on ``x`` (tokens, in) under bf16 autocast, with output
    gradient ``dy`` (tokens, out): the step the linear-layer benchmarks time."""
    def step() -> None:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            y = module(x)
        y.backward(dy)
    return step


def queued_gpu_ms(fn: Callable[[], object], calls: int, host_ms: float, *,
                  before: Callable[[], object] | None = None) -> float:
    """GPU milliseconds per call of ``fn`` with the host's enqueue hidden: a spacer kernel that
    outlasts the enqueue of ``calls`` calls (three times ``host_ms`` per call, at least 1 ms),
    then the calls between two CUDA events, so that they run back to back on the GPU. ``before``
    runs after the device is idle, just before the spacer (a barrier of every rank, for
    collectives). NaN when the enqueue outlasted the spacer."""
    device = torch.device("cuda", torch.cuda.current_device())
    spacer_s = max(3 * calls * host_ms / 1e3, 1e-3)
    torch.cuda.synchronize()
    if before is not None:
        before()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(spacer_s * spacer_cycles_per_s(device)))
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    enqueue_s = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    if enqueue_s > 0.8 * spacer_s:
        return math.nan
    return start.elapsed_time(end) / calls
