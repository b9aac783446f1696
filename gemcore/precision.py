"""The precision policy interface (hook point ``precision``)."""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
from torch import nn


class PrecisionPolicy:
    """How a model computes and communicates.

    ``compute_dtype``: dtype of matrix products in the forward/backward pass.
    ``comm_dtype``: dtype gradients/parameters travel in across ranks.
    ``apply(model)``: convert modules in place (e.g. swap nn.Linear for MXLinear); returns the model.
    ``autocast(device_type)``: context manager wrapped around the forward pass and loss.
    Master weights and optimizer state stay float32 in every built-in policy.
    """

    name = "fp32"
    compute_dtype: torch.dtype = torch.float32
    comm_dtype: torch.dtype = torch.float32

    def apply(self, model: nn.Module) -> nn.Module:
        return model

    def autocast(self, device_type: str) -> ContextManager:
        return contextlib.nullcontext()


class AutocastPolicy(PrecisionPolicy):
    """Mixed precision through ``torch.autocast``: float32 master weights, ``dtype`` compute."""

    def __init__(self, name: str, dtype: torch.dtype):
        self.name = name
        self.compute_dtype = dtype
        self.comm_dtype = dtype

    def autocast(self, device_type: str) -> ContextManager:
        return torch.autocast(device_type=device_type, dtype=self.compute_dtype)
