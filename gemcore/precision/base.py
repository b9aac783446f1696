"""The precision policy interface (hook point ``precision``) and the autocast policies."""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
from torch import nn


class PrecisionPolicy:
    """How a model computes and communicates.

    ``compute_dtype``: dtype of matrix products in the forward/backward pass.
    ``comm_dtype``: dtype gradients/parameters travel in across ranks.
    ``apply(model, *, fsdp_size=1)``: convert modules in place (e.g. swap nn.Linear for MXLinear);
    returns the model. ``fsdp_size``: ranks FSDP2 will shard each weight over once the
    parallelism is applied (1: not sharded); a policy may prepare its weights for that (an
    all-gather in a low-precision format). The keyword is optional: the trainer passes it only to
    an ``apply`` that takes it.
    ``autocast(device_type)``: context manager wrapped around the forward pass and loss.
    Master weights and optimizer state stay float32 in every built-in policy.
    """

    name = "fp32"
    compute_dtype: torch.dtype = torch.float32
    comm_dtype: torch.dtype = torch.float32

    def apply(self, model: nn.Module, *, fsdp_size: int = 1) -> nn.Module:
        return model

    def autocast(self, device_type: str) -> ContextManager:
        return contextlib.nullcontext()


def check_fsdp_size(fsdp_size: int) -> None:
    """ValueError unless ``fsdp_size`` (ranks FSDP2 shards each weight over) is a positive int."""
    if isinstance(fsdp_size, bool) or not isinstance(fsdp_size, int) or fsdp_size < 1:
        raise ValueError(f"fsdp_size must be a positive int (ranks FSDP2 shards each weight over), "
                         f"got {fsdp_size!r}")


class AutocastPolicy(PrecisionPolicy):
    """Mixed precision through ``torch.autocast``: float32 master weights, ``dtype`` compute."""

    def __init__(self, name: str, dtype: torch.dtype):
        self.name = name
        self.compute_dtype = dtype
        self.comm_dtype = dtype

    def autocast(self, device_type: str) -> ContextManager:
        return torch.autocast(device_type=device_type, dtype=self.compute_dtype)


def denormals_flushed() -> bool:
    """Whether this thread's CPU float arithmetic treats subnormal numbers as zero (FTZ/DAZ)."""
    subnormal = torch.tensor(1e-39, dtype=torch.float32)       # below float32's 1.18e-38
    return bool(subnormal * 1.0 == 0.0)


@contextlib.contextmanager
def flush_denormals(enabled: bool = True):
    """Inside the block, CPU float arithmetic treats subnormal inputs and results as zero
    (``torch.set_flush_denormal``: x86 FTZ/DAZ); the previous mode is restored on exit.

    Training on a CPU drifts into subnormal values (softmax and SiLU tails, squared small
    gradients), whose arithmetic takes a slow path: a hidden-512 GemModel's fp32 step ran 30 %
    slower for it. Values below 1.18e-38 become 0, which no float32 training result
    can tell apart. No effect on CUDA kernels; ``enabled=False`` or a CPU without the mode: nothing
    changes."""
    switch = enabled and not denormals_flushed() and torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if switch:
            torch.set_flush_denormal(False)
