"""gemcore communicators as torch.distributed backends.

Every gemcore backend (``mpi``, ``ce``, a plugin's) is also a torch.distributed backend named
``gemcore_<name>``, registered with :meth:`torch.distributed.Backend.register_backend` as a Python
:class:`torch.distributed.ProcessGroup` that calls the :class:`~gemcore.comms.Communicator`. Then
``DeviceMesh``, FSDP2, DTensor and functional collectives, ``torch.distributed.pipelining`` and
gemcore's own context and expert parallelism move their bytes through it with no change to their
code::

    comm = comms.init("mpi")                 # the job's communicator
    comms.process_group.init_process_group(comm)   # torch.distributed's default group runs on it
    mesh = init_device_mesh("cpu", (4,))     # sub-groups: comm.subgroup(ranks) on their members

What it serves (everything FSDP2, TP, CP, EP and pipelining call): ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` (sum, avg, max, min; their coalesced forms), ``all_gather`` (list form),
``all_reduce`` (and coalesced), ``all_to_all_single`` with uneven splits, ``broadcast``,
``scatter``, ``gather``, ``reduce``, ``send``/``recv`` and ``barrier``. Any other operation raises
``NotImplementedError`` naming the operation and the backend; nothing falls back to another
backend. A tensor on a device the backend does not serve raises ``ValueError`` naming both.

Completion: the communicator has done its part when a method returns: its work is queued on the
caller's current stream (CUDA) or done (host). The returned ``Work`` remembers that stream:
``work.wait()`` makes the caller's current stream wait for it (no host synchronisation; nothing at
all on the same stream), and ``work.get_future()`` is a CUDA future of it. So a copy-engine
collective queued on FSDP2's all-gather stream overlaps compute exactly as NCCL's does.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from gemcore.comms.base import Communicator

#: prefix of the torch.distributed backend names of gemcore communicators
PREFIX = "gemcore_"

#: devices each built-in backend serves (a plugin's backend: both)
SERVED_DEVICES = {"mpi": ("cpu", "cuda"), "ce": ("cuda",), "single": ("cpu", "cuda"), "gloo": ("cpu",)}

#: torch.distributed ProcessGroup methods that this backend does not implement
UNSUPPORTED = ("allgather_coalesced", "recv_anysource", "alltoall", "monitored_barrier")

_RED_OPS = [("SUM", "sum"), ("AVG", "avg"), ("MAX", "max"), ("MIN", "min")]

_registered: set[str] = set()


def backend_name(comm_backend: str) -> str:
    """The torch.distributed backend name of gemcore backend ``comm_backend`` (``gemcore_mpi``)."""
    return PREFIX + comm_backend


def _reduce_op(op, backend: str) -> str:
    for torch_name, ours in _RED_OPS:
        if op == getattr(dist.ReduceOp, torch_name):
            return ours
    raise NotImplementedError(f"reduce op {op} is not implemented by the {backend} process group "
                              f"(sum, avg, max, min)")


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)


def _completed(result, tensors: Sequence[torch.Tensor]) -> "_QueuedWork":
    """The Work of a collective the communicator has queued: on CUDA, on the current stream."""
    for t in tensors:
        index = t.get_device()
        if index >= 0:
            return _QueuedWork(result, index, torch._C._cuda_getCurrentRawStream(index))
    return _QueuedWork(result, -1, 0)


class _QueuedWork(dist.Work):
    """A collective already queued on CUDA stream ``raw_stream`` of device ``index`` (index -1:
    done on the host).

    ``wait()`` makes the caller's current stream wait for that stream (nothing to do on the same
    stream, the common case, so it costs no CUDA call); ``get_future()`` builds a CUDA future of it
    on demand. Making that future on every call instead costs about 9 µs of host time per
    collective, a tenth of a small collective's latency.
    """

    def __init__(self, result, index: int, raw_stream: int) -> None:
        super().__init__()
        self._result, self._index, self._raw = result, index, raw_stream

    def _stream(self) -> torch.cuda.Stream:
        return torch.cuda.ExternalStream(self._raw, device=torch.device("cuda", self._index))

    def wait(self, timeout=None) -> bool:
        if self._index >= 0 and torch._C._cuda_getCurrentRawStream(self._index) != self._raw:
            torch.cuda.current_stream(self._index).wait_stream(self._stream())
        return True

    def is_completed(self) -> bool:
        # the stream's later work included: never True before this collective is done
        return self._index < 0 or self._stream().query()

    def get_future(self):
        if self._index < 0:
            fut = torch.futures.Future()
            fut.set_result(self._result)
            return fut
        fut = torch.futures.Future(devices=[torch.device("cuda", self._index)])
        with torch.cuda.stream(self._stream()):
            fut.set_result(self._result)  # records an event of the collective's stream
        return fut

    def result(self):
        return self._result


class _PendingWork(dist.Work):
    """A point-to-point transfer in flight: ``wait()`` completes it (pipeline schedules post their
    sends and receives together, then wait, so neither may block when posted)."""

    def __init__(self, waits, tensors) -> None:
        super().__init__()
        self._waits, self._tensors, self._done = list(waits), list(tensors), False

    def wait(self, timeout=None) -> bool:
        if not self._done:
            for wait in self._waits:
                wait()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done

    def get_future(self):
        self.wait()
        devices = sorted({t.device for t in self._tensors if t.is_cuda}, key=str)
        fut = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
        fut.set_result(self._tensors)
        return fut


class CommunicatorProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group whose collectives run on ``comm``.

    :param comm: the communicator of exactly this group's ranks, numbered as the group numbers them.
    :param devices: device types it serves (``"cpu"``, ``"cuda"``).
    """

    def __init__(self, comm: Communicator, devices: Sequence[str]) -> None:
        super().__init__(comm.rank, comm.world_size)
        self.comm = comm
        self.devices = tuple(devices)
        self._group_name = ""
        self._group_desc = ""

    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return backend_name(self.comm.backend)

    @property
    def name(self) -> str:
        return self.getBackendName()

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.comm.describe()}>"

    def _served(self, op: str, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            if t.device.type not in self.devices:
                raise ValueError(f"{op}: the {self.getBackendName()} process group serves "
                                 f"{', '.join(self.devices)} tensors, got one on {t.device}")

    # ------------------------------------------------------------------ gather / scatter
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts=None):
        self._served("all_gather_into_tensor", [output, input])
        self._gather_into(output, input)
        return _completed([output], [output])

    _allgather_base = all_gather_single

    def _gather_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if output.numel() != input.numel() * self.comm.world_size:
            raise ValueError(f"all_gather_into_tensor: output has {output.numel()} elements, expected "
                             f"world_size x input = {self.comm.world_size} x {input.numel()}")
        if output.is_contiguous():
            self.comm.all_gather_into(output.view(-1), _flat(input.contiguous()))
        else:
            output.copy_(self.comm.all_gather(_flat(input.contiguous())).view(output.shape))

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        self._served("all_gather_into_tensor (coalesced)", [*outputs, *inputs])
        for out, inp in zip(outputs, inputs, strict=True):
            self._gather_into(out, inp)
        return _completed(list(outputs), list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather(self, output_lists, inputs, opts=None):
        self._served("all_gather", [*inputs, *[t for ts in output_lists for t in ts]])
        for outs, inp in zip(output_lists, inputs, strict=True):
            gathered = self.comm.all_gather(_flat(inp.contiguous()))
            for out, piece in zip(outs, gathered.chunk(self.comm.world_size)):
                out.copy_(piece.view(out.shape))
        return _completed(list(output_lists), [t for ts in output_lists for t in ts])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts=None):
        self._served("reduce_scatter_tensor", [output, input])
        op = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, self.getBackendName())
        self._scatter_into(output, input, op)
        return _completed([output], [output])

    _reduce_scatter_base = reduce_scatter_single

    def _scatter_into(self, output: torch.Tensor, input: torch.Tensor, op: str) -> None:
        if input.numel() != output.numel() * self.comm.world_size:
            raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements, expected "
                             f"world_size x output = {self.comm.world_size} x {output.numel()}")
        if output.is_contiguous():
            self.comm.reduce_scatter_into(output.view(-1), _flat(input.contiguous()), op)
        else:
            output.copy_(self.comm.reduce_scatter(_flat(input.contiguous()), op).view(output.shape))

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        self._served("reduce_scatter_tensor (coalesced)", [*outputs, *inputs])
        op = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, self.getBackendName())
        for out, inp in zip(outputs, inputs, strict=True):
            self._scatter_into(out, inp, op)
        return _completed(list(outputs), list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        self._served("reduce_scatter", [*outputs, *[t for ts in input_lists for t in ts]])
        op = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, self.getBackendName())
        for out, ins in zip(outputs, input_lists, strict=True):
            whole = torch.cat([_flat(t) for t in ins])
            self._scatter_into(out, whole, op)
        return _completed(list(outputs), list(outputs))

    # ------------------------------------------------------------------ reductions
    def allreduce(self, tensors, opts=None):
        self._served("all_reduce", tensors)
        op = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, self.getBackendName())
        for t in tensors:
            if t.is_contiguous():
                self.comm.all_reduce_into(t, t, op)
            else:
                t.copy_(self.comm.all_reduce(t, op))
        return _completed(list(tensors), tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts=None):
        self._served("reduce", tensors)
        op = _reduce_op(opts.reduceOp, self.getBackendName())
        for t in tensors:
            result = self.comm.all_reduce(t, op)
            if self.comm.rank == opts.rootRank:
                t.copy_(result)
        return _completed(list(tensors), tensors)

    # ------------------------------------------------------------------ movement
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        self._served("all_to_all_single", [output, input])
        w = self.comm.world_size
        if input.dim() == 0 or output.dim() == 0:
            raise ValueError("all_to_all_single: input and output need at least one dimension")
        in_rows = list(input_split_sizes) or None
        out_rows = list(output_split_sizes) or [output.shape[0] // w] * w
        if output.is_contiguous():
            self.comm.all_to_all_into(output, input.contiguous(), in_rows, out_rows)
        else:
            output.copy_(self.comm.all_to_all(input.contiguous(), in_rows, out_rows).view(output.shape))
        return _completed([output], [output])

    alltoall_base = all_to_all_single

    def broadcast(self, tensors, opts=None):
        self._served("broadcast", tensors)
        root = opts.rootRank if opts is not None else 0
        for t in tensors:
            self.comm.broadcast(t, root)
        return _completed(list(tensors), tensors)

    def scatter(self, outputs, input_lists, opts=None):
        self._served("scatter", [*outputs, *[t for ts in input_lists for t in ts]])
        root, w = opts.rootRank, self.comm.world_size
        out = outputs[0]
        if self.comm.rank == root:
            pieces = [_flat(t.contiguous()) for t in input_lists[0]]
            send, in_rows = torch.cat(pieces), [p.numel() for p in pieces]
        else:
            send, in_rows = out.new_empty((0,)), [0] * w
        out_rows = [out.numel() if p == root else 0 for p in range(w)]
        out.copy_(self.comm.all_to_all(send, in_rows, out_rows).view(out.shape))
        return _completed([out], [out])

    def gather(self, output_lists, inputs, opts=None):
        self._served("gather", [*inputs, *[t for ts in output_lists for t in ts]])
        root, w = opts.rootRank, self.comm.world_size
        inp = _flat(inputs[0].contiguous())
        in_rows = [inp.numel() if p == root else 0 for p in range(w)]
        got = self.comm.all_to_all(inp, in_rows, None)
        if self.comm.rank == root:
            for out, piece in zip(output_lists[0], got.chunk(w)):
                out.copy_(piece.view(out.shape))
        return _completed(list(output_lists), [*inputs])

    def send(self, tensors, dst: int, tag: int = 0):
        self._served("send", tensors)
        return _PendingWork([self.comm.isend(t, dst, tag) for t in tensors], tensors)

    def recv(self, tensors, src: int, tag: int = 0):
        self._served("recv", tensors)
        return _PendingWork([self.comm.irecv(t, src, tag) for t in tensors], tensors)

    def barrier(self, opts=None):
        self.comm.barrier()
        return _completed(None, [])


def _unsupported(op: str):
    def refuse(self, *args, **kwargs):
        raise NotImplementedError(f"{op} is not implemented by the {self.getBackendName()} process group "
                                  f"(gemcore serves: all_gather_into_tensor, reduce_scatter_tensor, "
                                  f"all_gather, all_reduce, all_to_all_single, broadcast, scatter, gather, "
                                  f"reduce, send, recv, barrier)")
    refuse.__name__ = op
    return refuse


for _op in UNSUPPORTED:
    setattr(CommunicatorProcessGroup, _op, _unsupported(_op))


# ---------------------------------------------------------------------- registration
def _creator(comm_backend: str, devices: Sequence[str]):
    def create(options, backend_options=None):
        from gemcore import comms

        job = comms.current()
        name = backend_name(comm_backend)
        if job is None or job.backend != comm_backend:
            have = "none" if job is None else repr(job.backend)
            raise RuntimeError(f"process group backend {name} serves the job's {comm_backend!r} "
                               f"communicator, but the job's communicator is {have}: call "
                               f"gemcore.comms.init({comm_backend!r}) first")
        ranks = list(options.global_ranks_in_group) or list(range(options.group_size))
        if ranks == list(range(job.world_size)):
            if job.rank != options.group_rank:
                raise RuntimeError(f"{name}: torch.distributed says rank {options.group_rank}, the "
                                   f"{comm_backend} communicator says {job.rank}")
            comm = job
        else:
            comm = job.subgroup(ranks, options.store)
        if (comm.rank, comm.world_size) != (options.group_rank, options.group_size):
            raise RuntimeError(f"{name}: the sub-group communicator is rank {comm.rank} of "
                               f"{comm.world_size}, torch.distributed says {options.group_rank} of "
                               f"{options.group_size}")
        return CommunicatorProcessGroup(comm, devices)

    return create


def register(comm_backend: str, devices: Sequence[str] | None = None) -> str:
    """Register ``gemcore_<comm_backend>`` with torch.distributed (once); returns its name."""
    name = backend_name(comm_backend)
    if name in _registered:
        return name
    devices = tuple(devices or SERVED_DEVICES.get(comm_backend, ("cpu", "cuda")))
    dist.Backend.register_backend(name, _creator(comm_backend, devices), extended_api=True,
                                  devices=list(devices))
    _registered.add(name)
    return name


def init_process_group(comm: Communicator, *, timeout_s: float | None = None, prefix: str = "default_pg") -> str:
    """Make torch.distributed's default process group run on ``comm`` (the job's communicator,
    made by :func:`gemcore.comms.init`); its sub-groups run on ``comm.subgroup``. Collective.

    :param prefix: the default group's keys in the job's store (a job that makes the default group
        again after destroying it uses a fresh prefix each time).
    :return: the backend string given to :func:`torch.distributed.init_process_group`.
    """
    import datetime

    from gemcore.comms.rendezvous import job_store

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised: gemcore's process group must "
                           "be the default group (destroy the other one first)")
    name = register(comm.backend)
    store = job_store(timeout_s=timeout_s if timeout_s is not None else comm.timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s or comm.timeout_s or 3600.0)
    dist.init_process_group(name, store=dist.PrefixStore(prefix, store), rank=comm.rank,
                            world_size=comm.world_size, timeout=timeout)
    return name


def carriers(mesh) -> dict[str, str]:
    """``{mesh dimension: backend that carries it}`` of a DeviceMesh, e.g. ``{"dp_shard": "gemcore_mpi"}``."""
    out = {}
    for dim in mesh.mesh_dim_names or ():
        group = mesh[dim].get_group()
        out[dim] = _group_backend(group)
    return out


def _group_backend(group) -> str:
    if isinstance(group, CommunicatorProcessGroup):
        return group.getBackendName()
    return str(dist.get_backend(group))
