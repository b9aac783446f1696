"""Backend ``ce``: copy-engine collectives over CUDA IPC (an emulation of NCCLX's SM-free path).

Each rank owns one registered buffer, its *window* (``cudaMalloc``, reused and grown collectively
when a call needs more), and inter-process events ``ready`` and ``done``. At set-up the ranks
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

That is ``sync="barrier"``: two host barriers per call. ``sync="event"`` needs one: the window
and the events come in two *slots* used by alternate calls (call k uses slot k % 2), and step 4
becomes, at the start of call k, "the caller's stream waits on every peer's ``done`` of this slot"
(recorded in call k-2). Why that is enough, with an IPC event wait seeing the most recent record
issued before it:

* ``ready[s]`` of call k is recorded before barrier k and waited on after it; its next record
  (call k+2) comes after barrier k+1, which the waiting peer enters only after its wait.
* ``done[s]`` of call k-2 was recorded before barrier k-1 (every rank records it before leaving
  call k-2) and is waited on in call k before barrier k; its next record (call k) comes after
  barrier k, which the waiting rank has not entered yet.
* nobody writes slot s of call k before every peer finished reading slot s of call k-2; slot
  1-s (call k-1) may still be read while call k runs, and nobody writes it during call k.

A tensor from :meth:`window` lives in the slot of the next call, and ``window()`` makes the
caller's stream wait for the peers' last reads of that slot, so filling it is safe; with
``sync="event"``, fill a fresh ``window()`` tensor for each call (one kept from an earlier call
still works, through a staging copy, but may be rewritten while a peer reads it).

No kernel moves data: the copies are ``cudaMemcpyAsync`` calls, which cross a copy engine
between GPUs (NVLink/PCIe peer copies). Two ranks sharing one GPU also work (IPC handles open
between processes of one device), but a same-device copy may run on SMs, so that case proves
correctness, not SM-freedom. Reductions (all_reduce, reduce_scatter) and CPU tensors go to the
delegate backend. A group spanning several nodes composes its CUDA all_gather, all_to_all(-v)
and broadcast of an intra-node copy-engine step and an inter-node delegate step
(comms/hierarchy.py): broadcast for any node sizes, all_gather and all_to_all when the nodes hold
equal numbers of ranks (all_to_all: at least two each); otherwise they go to the delegate whole.
The host is never blocked on the GPU except by the barriers' host-side handshakes.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from gemcore.comms.base import DEFAULT_TIMEOUT_S, Communicator
from gemcore.comms.hierarchy import Hierarchy
from gemcore.comms.launch import detect

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault (unified addressing decides the direction)
_EVENT_FLAGS = 0x2 | 0x4  # cudaEventDisableTiming | cudaEventInterprocess
_IPC_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
_MIN_WINDOW = 1 << 20
SYNC_MODES = ("barrier", "event")


def import_cupy():
    """``cupy``, or a RuntimeError saying how to get it."""
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError("backend 'ce' needs CuPy for CUDA IPC: pip install cupy-cuda12x "
                           f"(or cupy-cuda13x; the 'gpu' extra) ({exc})") from exc
    return cupy


def default_delegate() -> str:
    """``mpi`` under an MPI launcher when mpi4py is installed, else ``gloo`` (on the job's store,
    :func:`gemcore.comms.rendezvous.job_store`, outside any torch.distributed process group)."""
    if detect().under_mpi:
        try:
            import mpi4py  # noqa: F401
            return "mpi"
        except ImportError:
            pass
    return "gloo"


def make_delegate(name: str, timeout_s: float | None) -> Communicator:
    """The host-side partner ``name`` (``mpi``, ``gloo`` or ``torch``) of a copy-engine communicator."""
    if name == "gloo":
        import torch.distributed as dist

        from gemcore.comms.gloo_store import StoreGlooCommunicator
        from gemcore.comms.rendezvous import job_store

        launch = detect()
        store = dist.PrefixStore("gemcore_ce", job_store(launch, timeout_s))
        return StoreGlooCommunicator(store, launch.rank, launch.world_size, timeout_s=timeout_s,
                                     local_rank=launch.local_rank)
    from gemcore.comms import BUILTIN_BACKENDS
    if name not in ("mpi", "torch"):
        raise ValueError(f"delegate must be 'mpi', 'gloo' or 'torch', got {name!r}")
    return BUILTIN_BACKENDS[name](timeout_s=timeout_s, check=False)


class _CudaArray:
    """A bare ``__cuda_array_interface__`` so torch can view raw device memory (uint8)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class CopyEngineCommunicator(Communicator):
    """SM-free all_gather / all_to_all / broadcast among the ranks of one node; the rest delegated."""

    backend = "ce"

    def __init__(self, *, timeout_s: float | None = DEFAULT_TIMEOUT_S, check: bool = True,
                 delegate: str | Communicator | None = None, window_bytes: int | str = 64 << 20,
                 sync: str = "barrier") -> None:
        super().__init__(timeout_s=timeout_s, check=check)
        if sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {', '.join(map(repr, SYNC_MODES))}, got {sync!r}")
        #: "barrier": two host barriers per call; "event": one, with two alternating window slots
        self.sync = sync
        self._slots = 2 if sync == "event" else 1
        self._calls = 0
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'ce' needs a CUDA GPU (copy-engine collectives over CUDA IPC)")
        self.cupy = import_cupy()
        self.rt = self.cupy.cuda.runtime
        if isinstance(delegate, Communicator):
            self.delegate = delegate
        else:
            self.delegate = make_delegate(delegate or default_delegate(), timeout_s)
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
        #: several nodes: intra-node ce and inter-node delegate communicators, made on first use
        self._hier: Hierarchy | None = None
        if self.intra_node and self.world_size > 1:
            with self.cupy.cuda.Device(self.device.index):
                self._open_events()
                self._grow(max(_MIN_WINDOW, int(window_bytes)))
                self._streams = [torch.cuda.Stream(self.device) for _ in range(self.world_size)]

    def describe(self) -> str:
        path = (f"copy engine, sync {self.sync}" if self.intra_node else
                "several nodes: hierarchical (delegate across nodes, copy engine within)")
        return f"{super().describe()}, {path}, delegate {self.delegate.backend}"

    # ------------------------------------------------------------------ registration
    def _gather_bytes(self, data: bytes) -> list[bytes]:
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = self.delegate._all_gather_impl(mine).view(self.world_size, len(data))
        return [bytes(r.tolist()) for r in rows]

    def _open_events(self) -> None:
        for name in [f"{kind}{slot}" for slot in range(self._slots) for kind in ("ready", "done")]:
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
        self._window = self.rt.malloc(nbytes * self._slots)
        self._capacity = nbytes  # per slot
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
        """A tensor in this rank's registered window, in the slot the next ce collective uses
        (collective: every rank calls it with the same size). Passing it to the next all_gather /
        all_to_all / broadcast skips the staging copy. Its contents stay valid until the next ce
        collective of this communicator; take a fresh one for each call."""
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if not (self.intra_node and self.world_size > 1):
            return torch.empty(shape, dtype=dtype, device=self.device)
        self._grow(nbytes)
        slot = self._calls % self._slots
        if self.sync == "event":  # the caller's writes wait for the peers' reads of this slot
            self._wait_peers(f"done{slot}", self._current())
        return self._window_tensor(self._slot_ptr(self._window, slot), nbytes, shape, dtype)

    def _window_tensor(self, ptr: int, nbytes: int, shape, dtype: torch.dtype) -> torch.Tensor:
        raw = torch.as_tensor(_CudaArray(ptr, max(nbytes, 1)), device=self.device)
        return raw[:nbytes].view(dtype).view(shape)

    def _slot_ptr(self, base: int, slot: int) -> int:
        return base + slot * self._capacity

    def _wait_peers(self, event: str, stream) -> None:
        for peer in range(self.world_size):
            if peer != self.rank:
                self._wait(stream, peer, event)

    # ------------------------------------------------------------------ stream primitives
    # The protocol below is written with these six only, so that a simulated runtime (the tests'
    # happens-before checker) can run it on CPU.
    def _current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def _record(self, event: str, stream) -> None:
        """Record this rank's IPC event ``event`` on ``stream``."""
        self.rt.eventRecord(self._events[event], stream.cuda_stream)

    def _wait(self, stream, peer: int, event: str) -> None:
        """``stream`` waits for the most recent record of ``peer``'s event ``event``."""
        self.rt.streamWaitEvent(stream.cuda_stream, self._peer_events[event][peer], 0)

    def _copy(self, dst: int, src: int, nbytes: int, stream) -> None:
        self.rt.memcpyAsync(dst, src, nbytes, _MEMCPY_DEFAULT, stream.cuda_stream)

    def _follow(self, stream, other) -> None:
        """``stream``'s later work waits for the work queued on ``other`` so far."""
        stream.wait_stream(other)

    def _host_barrier(self) -> None:
        self.delegate._barrier_impl()

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
        slot = self._calls % self._slots
        self._calls += 1
        ready, done = f"ready{slot}", f"done{slot}"
        cur = self._current()
        mine = self._slot_ptr(self._window, slot)
        if self.sync == "event":  # step 4 of call k-2: the peers have finished reading this slot
            self._wait_peers(done, cur)
        if src_ranks_stage and t.numel() and t.data_ptr() != mine:
            self._copy(mine, t.data_ptr(), t.numel() * t.element_size(), cur)
        self._record(ready, cur)
        self._host_barrier()
        active = [pull for pull in pulls if pull[3]]
        for peer, offset, dst, nbytes in active:
            stream = self._streams[peer]
            self._follow(stream, cur)  # the result buffer was allocated on cur
            self._wait(stream, peer, ready)
            self._copy(dst, self._slot_ptr(self._peer_windows[peer], slot) + offset, nbytes, stream)
        for peer, *_ in active:
            self._follow(cur, self._streams[peer])
        self._record(done, cur)
        if self.sync == "barrier":
            self._host_barrier()
            self._wait_peers(done, cur)

    # ------------------------------------------------------------------ several nodes
    def _spans_nodes(self, t: torch.Tensor) -> bool:
        """Whether a collective on ``t`` takes the hierarchical path (CUDA, several nodes)."""
        return t.is_cuda and not self.intra_node

    def _make_intra(self, sub: Communicator) -> Communicator:
        """The copy-engine communicator of this node's ranks (``sub``: the delegate's)."""
        return CopyEngineCommunicator(timeout_s=self.timeout_s, check=False, delegate=sub,
                                      window_bytes=_MIN_WINDOW, sync=self.sync)

    def _hierarchy(self) -> Hierarchy:
        """The intra-node ce and inter-node delegate communicators (collective on first call:
        every rank reaches it through the same CUDA collective)."""
        if self._hier is None:
            self._hier = Hierarchy(self.delegate, self._make_intra)
        return self._hier

    # ------------------------------------------------------------------ collectives
    def _all_gather_impl(self, t: torch.Tensor) -> torch.Tensor:
        if self._spans_nodes(t):
            out = self._hierarchy().all_gather(t)
            if out is not None:
                return out
        if not self._use_ce(t):
            return self.delegate._all_gather_impl(t)
        out = t.new_empty((self.world_size * t.shape[0], *t.shape[1:]))
        nbytes = t.numel() * t.element_size()
        pulls = [(p, 0, out.data_ptr() + p * nbytes, nbytes) for p in range(self.world_size)]
        self._exchange(t, nbytes, pulls)  # this rank's own chunk is pulled from its own window
        return out

    def _all_to_all_impl(self, t: torch.Tensor, in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
        if self._spans_nodes(t):
            out = self._hierarchy().all_to_all(t, in_splits, out_splits)
            if out is not None:
                return out
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
        if self._spans_nodes(t):
            return self._hierarchy().broadcast(t, src)
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
                                      window_bytes=_MIN_WINDOW, sync=self.sync)

    # Point to point goes through the delegate; a gloo delegate moves host memory only, so CUDA
    # tensors are staged through pinned host buffers (pipeline stages' activations: small).
    def _isend_impl(self, t: torch.Tensor, dst: int, tag: int):
        if t.is_cuda and self.delegate.backend == "gloo":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t)  # synchronous: the send may read the buffer at once
            return self.delegate._isend_impl(host, dst, tag)
        return self.delegate._isend_impl(t, dst, tag)

    def _irecv_impl(self, t: torch.Tensor, src: int, tag: int):
        if t.is_cuda and self.delegate.backend == "gloo":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            pending = self.delegate._irecv_impl(host, src, tag)

            def wait() -> None:
                pending()
                t.copy_(host, non_blocking=True)  # ordered on the current stream
            return wait
        return self.delegate._irecv_impl(t, src, tag)

    def _subgroup_impl(self, members: list[int], store) -> Communicator:
        sub = self.delegate._subgroup_impl(members, store)
        return CopyEngineCommunicator(timeout_s=self.timeout_s, check=self.check, delegate=sub,
                                      window_bytes=_MIN_WINDOW, sync=self.sync)

    def _finalize_impl(self) -> None:
        if self._hier is not None:
            self._hier.finalize()
            self._hier = None
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
        return {"window_bytes": self._capacity, "slots": self._slots, "sync": self.sync,
                "intra_node": self.intra_node, "delegate": self.delegate.backend}
