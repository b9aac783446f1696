"""Backend ``ce``: copy-engine collectives over CUDA IPC (an emulation of NCCLX's SM-free path).

Each rank owns one registered buffer, its *window* (``cudaMalloc``, reused and grown collectively
when a call needs more), split in *slots*. At set-up the ranks exchange the IPC handles of the
windows and of the synchronisation objects through the *delegate* backend (``mpi`` or ``gloo``)
and open each other's. Every collective on CUDA tensors runs as one or two *exchanges*:

1. the rank's input is copied into its window slot on the caller's stream (skipped when the input
   already is :meth:`window` memory: zero-copy), and the rank signals *ready*;
2. one stream per peer waits for the peer's *ready* and *pulls* the peer's chunk out of the
   peer's window with ``cudaMemcpyAsync`` straight into the destination (the result tensor, or a
   staging buffer that one reduction kernel on the caller's stream reads); the rank's own chunk
   is copied on the caller's stream, which then joins the peers' streams and signals *done*;
3. before a slot is written again, the caller's stream waits for every rank's *done* of the call
   that last used it (this rank's own too when that call ran on another stream: successive calls
   may run on different streams, as FSDP2's all-gathers and reduce-scatters do).

all_gather, all_to_all(-v) and broadcast are one exchange. Reductions (``sum``/``avg``/``max``/
``min``; 16-bit floats accumulate in float32 and round once, as NCCL does) whose input is at most
``one_shot_bytes`` (default 256 KiB) are one exchange with no pulls: once every peer is ready, the
reduction kernel reads every rank's window slot in place (IPC-opened memory) in rank order and
writes the result, then the rank signals *done*: the shortest chain of stream operations, and
the ranks' all_reduce results are bitwise equal. This is the one-shot form of NCCL's LL protocols
and of custom all-reduces; all_reduce is then one exchange instead of two. Larger reductions
keep the bytes on copy engines: reduce_scatter is one exchange pulling every rank's chunk into a
staging buffer of ``world_size`` chunks and one reduction; all_reduce is a reduce_scatter of
chunks of ``ceil(n / world_size)`` elements and an all_gather of them (each rank moves 2n bytes
instead of world_size * n). The reductions are the only SM work; :meth:`stats` counts their
kernels and bytes (``window_read_bytes``: what they read from peers' windows in place).

How *ready* and *done* are signalled (``sync``):

* ``"flags"`` (default): each rank has 32-bit counters ``ready[s]`` and ``done[s]`` per slot in a
  small IPC-shared device page, written by its streams with ``cuStreamWriteValue32``
  (``ready[s] = done[s] = k + 1`` in call k, slot s = k % 2) and waited on by the peers' streams
  with ``cuStreamWaitValue32`` (``>=``). Before writing slot s the caller's stream waits for every
  rank's ``done[s] >= k - 1`` (call k - 2 finished). No host barrier at all: the host only
  enqueues. A wait issued before the peer's write is simply satisfied later; a peer ahead by one
  call cannot overwrite the slot being read (it waits on ``done``). The counters are per slot so
  that each one's writes are ordered (call k + 2 writes after waiting for call k), even when
  successive calls run on different streams.
* ``"event"``: inter-process CUDA events. An IPC event wait sees the most recent record issued
  before it, so one host barrier per call orders each ``ready`` record before the peers' waits;
  two slots as above, ``done`` of call k - 2 waited on before writing.
* ``"barrier"``: events and one slot; a second host barrier after ``done`` is recorded, so the
  next call's waits see this call's records.

The argument for ``event``: ``ready[s]`` of call k is recorded before barrier k and waited on
after it; its next record (call k + 2) comes after barrier k + 1, which the waiting peer enters
only after its wait. ``done[s]`` of call k - 2 was recorded before barrier k - 1 and is waited on
in call k before barrier k; its next record (call k) comes after barrier k.

A tensor from :meth:`window` lives in the slot of the next call, and ``window()`` makes the
caller's stream wait for the peers' last reads of that slot, so filling it is safe; with two slots,
fill a fresh ``window()`` tensor for each call (one kept from an earlier call still works, through
a staging copy, but may be rewritten while a peer reads it).

No kernel moves data: the copies are ``cudaMemcpyAsync`` calls, which cross a copy engine between
GPUs (NVLink/PCIe peer copies). Two or more ranks sharing one GPU also work (IPC handles open
between processes of one device; NCCL refuses that case); a same-device copy may run on SMs, so
that case proves correctness, not SM-freedom. The host never waits for the GPU except when the
window grows and at finalize. Collectives return as soon as they are queued on the caller's
current stream.

The public collectives take CUDA tensors only (``ValueError`` otherwise). CPU tensors reach the
backend hooks only for the base class's host handshakes (signatures, split counts), which go to
the delegate. A group spanning several nodes composes its all_gather, all_to_all(-v) and
broadcast of an intra-node copy-engine step and an inter-node delegate step (comms/hierarchy.py):
broadcast for any node sizes, all_gather and all_to_all when the nodes hold equal numbers of
ranks (all_to_all: at least two each); the rest, and reductions across nodes, go through the
delegate staged in host memory. send/recv go through the delegate staged in host memory.
"""
from __future__ import annotations

import math
import threading
from typing import Any

import torch

from gemcore.comms.base import DEFAULT_TIMEOUT_S, Communicator
from gemcore.comms.hierarchy import Hierarchy
from gemcore.comms.launch import detect

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault (unified addressing decides the direction)
_EVENT_FLAGS = 0x2 | 0x4  # cudaEventDisableTiming | cudaEventInterprocess
_EVENT_LOCAL = 0x2  # cudaEventDisableTiming
_IPC_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
_MIN_WINDOW = 1 << 20
#: reductions of inputs up to this many bytes read the peers' windows in place: one exchange (see above)
ONE_SHOT_BYTES = 256 << 10
_FLAG_PAGE = 4096
_MAX_CACHED = 256  # entries of the host-side caches (views, streams); all dropped at once beyond
#: byte offsets of this rank's counters in its flag page (one per slot, a cache line apart); the probe word
_FLAG_OFFSET = {"ready0": 0, "ready1": 128, "done0": 256, "done1": 384, "probe": 512}
SYNC_MODES = ("flags", "event", "barrier")
#: 16-bit floats are reduced in float32 and rounded once
_ACCUMULATE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def import_cupy():
    """``cupy``, or a RuntimeError saying how to get it."""
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError("backend 'ce' needs CuPy for CUDA IPC: pip install cupy-cuda12x "
                           f"(CUDA 12: 'gemcore[gpu]'; CUDA 13: 'gemcore[gpu-cuda13]', cupy-cuda13x) ({exc})") from exc
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


def reduce_chunks(stage: torch.Tensor | list[torch.Tensor], out: torch.Tensor, op: str) -> int:
    """Reduce ``stage`` ``(w, m, ...)`` over dim 0 into ``out`` ``(m, ...)``; returns the kernels
    launched. ``stage`` may also be a list of ``w`` tensors of ``out``'s shape (the rows, in rank
    order, where they lie: read in place, no stacking copy). ``avg`` is the sum divided by ``w``;
    float16/bfloat16 accumulate in float32 and round once; integers wrap in their own type."""
    if isinstance(stage, (list, tuple)):
        return _reduce_rows(list(stage), out, op)
    w = stage.shape[0]
    if op in ("max", "min"):
        (torch.amax if op == "max" else torch.amin)(stage, 0, out=out)
        return 1
    acc = _ACCUMULATE.get(stage.dtype)
    if op == "sum":
        torch.sum(stage, 0, dtype=stage.dtype if acc is None else None, out=out)
        return 1
    if acc is None:  # avg of float32 / float64
        torch.sum(stage, 0, out=out)
        out.div_(w)
    else:
        torch.div(torch.sum(stage, 0, dtype=acc), w, out=out)
    return 2


def _reduce_rows(rows: list[torch.Tensor], out: torch.Tensor, op: str) -> int:
    """:func:`reduce_chunks` of separate rows, folded left to right (the same order on every rank,
    so every rank's result is the same bit for bit). ``out`` may be one of ``rows``."""
    w = len(rows)
    if w == 1:
        out.copy_(rows[0])
        return 1
    if out.numel() and any(row.data_ptr() == out.data_ptr() for row in rows[2:]):  # out: a row read later
        folded = torch.empty_like(out)
        kernels = _reduce_rows(rows, folded, op)
        out.copy_(folded)
        return kernels + 1
    if op in ("max", "min"):
        fold = torch.maximum if op == "max" else torch.minimum
        fold(rows[0], rows[1], out=out)
        for row in rows[2:]:
            fold(out, row, out=out)
        return w - 1
    acc = _ACCUMULATE.get(out.dtype)
    if acc is None or (op == "sum" and w == 2):  # two 16-bit floats: one float32 add, one rounding
        torch.add(rows[0], rows[1], out=out)
        for row in rows[2:]:
            out.add_(row)
        if op == "avg":
            out.div_(w)
        return w if op == "avg" else w - 1
    total = rows[0].to(acc)
    for row in rows[1:]:
        total.add_(row)
    if op == "avg":
        torch.div(total, w, out=out)
    else:
        out.copy_(total)
    return w + 1


class _CudaArray:
    """A bare ``__cuda_array_interface__`` so torch can view raw device memory (uint8)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class CopyEngineCommunicator(Communicator):
    """Collectives of CUDA tensors among the ranks of one node moved by copy engines (CUDA IPC);
    reductions by one local kernel; host handshakes and inter-node steps delegated."""

    backend = "ce"

    def __init__(self, *, timeout_s: float | None = DEFAULT_TIMEOUT_S, check: bool = True,
                 delegate: str | Communicator | None = None, window_bytes: int | str = 64 << 20,
                 sync: str = "flags", one_shot_bytes: int | str = ONE_SHOT_BYTES) -> None:
        super().__init__(timeout_s=timeout_s, check=check)
        if sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {', '.join(map(repr, SYNC_MODES))}, got {sync!r}")
        try:
            one_shot = int(one_shot_bytes)
        except (TypeError, ValueError):
            one_shot = -1
        if one_shot < 0:
            raise ValueError(f"one_shot_bytes must be a byte count >= 0, got {one_shot_bytes!r}")
        #: reductions of inputs of at most this many bytes: one exchange, the peers' windows read in place
        self.one_shot_bytes = one_shot
        #: "flags": GPU counters, no host barrier; "event": IPC events, one; "barrier": two
        self.sync = sync
        self._slots = 1 if sync == "barrier" else 2
        #: the caller's stream of each slot's last call (its own reads of the slot are ordered on it)
        self._slot_streams: list = [None] * self._slots
        self._calls = 0
        self._counts = {"exchanges": 0, "copies": 0, "copied_bytes": 0, "staged_bytes": 0,
                        "reduce_kernels": 0, "reduced_bytes": 0, "window_read_bytes": 0,
                        "host_staged_calls": 0}
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'ce' needs a CUDA GPU (copy-engine collectives over CUDA IPC); "
                               "torch.cuda.is_available() is False")
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
        self._mem_ops = None
        if sync == "flags":
            from gemcore.comms.ce_flags import StreamFlags
            self._mem_ops = StreamFlags(bind=lambda: self.rt.setDevice(self.device.index))
        self.intra_node = self.num_nodes == 1
        self._capacity = 0
        self._window = 0
        self._peer_windows: list[int] = []
        #: each rank's window slots as uint8 tensors (``[rank][slot]``), for in-place reads
        self._peer_slots: list[list[torch.Tensor]] = []
        self._views: dict[tuple, torch.Tensor] = {}  # typed views of them, by (rank, slot, offset, numel, dtype)
        self._stream_objects: dict[int, torch.cuda.Stream] = {}  # by raw handle (_current)
        self._events: dict[str, int] = {}
        self._local = threading.local()  # this thread's event for _follow
        self._thread_events: list[int] = []
        self._peer_events: dict[str, list[int]] = {}
        self._flags = 0
        self._peer_flags: list[int] = []
        self._streams: list[torch.cuda.Stream] = []
        #: several nodes: intra-node ce and inter-node delegate communicators, made on first use
        self._hier: Hierarchy | None = None
        if self.intra_node:
            with self.cupy.cuda.Device(self.device.index):
                if sync == "flags":
                    self._open_flags()
                else:
                    self._open_events()
                self._grow(max(_MIN_WINDOW, int(window_bytes)))
                self._streams = [torch.cuda.Stream(self.device) for _ in range(self.world_size)]

    def describe(self) -> str:
        if self.intra_node:
            path = (f"copy engine (sync {self.sync}); reduce_scatter and all_reduce: copy-engine pulls "
                    f"+ one local reduction kernel; send/recv staged through the delegate")
        else:
            path = ("several nodes: all_gather/all_to_all/broadcast hierarchical (delegate across nodes, "
                    "copy engine within), reductions and send/recv staged through the delegate")
        return f"{super().describe()}, {path}, delegate {self.delegate.backend}"

    # ------------------------------------------------------------------ registration
    def _ipc(self, call: str, *args):
        """``self.rt.<call>(*args)``, a CUDA IPC call; its failure raised as one line saying why."""
        try:
            return getattr(self.rt, call)(*args)
        except Exception as exc:  # noqa: BLE001 (CuPy's CUDARuntimeError and friends, re-raised)
            raise RuntimeError(f"backend 'ce' needs CUDA IPC between the processes of a node: {call} failed "
                               f"on rank {self.rank} ({exc}); CUDA IPC needs Linux, processes that can see "
                               f"the same GPUs, and no MIG partitioning") from exc

    def _gather_bytes(self, data: bytes) -> list[bytes]:
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = self.delegate._all_gather_impl(mine).view(self.world_size, len(data))
        return [bytes(r.tolist()) for r in rows]

    def _open_events(self) -> None:
        for name in [f"{kind}{slot}" for slot in range(self._slots) for kind in ("ready", "done")]:
            event = self.rt.eventCreateWithFlags(_EVENT_FLAGS)
            self._events[name] = event
            handles = self._gather_bytes(self._ipc("ipcGetEventHandle", event))
            self._peer_events[name] = [event if r == self.rank else self._ipc("ipcOpenEventHandle", h)
                                       for r, h in enumerate(handles)]

    def _open_flags(self) -> None:
        """This rank's zeroed counter page, its peers' pages opened, and a probe of the driver's
        stream memory operations (a clear error now rather than a hang later)."""
        self._flags = self.rt.malloc(_FLAG_PAGE)
        self.rt.memset(self._flags, 0, _FLAG_PAGE)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        probe = self._flags + _FLAG_OFFSET["probe"]
        self._mem_ops.write(stream, probe, 1)
        self._mem_ops.wait_geq(stream, probe, 1)
        torch.cuda.synchronize(self.device)  # the zeroed page is visible before any peer waits on it
        handles = self._gather_bytes(self._ipc("ipcGetMemHandle", self._flags))
        self._peer_flags = [self._flags if r == self.rank else
                            self._ipc("ipcOpenMemHandle", h, _IPC_LAZY_PEER_ACCESS) for r, h in enumerate(handles)]

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
        handles = self._gather_bytes(self._ipc("ipcGetMemHandle", self._window))
        self._peer_windows = [self._window if r == self.rank else
                              self._ipc("ipcOpenMemHandle", h, _IPC_LAZY_PEER_ACCESS) for r, h in enumerate(handles)]
        self._peer_slots = [[self._window_tensor(self._slot_ptr(base, slot), nbytes, (nbytes,), torch.uint8)
                             for slot in range(self._slots)] for base in self._peer_windows]

    def _close_windows(self) -> None:
        for r, ptr in enumerate(self._peer_windows):
            if r != self.rank:
                self.rt.ipcCloseMemHandle(ptr)
        if self._window:
            self.rt.free(self._window)
        self._peer_windows, self._peer_slots, self._window, self._capacity = [], [], 0, 0
        self._views = {}

    def window(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A tensor in this rank's registered window, in the slot the next ce collective uses
        (collective: every rank calls it with the same size). Passing it to the next all_gather /
        all_to_all / broadcast / reduce_scatter skips the staging copy. Its contents stay valid
        until the next ce collective of this communicator; take a fresh one for each call."""
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if not self.intra_node:
            return torch.empty(shape, dtype=dtype, device=self.device)
        self._grow(nbytes)
        slot = self._calls % self._slots
        self._before_write(self._calls, slot, self._current())  # wait for the peers' reads of this slot
        return self._window_tensor(self._slot_ptr(self._window, slot), nbytes, shape, dtype)

    def _in_window(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s memory starts inside this rank's window."""
        return self._window <= t.data_ptr() < self._window + self._slots * self._capacity

    def _window_tensor(self, ptr: int, nbytes: int, shape, dtype: torch.dtype) -> torch.Tensor:
        raw = torch.as_tensor(_CudaArray(ptr, max(nbytes, 1)), device=self.device)
        return raw[:nbytes].view(dtype).view(shape)

    def _peer_view(self, peer: int, slot: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements at byte ``offset`` of ``peer``'s window slot ``slot``, read in place
        (views of the opened IPC memory, kept per window: successive calls ask for the same ones)."""
        key = (peer, slot, offset, numel, dtype)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= _MAX_CACHED:
                self._views.clear()
            raw = self._peer_slots[peer][slot]
            view = self._views[key] = raw[offset:offset + numel * dtype.itemsize].view(dtype)
        return view

    def _slot_ptr(self, base: int, slot: int) -> int:
        return base + slot * self._capacity

    # ------------------------------------------------------------------ stream primitives
    # The protocol below is written with these primitives only, so that a simulated runtime (the
    # tests' happens-before checker) can run it on CPU.
    def _current(self) -> torch.cuda.Stream:
        """The caller's current stream (its Stream object kept by raw handle: building one per
        call costs microseconds of host time on every collective)."""
        raw = torch._C._cuda_getCurrentRawStream(self.device.index)
        stream = self._stream_objects.get(raw)
        if stream is None:
            if len(self._stream_objects) >= _MAX_CACHED:
                self._stream_objects.clear()
            stream = self._stream_objects[raw] = torch.cuda.current_stream(self.device)
        return stream

    def _record(self, event: str, stream) -> None:
        """Record this rank's IPC event ``event`` on ``stream``."""
        self.rt.eventRecord(self._events[event], stream.cuda_stream)

    def _wait(self, stream, peer: int, event: str) -> None:
        """``stream`` waits for the most recent record of ``peer``'s event ``event``."""
        self.rt.streamWaitEvent(stream.cuda_stream, self._peer_events[event][peer], 0)

    def _write_flag(self, stream, flag: str, value: int) -> None:
        """Queue on ``stream``: this rank's counter ``flag`` = ``value`` (after earlier work)."""
        self._mem_ops.write(stream.cuda_stream, self._flags + _FLAG_OFFSET[flag], value)

    def _wait_flag(self, stream, peer: int, flag: str, value: int) -> None:
        """Queue on ``stream``: wait until ``peer``'s counter ``flag`` >= ``value``."""
        self._mem_ops.wait_geq(stream.cuda_stream, self._peer_flags[peer] + _FLAG_OFFSET[flag], value)

    def _copy(self, dst: int, src: int, nbytes: int, stream) -> None:
        self.rt.memcpyAsync(dst, src, nbytes, _MEMCPY_DEFAULT, stream.cuda_stream)

    def _follow(self, stream, other) -> None:
        """``stream``'s later work waits for the work queued on ``other`` so far (one reused event
        per thread: a stream wait binds to the record made before it, so re-recording is safe)."""
        event = getattr(self._local, "event", None)
        if event is None:
            event = self._local.event = self.rt.eventCreateWithFlags(_EVENT_LOCAL)
            self._thread_events.append(event)
        self.rt.eventRecord(event, other.cuda_stream)
        self.rt.streamWaitEvent(stream.cuda_stream, event, 0)

    def _host_barrier(self) -> None:
        self.delegate._barrier_impl()

    def _reduce(self, stage, out: torch.Tensor, op: str) -> None:
        """The one SM step, on the caller's stream: reduce ``stage`` into ``out``: the pulled chunks
        ``(w, m, ...)``, or the list of every rank's rows read in place (:func:`reduce_chunks`)."""
        self._counts["reduce_kernels"] += reduce_chunks(stage, out, op)
        rows = stage if isinstance(stage, list) else [stage]
        self._counts["reduced_bytes"] += sum(r.numel() * r.element_size() for r in rows)

    # ------------------------------------------------------------------ the copy-engine protocol
    def _in_use(self, t) -> None:
        """The caller's tensor ``t`` is read or written by work queued on the current stream (which
        joins the pull streams): its memory is not reused before that work is done, even if the
        caller frees it and it was allocated on another stream (memory outside torch's caching
        allocator, such as window views, is left alone by ``record_stream``)."""
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(self._current())

    def _use_ce(self, t: torch.Tensor) -> bool:
        return t.is_cuda and self.intra_node

    def _before_write(self, k: int, slot: int, stream) -> None:
        """``stream``'s later writes of slot ``slot`` (call ``k``) wait for every rank's reads of
        it, this rank's own included when the slot's last call ran on another stream (successive
        calls may be queued on different streams; on the same one, stream order suffices)."""
        own_in_order = self._slot_streams[slot] is stream  # the same (kept) Stream object
        ranks = [r for r in range(self.world_size) if not (own_in_order and r == self.rank)]
        if self.sync == "flags":
            if k >= self._slots:  # every rank finished call k - slots
                for rank in ranks:
                    self._wait_flag(stream, rank, f"done{slot}", k - self._slots + 1)
        else:  # event, barrier: the most recent records are those of the slot's last call
            for rank in ranks:
                self._wait(stream, rank, f"done{slot}")

    def _wait_ready(self, stream, peer: int, slot: int, k: int) -> None:
        """``stream`` waits for ``peer``'s *ready* of call ``k`` in slot ``slot`` (its counter, or the
        most recent record of its event, which the host barrier of call ``k`` made this call's)."""
        if self.sync == "flags":
            self._wait_flag(stream, peer, f"ready{slot}", k + 1)
        else:
            self._wait(stream, peer, f"ready{slot}")

    def _exchange(self, t: torch.Tensor, window_bytes: int, pulls: list[tuple[int, int, int, int]],
                  src_ranks_stage: bool = True, read_windows=None) -> None:
        """Run one exchange (steps 1-3 of the module docstring) on the caller's current stream.

        :param pulls: ``(peer, peer window offset, destination pointer, bytes)`` copies to make.
        :param src_ranks_stage: whether this rank copies ``t`` into its window (step 1).
        :param read_windows: ``read_windows(slot)`` queues work on the caller's stream that reads
            every rank's window slot in place (the direct reduction); it runs once every peer is
            ready and before *done*.
        """
        self._grow(window_bytes)
        k = self._calls
        slot = k % self._slots
        self._calls += 1
        flags = self.sync == "flags"
        ready, done = f"ready{slot}", f"done{slot}"
        cur = self._current()
        mine = self._slot_ptr(self._window, slot)
        self._before_write(k, slot, cur)
        self._in_use(t)
        active = [pull for pull in pulls if pull[3]]
        remote = [pull for pull in active if pull[0] != self.rank]
        for peer in dict.fromkeys(p for p, *_ in remote):  # the destinations were allocated on cur;
            self._follow(self._streams[peer], cur)  # following before the staging copy lets the pulls overlap it
        if src_ranks_stage and t.numel() and t.data_ptr() != mine:
            self._copy(mine, t.data_ptr(), t.numel() * t.element_size(), cur)
            self._counts["staged_bytes"] += t.numel() * t.element_size()
        if flags:
            self._write_flag(cur, ready, k + 1)
        else:
            self._record(ready, cur)
            self._host_barrier()
        for peer, offset, dst, nbytes in remote:  # issued first, so they do not wait for the own copy
            stream = self._streams[peer]
            self._wait_ready(stream, peer, slot, k)
            self._copy(dst, self._slot_ptr(self._peer_windows[peer], slot) + offset, nbytes, stream)
        if read_windows is not None:
            for peer in range(self.world_size):
                if peer != self.rank:
                    self._wait_ready(cur, peer, slot, k)
            read_windows(slot)
        for _, offset, dst, nbytes in [pull for pull in active if pull[0] == self.rank]:
            self._copy(dst, mine + offset, nbytes, cur)  # this rank's own chunk, on the caller's stream
        for peer in dict.fromkeys(p for p, *_ in remote):
            self._follow(cur, self._streams[peer])
        if flags:
            self._write_flag(cur, done, k + 1)
        else:
            self._record(done, cur)
        if self.sync == "barrier":  # every done record is issued before the next call waits on it
            self._host_barrier()
        self._slot_streams[slot] = cur
        self._counts["exchanges"] += 1
        self._counts["copies"] += len(active)
        self._counts["copied_bytes"] += sum(p[3] for p in active)

    # ------------------------------------------------------------------ several nodes
    def _spans_nodes(self, t: torch.Tensor) -> bool:
        """Whether a collective on ``t`` takes the hierarchical path (CUDA, several nodes)."""
        return t.is_cuda and not self.intra_node

    def _child(self, sub: Communicator, check: bool) -> "CopyEngineCommunicator":
        """A ce communicator over the delegate's sub-communicator ``sub``, with this one's settings
        (sync mode, one-shot size, timeout) and a window of its own."""
        return CopyEngineCommunicator(timeout_s=self.timeout_s, check=check, delegate=sub,
                                      window_bytes=_MIN_WINDOW, sync=self.sync,
                                      one_shot_bytes=self.one_shot_bytes)

    def _make_intra(self, sub: Communicator) -> Communicator:
        """The copy-engine communicator of this node's ranks (``sub``: the delegate's)."""
        return self._child(sub, check=False)

    def _hierarchy(self) -> Hierarchy:
        """The intra-node ce and inter-node delegate communicators (collective on first call:
        every rank reaches it through the same CUDA collective)."""
        if self._hier is None:
            self._hier = Hierarchy(self.delegate, self._make_intra)
        return self._hier

    def _via_host(self, t: torch.Tensor, run):
        """``run(host copy of t)`` on the delegate, the result back on ``t``'s device (synchronises
        the host with the GPU: the delegate moves host memory)."""
        if not t.is_cuda:
            return run(t)
        self._counts["host_staged_calls"] += 1
        result = run(t.cpu())
        return None if result is None else result.to(t.device)

    # ------------------------------------------------------------------ public boundary: CUDA only
    def _served(self, t, op: str) -> None:
        """A ValueError unless ``t`` (when a tensor; other arguments are checked later) is on CUDA."""
        if isinstance(t, torch.Tensor) and t.device.type != "cuda":
            raise ValueError(f"{op}: backend 'ce' serves CUDA tensors (copy engines over CUDA IPC), "
                             f"got one on {t.device}")

    def all_gather(self, t):
        self._served(t, "all_gather")
        return super().all_gather(t)

    def all_gather_into(self, out, t):
        self._served(t, "all_gather_into")
        return super().all_gather_into(out, t)

    def reduce_scatter(self, t, op="sum"):
        self._served(t, "reduce_scatter")
        return super().reduce_scatter(t, op)

    def reduce_scatter_into(self, out, t, op="sum"):
        self._served(t, "reduce_scatter_into")
        return super().reduce_scatter_into(out, t, op)

    def all_reduce(self, t, op="sum"):
        self._served(t, "all_reduce")
        return super().all_reduce(t, op)

    def all_to_all(self, t, in_splits=None, out_splits=None):
        self._served(t, "all_to_all")
        return super().all_to_all(t, in_splits, out_splits)

    def broadcast(self, t, src=0):
        self._served(t, "broadcast")
        return super().broadcast(t, src)

    def send(self, t, dst, tag=0):
        self._served(t, "send")
        return super().send(t, dst, tag)

    def recv(self, t, src, tag=0):
        self._served(t, "recv")
        return super().recv(t, src, tag)

    # ------------------------------------------------------------------ collectives
    def _all_gather_impl(self, t: torch.Tensor) -> torch.Tensor:
        if self._spans_nodes(t):
            got = self._hierarchy().all_gather(t)
            return got if got is not None else self._via_host(t, self.delegate._all_gather_impl)
        if not self._use_ce(t):  # host handshakes (signatures, handles)
            return self.delegate._all_gather_impl(t)
        out = t.new_empty((self.world_size * t.shape[0], *t.shape[1:]))
        self._all_gather_into_impl(out, t)
        return out

    def _all_gather_into_impl(self, out: torch.Tensor, t: torch.Tensor) -> None:
        if not self._use_ce(t):
            out.copy_(self._all_gather_impl(t))
            return
        self._in_use(out)
        nbytes = t.numel() * t.element_size()
        in_place = t.data_ptr() == out.data_ptr() + self.rank * nbytes  # t is this rank's chunk of out
        pulls = [(p, 0, out.data_ptr() + p * nbytes, nbytes) for p in range(self.world_size)
                 if not (in_place and p == self.rank)]
        self._exchange(t, nbytes, pulls)

    def _reduce_scatter_impl(self, t: torch.Tensor, op: str) -> torch.Tensor:
        out = t.new_empty((t.shape[0] // self.world_size, *t.shape[1:]))
        self._reduce_scatter_into_impl(out, t, op)
        return out

    def _reduce_scatter_into_impl(self, out: torch.Tensor, t: torch.Tensor, op: str) -> None:
        if not self._use_ce(t):
            out.copy_(self._via_host(t, lambda h: self.delegate._reduce_scatter_impl(h, op)))
            return
        self._in_use(out)
        w = self.world_size
        flat = t.reshape(-1)
        bounds = [r * (flat.numel() // w) for r in range(w + 1)]
        self._reduce_into(out.view(-1), flat, bounds[self.rank], bounds[self.rank + 1], op)

    def _reduce_into(self, out: torch.Tensor, flat: torch.Tensor, lo: int, hi: int, op: str) -> None:
        """One exchange and one reduction: this rank reduces elements ``[lo, hi)`` of every rank's
        1-D ``flat`` into 1-D ``out``. Up to ``one_shot_bytes`` of ``flat``, the reduction reads
        the peers' window slots in place (no pull copies, no staging buffer: the shortest chain of
        stream operations); above, the peers' rows are pulled by copy engines into a staging
        buffer first."""
        elem = flat.element_size()
        if flat.numel() * elem <= self.one_shot_bytes:
            def read_windows(slot: int) -> None:
                rows = [flat[lo:hi] if p == self.rank else
                        self._peer_view(p, slot, lo * elem, hi - lo, flat.dtype) for p in range(self.world_size)]
                self._reduce(rows, out, op)
                self._counts["window_read_bytes"] += (self.world_size - 1) * (hi - lo) * elem
            self._exchange(flat, flat.numel() * elem, [], read_windows=read_windows)
            return
        stage = flat.new_empty((self.world_size, hi - lo))
        row = (hi - lo) * elem
        pulls = [(p, lo * elem, stage.data_ptr() + p * row, row) for p in range(self.world_size)]
        self._exchange(flat, flat.numel() * elem, pulls)
        self._reduce(stage, out, op)

    def _all_reduce_impl(self, t: torch.Tensor, op: str) -> torch.Tensor:
        if not self._use_ce(t):
            return self._via_host(t, lambda h: self.delegate._all_reduce_impl(h, op))
        out = torch.empty_like(t)
        self._all_reduce_ce(out, t, op)
        return out

    def _all_reduce_into_impl(self, out: torch.Tensor, t: torch.Tensor, op: str) -> None:
        if self._use_ce(t) and not self._spans_nodes(t):
            return self._all_reduce_ce(out, t, op)
        return super()._all_reduce_into_impl(out, t, op)

    def _all_reduce_ce(self, out: torch.Tensor, t: torch.Tensor, op: str) -> None:
        """all_reduce of CUDA ``t`` written into ``out`` (same shape, contiguous; may be ``t``
        itself: the input is staged in the window before any of ``out`` is written)."""
        if self._in_window(out):
            raise ValueError("all_reduce: out is window memory of backend 'ce' (the peers read the window "
                             "while the result is written); window() tensors are inputs of all_gather, "
                             "all_to_all, broadcast and reduce_scatter")
        self._in_use(out)
        w, flat, dst = self.world_size, t.reshape(-1), out.view(-1)
        if not flat.numel():
            return
        elem = flat.element_size()
        if flat.numel() * elem <= self.one_shot_bytes:  # one exchange of whole inputs
            self._reduce_into(dst, flat, 0, flat.numel(), op)
            return
        per = -(-flat.numel() // w)
        bounds = [min(r * per, flat.numel()) for r in range(w + 1)]
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        self._reduce_into(dst[lo:hi], flat, lo, hi, op)
        pulls = [(p, 0, dst.data_ptr() + bounds[p] * elem, (bounds[p + 1] - bounds[p]) * elem)
                 for p in range(w) if p != self.rank]  # this rank's chunk is in place already
        self._exchange(dst[lo:hi], per * elem, pulls)

    def _all_to_all_impl(self, t: torch.Tensor, in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
        if self._spans_nodes(t):
            out = self._hierarchy().all_to_all(t, in_splits, out_splits)
            if out is not None:
                return out
            return self._via_host(t, lambda h: self.delegate._all_to_all_impl(h, in_splits, out_splits))
        if not self._use_ce(t):
            return self.delegate._all_to_all_impl(t, in_splits, out_splits)
        out = t.new_empty((sum(out_splits), *t.shape[1:]))
        self._all_to_all_ce(out, t, in_splits, out_splits)
        return out

    def _all_to_all_into_impl(self, out: torch.Tensor, t: torch.Tensor, in_splits: list[int],
                              out_splits: list[int]) -> None:
        if self._use_ce(t) and not self._spans_nodes(t):
            return self._all_to_all_ce(out, t, in_splits, out_splits)
        return super()._all_to_all_into_impl(out, t, in_splits, out_splits)

    def _all_to_all_ce(self, out: torch.Tensor, t: torch.Tensor, in_splits: list[int],
                       out_splits: list[int]) -> None:
        """all_to_all(-v) of CUDA ``t`` pulled straight into ``out`` (``(sum(out_splits), ...)``,
        contiguous)."""
        self._in_use(out)
        w = self.world_size
        matrix = self.delegate._all_gather_impl(torch.tensor(in_splits, dtype=torch.int64)).view(w, w).tolist()
        got = [matrix[p][self.rank] for p in range(w)]
        if got != list(out_splits):
            raise ValueError(f"[rank {self.rank}] out_splits={list(out_splits)} but the ranks send {got} rows here")
        row = t.element_size() * math.prod(t.shape[1:])
        pulls, dst = [], out.data_ptr()
        for p in range(w):
            offset = sum(matrix[p][: self.rank]) * row
            pulls.append((p, offset, dst, matrix[p][self.rank] * row))
            dst += matrix[p][self.rank] * row
        self._exchange(t, max(sum(r) for r in matrix) * row, pulls)

    def _broadcast_impl(self, t: torch.Tensor, src: int) -> None:
        if self._spans_nodes(t):
            return self._hierarchy().broadcast(t, src)
        if not self._use_ce(t):
            return self.delegate._broadcast_impl(t, src)
        nbytes = t.numel() * t.element_size()
        pulls = [] if self.rank == src else [(src, 0, t.data_ptr(), nbytes)]
        self._exchange(t, nbytes, pulls, src_ranks_stage=self.rank == src)
        return None

    def _barrier_impl(self) -> None:
        self.delegate._barrier_impl()

    def _split_impl(self, groups: list[list[int]], index: int) -> Communicator:
        sub = self.delegate._split_impl(groups, index)
        return self._child(sub, check=self.check)

    # Point to point goes through the delegate; a gloo delegate moves host memory only, so CUDA
    # tensors are staged through pinned host buffers (pipeline stages' activations: small).
    def _isend_impl(self, t: torch.Tensor, dst: int, tag: int):
        if t.is_cuda and self.delegate.backend == "gloo":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._counts["host_staged_calls"] += 1
            host.copy_(t)  # synchronous: the send may read the buffer at once
            return self.delegate._isend_impl(host, dst, tag)
        return self.delegate._isend_impl(t, dst, tag)

    def _irecv_impl(self, t: torch.Tensor, src: int, tag: int):
        if t.is_cuda and self.delegate.backend == "gloo":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._counts["host_staged_calls"] += 1
            pending = self.delegate._irecv_impl(host, src, tag)

            def wait() -> None:
                pending()
                t.copy_(host, non_blocking=True)  # ordered on the current stream
            return wait
        return self.delegate._irecv_impl(t, src, tag)

    def _subgroup_impl(self, members: list[int], store) -> Communicator:
        sub = self.delegate._subgroup_impl(members, store)
        return self._child(sub, check=self.check)

    def _finalize_impl(self) -> None:
        if self._hier is not None:
            self._hier.finalize()
            self._hier = None
        if self._window or self._flags:
            torch.cuda.synchronize(self.device)
            self.delegate._barrier_impl()
            self._close_windows()
        for r, ptr in enumerate(self._peer_flags):
            if r != self.rank:
                self.rt.ipcCloseMemHandle(ptr)
        if self._flags:
            self.rt.free(self._flags)
        self._flags, self._peer_flags = 0, []
        for name, event in self._events.items():
            for r, peer_event in enumerate(self._peer_events.get(name, [])):
                if r != self.rank:
                    self.rt.eventDestroy(peer_event)
            self.rt.eventDestroy(event)
        self._events, self._peer_events = {}, {}
        for event in self._thread_events:
            self.rt.eventDestroy(event)
        self._thread_events, self._local = [], threading.local()
        self.delegate._finalize_impl()

    def stats(self) -> dict[str, Any]:
        """Window, path and counters since creation: ``exchanges``, ``copies`` / ``copied_bytes``
        (copy-engine pulls), ``staged_bytes`` (inputs copied into the window), ``reduce_kernels`` /
        ``reduced_bytes`` (the only SM work: reductions of pulled chunks), ``host_staged_calls``
        (calls that went through the delegate in host memory)."""
        return {"window_bytes": self._capacity, "slots": self._slots, "sync": self.sync,
                "intra_node": self.intra_node, "delegate": self.delegate.backend, **self._counts}
