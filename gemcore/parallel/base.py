"""The parallelism interface (hook point ``parallelism``)."""
from __future__ import annotations

import torch
from torch import nn


class Parallelism:
    """Places a model on its device(s) and wraps it for the chosen parallel layout.

    ``rank`` / ``world_size``: this process's place among the data-parallel readers (the sampler
    shards by them). ``fsdp_size``: ranks FSDP2 shards each weight over in ``apply`` (1: weights
    not sharded); the trainer tells the precision policy. ``apply(model, device)`` returns the
    model ready to train. ``describe()`` is a
    one-line summary for logs; ``close()`` releases its process groups at the end of the run.
    The built-in ``single`` is one process with no parallelism.
    """

    name = "single"
    rank = 0
    world_size = 1
    fsdp_size = 1

    def apply(self, model: nn.Module, device: torch.device) -> nn.Module:
        return model.to(device)

    def describe(self) -> str:
        return "single process, no parallelism"

    def close(self) -> None:
        """Release what this parallelism set up (process groups); called once, after the run."""

    def all_reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Average a metric tensor over ranks (identity for one process)."""
        return value
