"""Backend ``single``: one process, world 1. Every collective is a copy (or nothing)."""
from __future__ import annotations

import torch

from gemcore.comms.base import DEFAULT_TIMEOUT_S, Communicator
from gemcore.comms.launch import detect


class SingleCommunicator(Communicator):
    """World 1 without any communication library."""

    backend = "single"

    def __init__(self, *, timeout_s: float | None = DEFAULT_TIMEOUT_S, check: bool = True,
                 _peers: list[tuple[int, int]] | None = None) -> None:
        super().__init__(timeout_s=timeout_s, check=check)
        launch = detect()
        if launch.world_size != 1:
            raise ValueError(f"backend 'single' runs one process, but {launch.launcher} started "
                             f"{launch.world_size}: choose backend 'torch' or 'mpi'")
        self._set_place(0, 1, 0, _peers)

    def _all_gather_impl(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def _reduce_scatter_impl(self, t: torch.Tensor, op: str) -> torch.Tensor:
        return t.clone()

    def _all_reduce_impl(self, t: torch.Tensor, op: str) -> torch.Tensor:
        return t.clone()

    def _all_to_all_impl(self, t: torch.Tensor, in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
        return t.clone()

    def _broadcast_impl(self, t: torch.Tensor, src: int) -> None:
        pass

    def _barrier_impl(self) -> None:
        pass

    def _split_impl(self, groups: list[list[int]], index: int) -> Communicator:
        return SingleCommunicator(timeout_s=self.timeout_s, check=self.check, _peers=list(self.peers))
