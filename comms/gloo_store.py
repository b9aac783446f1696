"""A communicator over a gloo backend made from a torch.distributed store, outside any process group.

``ce`` needs a host-side partner for its handshakes (IPC handles, host barriers) on exactly the
ranks of the group it serves. When torch.distributed creates that group's backend it hands over the
group's store and nothing else; this class builds gloo on that store, so the partner exists without
joining, or waiting for, any other process group.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from gemcore.comms.base import DEFAULT_TIMEOUT_S, Communicator

_REDUCE = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN"}


class StoreGlooCommunicator(Communicator):
    """gloo on ``store`` among ``world_size`` ranks (host tensors; what gloo moves)."""

    backend = "gloo"

    def __init__(self, store, rank: int, world_size: int, *, timeout_s: float | None = DEFAULT_TIMEOUT_S,
                 check: bool = False, local_rank: int | None = None,
                 peers: list[tuple[int, int]] | None = None) -> None:
        super().__init__(timeout_s=timeout_s, check=check)
        timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else 3600.0)
        self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        self._store = store
        self._set_place(rank, world_size, local_rank, peers)

    def _run(self, work) -> None:
        work.wait()

    def _all_gather_impl(self, t: torch.Tensor) -> torch.Tensor:
        out = t.new_empty((self.world_size * t.shape[0], *t.shape[1:]))
        if t.numel():
            self._run(self.pg._allgather_base(out, t))
        return out

    def _reduce_scatter_impl(self, t: torch.Tensor, op: str) -> torch.Tensor:
        out = t.new_empty((t.shape[0] // self.world_size, *t.shape[1:]))
        if t.numel():
            opts = dist.ReduceScatterOptions()
            opts.reduceOp = getattr(dist.ReduceOp, _REDUCE[op])
            self._run(self.pg._reduce_scatter_base(out, t, opts))
        return out.div_(self.world_size) if op == "avg" else out

    def _all_reduce_impl(self, t: torch.Tensor, op: str) -> torch.Tensor:
        out = t.clone()
        if t.numel():
            opts = dist.AllreduceOptions()
            opts.reduceOp = getattr(dist.ReduceOp, _REDUCE[op])
            self._run(self.pg.allreduce([out], opts))
        return out.div_(self.world_size) if op == "avg" else out

    def _all_to_all_impl(self, t: torch.Tensor, in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
        out = t.new_empty((sum(out_splits), *t.shape[1:]))
        self._run(self.pg.alltoall_base(out, t, list(out_splits), list(in_splits), dist.AllToAllOptions()))
        return out

    def _broadcast_impl(self, t: torch.Tensor, src: int) -> None:
        if t.numel():
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = src, 0
            self._run(self.pg.broadcast([t], opts))

    def _isend_impl(self, t: torch.Tensor, dst: int, tag: int):
        return self.pg.send([t], dst, tag).wait

    def _irecv_impl(self, t: torch.Tensor, src: int, tag: int):
        return self.pg.recv([t], src, tag).wait

    def _barrier_impl(self) -> None:
        self._all_reduce_impl(torch.zeros(1), "sum")

    def _split_impl(self, groups: list[list[int]], index: int) -> Communicator:
        members = groups[index]
        store = dist.PrefixStore(f"split/{'-'.join(map(str, members))}", self._store)
        return StoreGlooCommunicator(store, members.index(self.rank), len(members), timeout_s=self.timeout_s,
                                     check=self.check, peers=self._sub_peers(members))

    def _subgroup_impl(self, members: list[int], store) -> Communicator:
        if store is None:
            store = dist.PrefixStore(f"subgroup/{'-'.join(map(str, members))}", self._store)
        return StoreGlooCommunicator(store, members.index(self.rank), len(members), timeout_s=self.timeout_s,
                                     check=self.check, peers=self._sub_peers(members))
