"""Bitwise-reproducible runs: PyTorch's deterministic algorithms for the length of a run.

On a GPU, identical bf16 ``gem train`` runs (jfa, hidden 512 x 4 blocks) drifted apart after 26
steps (H200). Two backward passes of the same batch from the same weights differed in
one batch of 40, in the gradients of the action and time-gap embeddings alone: tables of 5 and 32
rows that every token reads, whose CUDA backward sums the tokens' gradients per row in an order
that varies from call to call. ``torch.use_deterministic_algorithms(True)`` swaps in ordered
kernels (or raises for an op that has none) and cuBLAS needs a fixed workspace
(``CUBLAS_WORKSPACE_CONFIG``, read when its handle is created); with both, identical runs agreed bit
for bit (one pair of 60 steps, three pairs of 200). gemcore's own Triton attention kernels use no atomics. On a
CPU, runs on one thread agree bit for bit; on two threads one of five identical 20-step runs
logged one loss one float32 ulp off (its parameters stayed equal), and three of three agreed with
this on.

PyTorch's deterministic mode also fills every new tensor's memory (NaN for floats) unless told not
to; that is a check for reads of memory nothing wrote, not needed for reproducibility (the runs
agreed bit for bit without it), and it cost the hidden-512 run about 22 % of its tokens/s against
about 10 % without it (medians of 2-6 runs). The block turns it off; to debug, set
``torch.utils.deterministic.fill_uninitialized_memory`` inside it.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.utils.deterministic

#: cuBLAS's deterministic workspace setting (CUDA's "results reproducibility" section)
CUBLAS_WORKSPACE = ":4096:8"


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool = True) -> Iterator[None]:
    """Within the block, PyTorch uses only deterministic algorithms (an op without one raises
    RuntimeError naming it), without filling new memory, and cuBLAS a fixed workspace; the previous
    settings come back after. Enter it before the run's first CUDA matrix product: cuBLAS reads its
    workspace setting once per handle. ``enabled=False`` changes nothing."""
    if not enabled:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory)
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if workspace is None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = before[2]
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
