"""Bitwise-reproducible runs: PyTorch's deterministic algorithms for the length of a run.

On a GPU, identical bf16 ``gem train`` runs (jfa, hidden 512 x 4 blocks) drifted apart after 26
steps (H200, session 24): some PyTorch CUDA kernels accumulate with atomics, in whatever order the
threads arrive. ``torch.use_deterministic_algorithms(True)`` swaps in ordered kernels (or raises
for an op that has none) and cuBLAS needs a fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, read when
its handle is created); with both, two identical runs agreed bit for bit over 60 steps. gemcore's own Triton
attention kernels use no atomics. On a CPU the runs already agree (the checkpoint tests prove it).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

#: cuBLAS's deterministic workspace setting (CUDA's "results reproducibility" section)
CUBLAS_WORKSPACE = ":4096:8"


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool = True) -> Iterator[None]:
    """Within the block, PyTorch uses only deterministic algorithms (an op without one raises
    RuntimeError naming it) and cuBLAS a fixed workspace; the previous settings come back after.
    Set it up before the run's first CUDA matrix product: cuBLAS reads its workspace setting once
    per handle. ``enabled=False`` changes nothing."""
    if not enabled:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if workspace is None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
