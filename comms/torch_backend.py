"""Backend ``torch``: torch.distributed, NCCL for CUDA tensors and gloo for CPU tensors.

Rendezvous: under ``torchrun`` (or any ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` environment)
through ``env://``; under ``mpirun`` rank 0 picks an address and a free port and broadcasts them
with MPI (mpi4py); a single process uses an in-memory store. An already initialised default
process group is reused (and then left to its owner at finalize).

:meth:`TorchCommunicator.wrap` (``gemcore.comms.from_process_group``) makes a communicator over an
existing process group, for example one dimension of a ``DeviceMesh``; the group stays its
creator's (``finalize`` leaves it). A group whose only backend is NCCL cannot move CPU tensors, so
CPU tensors (the communicator's own split counts and call signatures among them) are staged
through the current CUDA device there.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from gemcore.comms.base import DEFAULT_TIMEOUT_S, Communicator
from gemcore.comms.launch import LaunchInfo, detect
from gemcore.comms.rendezvous import mpi_rendezvous

_REDUCE = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN"}

# torch >= 2.13 renamed the single-tensor collectives; older releases only have the old names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def process_group_backend() -> str:
    """``cpu:gloo,cuda:nccl`` where CUDA and NCCL are present, else ``gloo``."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


class TorchCommunicator(Communicator):
    """A torch.distributed process group (the default group, or a sub-group made by ``split``)."""

    backend = "torch"

    def __init__(self, *, timeout_s: float | None = DEFAULT_TIMEOUT_S, check: bool = True,
                 pg_backend: str | None = None, launch: LaunchInfo | None = None) -> None:
        super().__init__(timeout_s=timeout_s, check=check)
        if not dist.is_available():
            raise RuntimeError("backend 'torch': this PyTorch build has no torch.distributed")
        launch = launch or detect()
        self.group = None  # the default process group
        self._ranks: list[int] = []  # global ranks of this group, by group rank
        self._owns_default = False
        if not dist.is_initialized():
            _init_default_group(launch, pg_backend or process_group_backend(), timeout_s)
            self._owns_default = True
        rank, world = dist.get_rank(), dist.get_world_size()
        if launch.launcher != "none" and (rank, world) != (launch.rank, launch.world_size):
            raise RuntimeError(f"backend 'torch': the process group says rank {rank} of {world} but "
                               f"{launch.launcher} says rank {launch.rank} of {launch.world_size}")
        self._ranks = list(range(world))
        self._stage = _staging_device(None)
        self._set_place(rank, world, launch.local_rank)

    @classmethod
    def _sub(cls, parent: "TorchCommunicator", group, members: list[int], rank: int) -> "TorchCommunicator":
        sub = cls.__new__(cls)
        Communicator.__init__(sub, timeout_s=parent.timeout_s, check=parent.check)
        sub.group, sub._owns_default = group, False
        sub._ranks = [parent._ranks[m] for m in members]
        sub._set_place(rank, len(members), peers=parent._sub_peers(members))
        sub._stage = _staging_device(group)
        return sub

    @classmethod
    def wrap(cls, group=None, *, timeout_s: float | None = DEFAULT_TIMEOUT_S,
             check: bool = True) -> "TorchCommunicator":
        """A communicator over the existing process group ``group`` (None: the default group).

        Collective over ``group`` (its ranks exchange their node and local rank). The group is not
        owned: ``finalize`` leaves it to its creator. ``timeout_s`` is recorded; the group's own
        timeout, fixed when it was made, is what bounds its collectives.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("from_process_group: torch.distributed is not initialised")
        if group is not None and group is getattr(dist.GroupMember, "NON_GROUP_MEMBER", object()):
            raise ValueError("group: this rank is not a member of the process group")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise ValueError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
        if group is not None and dist.get_rank(group) < 0:
            raise ValueError("group: this rank is not a member of the process group")
        comm = cls.__new__(cls)
        Communicator.__init__(comm, timeout_s=timeout_s, check=check)
        comm.group, comm._owns_default = group, False
        comm._ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        comm._stage = _staging_device(group)
        comm._set_place(dist.get_rank(group), dist.get_world_size(group), detect().local_rank)
        return comm

    # ------------------------------------------------------------------ collectives
    def _all_gather_direct(self, t: torch.Tensor) -> torch.Tensor:
        out = t.new_empty((self.world_size * t.shape[0], *t.shape[1:]))
        if t.numel():
            _all_gather_single(out, t, group=self.group)
        return out

    def _reduce_scatter_direct(self, t: torch.Tensor, op: str) -> torch.Tensor:
        out = t.new_empty((t.shape[0] // self.world_size, *t.shape[1:]))
        if t.numel():
            _reduce_scatter_single(out, t, op=_op(op), group=self.group)
        return _finish_avg(out, op, self.world_size)

    def _all_reduce_direct(self, t: torch.Tensor, op: str) -> torch.Tensor:
        out = t.clone()
        if t.numel():
            dist.all_reduce(out, op=_op(op), group=self.group)
        return _finish_avg(out, op, self.world_size)

    def _all_to_all_direct(self, t: torch.Tensor, in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
        # a functional collective (returns a new tensor): selective activation checkpointing keeps
        # its output (gemcore.parallel.apply.SELECTIVE_AC_SAVE) instead of exchanging again
        from torch.distributed import _functional_collectives as funcol

        group = self.group if self.group is not None else dist.group.WORLD
        out = funcol.all_to_all_single(t.contiguous(), list(out_splits), list(in_splits), group)
        return funcol.wait_tensor(out)

    def _broadcast_direct(self, t: torch.Tensor, src: int) -> torch.Tensor:
        if t.numel():
            dist.broadcast(t, src=self._ranks[src], group=self.group)
        return t

    # CPU tensors travel through the staging device on groups that cannot move them (NCCL only)
    def _staged(self, direct, t: torch.Tensor, *args) -> torch.Tensor:
        if self._stage is None or t.device.type != "cpu":
            return direct(t, *args)
        return direct(t.to(self._stage), *args).cpu()

    def _all_gather_impl(self, t: torch.Tensor) -> torch.Tensor:
        return self._staged(self._all_gather_direct, t)

    def _reduce_scatter_impl(self, t: torch.Tensor, op: str) -> torch.Tensor:
        return self._staged(self._reduce_scatter_direct, t, op)

    def _all_reduce_impl(self, t: torch.Tensor, op: str) -> torch.Tensor:
        return self._staged(self._all_reduce_direct, t, op)

    def _all_to_all_impl(self, t: torch.Tensor, in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
        return self._staged(self._all_to_all_direct, t, in_splits, out_splits)

    def _broadcast_impl(self, t: torch.Tensor, src: int) -> None:
        out = self._staged(self._broadcast_direct, t, src)
        if out.data_ptr() != t.data_ptr():
            t.copy_(out)

    def _barrier_impl(self) -> None:
        # a small all-reduce instead of dist.barrier: NCCL's barrier needs a device per rank
        self._all_reduce_impl(torch.zeros(1), "sum")

    def _isend_impl(self, t: torch.Tensor, dst: int, tag: int):
        return dist.isend(t, dst=self._ranks[dst], group=self.group, tag=tag).wait

    def _irecv_impl(self, t: torch.Tensor, src: int, tag: int):
        return dist.irecv(t, src=self._ranks[src], group=self.group, tag=tag).wait

    def _subgroup_impl(self, members: list[int], store) -> Communicator:
        mine = dist.new_group([self._ranks[m] for m in members], timeout=_timedelta(self.timeout_s),
                              use_local_synchronization=True)
        return TorchCommunicator._sub(self, mine, members, members.index(self.rank))

    def _split_impl(self, groups: list[list[int]], index: int) -> Communicator:
        # Only this group's members create it (group-local synchronisation), so a split of a
        # sub-communicator does not need the ranks outside the parent to join in.
        members = groups[index]
        mine = dist.new_group([self._ranks[m] for m in members], timeout=_timedelta(self.timeout_s),
                              use_local_synchronization=True)
        return TorchCommunicator._sub(self, mine, members, members.index(self.rank))

    def _finalize_impl(self) -> None:
        if self._owns_default and dist.is_initialized():
            dist.destroy_process_group()


def _staging_device(group) -> torch.device | None:
    """The CUDA device CPU tensors go through on ``group`` (None: the group moves CPU tensors)."""
    name = str(dist.get_backend(group)).lower()
    cuda_only = name == "nccl" or (":" in name and "cpu:" not in name and "nccl" in name)
    if not cuda_only:
        return None
    return torch.device("cuda", torch.cuda.current_device())


def _op(op: str):
    return getattr(dist.ReduceOp, _REDUCE[op])


def _finish_avg(out: torch.Tensor, op: str, world_size: int) -> torch.Tensor:
    return out.div_(world_size) if op == "avg" else out


def _timedelta(timeout_s: float | None) -> datetime.timedelta | None:
    return None if timeout_s is None else datetime.timedelta(seconds=timeout_s)


def _init_default_group(launch: LaunchInfo, pg_backend: str, timeout_s: float | None) -> None:
    if torch.cuda.is_available() and "nccl" in pg_backend:
        torch.cuda.set_device((launch.local_rank or 0) % torch.cuda.device_count())
    timeout = _timedelta(timeout_s)
    if launch.launcher == "none":
        dist.init_process_group(pg_backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    elif launch.under_mpi and not ("MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ):
        addr, port = mpi_rendezvous()
        dist.init_process_group(pg_backend, init_method=f"tcp://{addr}:{port}", rank=launch.rank,
                                world_size=launch.world_size, timeout=timeout)
    else:
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise RuntimeError(f"backend 'torch': {launch.launcher} set RANK/WORLD_SIZE but not "
                               f"MASTER_ADDR/MASTER_PORT")
        dist.init_process_group(pg_backend, init_method="env://", rank=launch.rank,
                                world_size=launch.world_size, timeout=timeout)
