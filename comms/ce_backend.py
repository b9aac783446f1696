"""Backend ``ce``: copy-engine collectives over CUDA IPC (an emulation of NCCLX's SM-free path).

Each rank owns one registered buffer, its *window* (``cudaMalloc``, reused and grown collectively
when a call needs more), and two inter-process events, ``ready`` and ``done``. At set-up the ranks
exchange the windows' and events' IPC handles through the *delegate* backend (``mpi`` or
``torch``) and open each other's. all_gather, all_to_all(-v) and broadcast then run as:

1. the rank's input is copied into its window on the caller's stream (skipped when the input
   already is :meth:`window` memory: zero-copy) and ``ready`` is recorded;
2. host barrier (so every ``ready`` record is issued before anyone waits on it);
3. one stream per peer waits on the peer's ``ready`` and *pulls* the peer's chunk out of the
   peer's window with ``cudaMemcpyAsync`` into the result; the caller's stream joins them and
   records ``done``;
4. host barrier, then the caller's stream waits on every peer's ``done`` (nobody reads this
   rank's window any more, so the input and window may be reused).

No kernel moves data: the copies are ``cudaMemcpyAsync`` calls, which cross a copy engine
between GPUs (NVLink/PCIe peer copies). Two ranks sharing one GPU also work (IPC handles open
between processes of one device), but a same-device copy may run on SMs, so that case proves
correctness, not SM-freedom. Reductions (all_reduce, reduce_scatter), CPU tensors, and groups
that span several nodes go to the delegate backend. The host is never blocked on the GPU except
by the barriers' host-side handshakes.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from gemcore.comms.base import DEFAULT_TIMEOUT_S, Communicator
from gemcore.comms.launch import detect

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault (unified addressing decides the direction)
_EVENT_FLAGS = 0x2 | 0x4  # cudaEventDisableTiming | cudaEventInterprocess
_IPC_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
_MIN_WINDOW = 1 << 20


def import_cupy():
    """``cupy``, or a RuntimeError saying how to get it."""
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError("backend 'ce' needs CuPy for CUDA IPC: pip install cupy-cuda12x "
                           f"(or cupy-cuda13x; the 'gpu' extra) ({exc})") from exc
    return cupy


def default_delegate() -> str:
    """``mpi`` under an MPI launcher when mpi4py is installed, else ``torch``."""
    if detect().under_mpi:
        try:
            import mpi4py  # noqa: F401
            return "mpi"
        except ImportError:
            pass
    return "torch"


class _CudaArray:
    """A bare ``__cuda_array_interface__`` so torch can view raw device memory (uint8)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class CopyEngineCommunicator(Communicator):
    """SM-free all_gather / all_to_all / broadcast among the ranks of one node; the rest delegated."""

    backend = "ce"

    def __init__(self, *, timeout_s: float | None = DEFAULT_TIMEOUT_S, check: bool = True,
                 delegate: str | Communicator | None = None, window_bytes: int | str = 64 << 20) -> None:
        super().__init__(timeout_s=timeout_s, check=check)
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'ce' needs a CUDA GPU (copy-engine collectives over CUDA IPC)")
        self.cupy = import_cupy()
        self.rt = self.cupy.cuda.runtime
        if isinstance(delegate, Communicator):
            self.delegate = delegate
        else:
            from gemcore.comms import BUILTIN_BACKENDS
            name = delegate or default_delegate()
            if name not in ("mpi", "torch"):
                raise ValueError(f"delegate must be 'mpi' or 'torch', got {name!r}")
            self.delegate = BUILTIN_BACKENDS[name](timeout_s=timeout_s, check=False)
        d = self.delegate
        self._set_place(d.rank, d.world_size, peers=list(d.peers))
        self.device = torch.device("cuda", self.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(self.device)
        self.intra_node = self.num_nodes == 1
        self._capacity = 0
        self._window = 0
        self._peer_windows: list[int] = []
        self._events: dict[str, int] = {}
        self._peer_events: dict[str, list[int]] = {}
        self._streams: list[torch.cuda.Stream] = []
        if self.intra_node and self.world_size > 1:
            with self.cupy.cuda.Device(self.device.index):
                self._open_events()
                self._grow(max(_MIN_WINDOW, int(window_bytes)))
                self._streams = [torch.cuda.Stream(self.device) for _ in range(self.world_size)]

    def describe(self) -> str:
        path = "copy engine" if self.intra_node else "delegate only (several nodes)"
        return f"{super().describe()}, {path}, delegate {self.delegate.backend}"

    # ------------------------------------------------------------------ registration
    def _gather_bytes(self, data: bytes) -> list[bytes]:
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = self.delegate._all_gather_impl(mine).view(self.world_size, len(data))
        return [bytes(r.tolist()) for r in rows]

    def _open_events(self) -> None:
        for name in ("ready", "done"):
            event = self.rt.eventCreateWithFlags(_EVENT_FLAGS)
            self._events[name] = event
            handles = self._gather_bytes(self.rt.ipcGetEventHandle(event))
            self._peer_events[name] = [event if r == self.rank else self.rt.ipcOpenEventHandle(h)
                                       for r, h in enumerate(handles)]

    def _grow(self, nbytes: int) -> None:
        """Replace the window by one of at least ``nbytes`` (collective; every rank asks the same)."""
        if nbytes <= self._capacity:
            return
        nbytes = max(nbytes, 2 * self._capacity)
        torch.cuda.synchronize(self.device)
        self.delegate._barrier_impl()  # nobody still reads the old windows
        self._close_windows()
        self._window = self.rt.malloc(nbytes)
        self._capacity = nbytes
        handles = self._gather_bytes(self.rt.ipcGetMemHandle(self._window))
        self._peer_windows = [self._window if r == self.rank else
                              self.rt.ipcOpenMemHandle(h, _IPC_LAZY_PEER_ACCESS) for r, h in enumerate(handles)]

    def _close_windows(self) -> None:
        for r, ptr in enumerate(self._peer_windows):
            if r != self.rank:
                self.rt.ipcCloseMemHandle(ptr)
        if self._window:
            self.rt.free(self._window)
        self._peer_windows, self._window, self._capacity = [], 0, 0

    def window(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A tensor in this rank's registered window (collective: every rank calls it with the same
        size). Passing it to all_gather / all_to_all / broadcast skips the staging copy. Its contents
        stay valid until the next ce collective of this communicator."""
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if not (self.intra_node and self.world_size > 1):
            return torch.empty(shape, dtype=dtype, device=self.device)
        self._grow(nbytes)
        raw = torch.as_tensor(_CudaArray(self._window, max(nbytes, 1)), device=self.device)
        return raw[:nbytes].view(dtype).view(shape)

    # ------------------------------------------------------------------ the copy-engine protocol
    def _use_ce(self, t: torch.Tensor) -> bool:
        return t.is_cuda and self.intra_node and self.world_size > 1

    def _exchange(self, t: torch.Tensor, window_bytes: int, pulls: list[tuple[int, int, int, int]],
                  src_ranks_stage: bool = True) -> None:
        """Run steps 1-4 of the module docstring.

        :param pulls: ``(peer, peer window offset, destination pointer, bytes)`` copies to make.
        :param src_ranks_stage: whether this rank copies ``t`` into its window (step 1).
        """
        self._grow(window_bytes)
        current = torch.cuda.current_stream(self.device)
        cur = current.cuda_stream
        rt = self.rt
        if src_ranks_stage and t.numel() and t.data_ptr() != self._window:
            rt.memcpyAsync(self._window, t.data_ptr(), t.numel() * t.element_size(), _MEMCPY_DEFAULT, cur)
        rt.eventRecord(self._events["ready"], cur)
        self.delegate._barrier_impl()
        start = torch.cuda.Event()
        start.record(current)
        joins = []
        for peer, offset, dst, nbytes in pulls:
            if not nbytes:
                continue
            stream = self._streams[peer]
            stream.wait_event(start)
            rt.streamWaitEvent(stream.cuda_stream, self._peer_events["ready"][peer], 0)
            rt.memcpyAsync(dst, self._peer_windows[peer] + offset, nbytes, _MEMCPY_DEFAULT, stream.cuda_stream)
            joined = torch.cuda.Event()
            joined.record(stream)
            joins.append(joined)
        for joined in joins:
            current.wait_event(joined)
        rt.eventRecord(self._events["done"], cur)
        self.delegate._barrier_impl()
        for peer in range(self.world_size):
            if peer != self.rank:
                rt.streamWaitEvent(cur, self._peer_events["done"][peer], 0)

    # ------------------------------------------------------------------ collectives
    def _all_gather_impl(self, t: torch.Tensor) -> torch.Tensor:
        if not self._use_ce(t):
            return self.delegate._all_gather_impl(t)
        out = t.new_empty((self.world_size * t.shape[0], *t.shape[1:]))
        nbytes = t.numel() * t.element_size()
        pulls = [(p, 0, out.data_ptr() + p * nbytes, nbytes) for p in range(self.world_size)]
        self._exchange(t, nbytes, pulls)  # this rank's own chunk is pulled from its own window
        return out

    def _all_to_all_impl(self, t: torch.Tensor, in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
        if not self._use_ce(t):
            return self.delegate._all_to_all_impl(t, in_splits, out_splits)
        w = self.world_size
        matrix = self.delegate._all_gather_impl(torch.tensor(in_splits, dtype=torch.int64)).view(w, w).tolist()
        got = [matrix[p][self.rank] for p in range(w)]
        if got != list(out_splits):
            raise ValueError(f"[rank {self.rank}] out_splits={list(out_splits)} but the ranks send {got} rows here")
        row = t.element_size() * math.prod(t.shape[1:])
        out = t.new_empty((sum(out_splits), *t.shape[1:]))
        pulls, dst = [], out.data_ptr()
        for p in range(w):
            offset = sum(matrix[p][: self.rank]) * row
            pulls.append((p, offset, dst, matrix[p][self.rank] * row))
            dst += matrix[p][self.rank] * row
        self._exchange(t, max(sum(r) for r in matrix) * row, pulls)
        return out

    def _broadcast_impl(self, t: torch.Tensor, src: int) -> None:
        if not self._use_ce(t):
            return self.delegate._broadcast_impl(t, src)
        nbytes = t.numel() * t.element_size()
        pulls = [] if self.rank == src else [(src, 0, t.data_ptr(), nbytes)]
        self._exchange(t, nbytes, pulls, src_ranks_stage=self.rank == src)
        return None

    def _reduce_scatter_impl(self, t: torch.Tensor, op: str) -> torch.Tensor:
        return self.delegate._reduce_scatter_impl(t, op)

    def _all_reduce_impl(self, t: torch.Tensor, op: str) -> torch.Tensor:
        return self.delegate._all_reduce_impl(t, op)

    def _barrier_impl(self) -> None:
        self.delegate._barrier_impl()

    def _split_impl(self, groups: list[list[int]], index: int) -> Communicator:
        sub = self.delegate._split_impl(groups, index)
        return CopyEngineCommunicator(timeout_s=self.timeout_s, check=self.check, delegate=sub,
                                      window_bytes=_MIN_WINDOW)

    def _finalize_impl(self) -> None:
        if self._window:
            torch.cuda.synchronize(self.device)
            self.delegate._barrier_impl()
            self._close_windows()
        for name, event in self._events.items():
            for r, peer_event in enumerate(self._peer_events.get(name, [])):
                if r != self.rank:
                    self.rt.eventDestroy(peer_event)
            self.rt.eventDestroy(event)
        self._events, self._peer_events = {}, {}
        self.delegate._finalize_impl()

    def stats(self) -> dict[str, Any]:
        """Window size and path, for logs and benchmarks."""
        return {"window_bytes": self._capacity, "intra_node": self.intra_node, "delegate": self.delegate.backend}
