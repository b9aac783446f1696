"""Benchmark timing: GPU-alone timing hides the host's enqueue."""
from __future__ import annotations

import math
import time

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (times CUDA events)")
def test_queued_gpu_ms_times_the_gpu_not_the_host():
    """Calls whose host work (200 µs) outlasts their GPU work (50 µs) read as 50 µs."""
    from gemcore.bench.timing import queued_gpu_ms, spacer_cycles_per_s

    cycles = int(spacer_cycles_per_s(torch.device("cuda")) * 50e-6)

    def call():
        time.sleep(200e-6)
        torch.cuda._sleep(cycles)

    ms = queued_gpu_ms(call, 10, host_ms=0.3)
    assert 0.04 <= ms <= 0.075, ms


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (times CUDA events)")
def test_queued_gpu_ms_is_nan_when_the_spacer_is_too_short():
    """A host estimate far below the real host time leaves the enqueue unhidden: NaN, not a number."""
    from gemcore.bench.timing import queued_gpu_ms

    def call():
        time.sleep(2e-3)
        torch.cuda._sleep(1000)

    assert math.isnan(queued_gpu_ms(call, 5, host_ms=0.01))
