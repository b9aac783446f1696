"""The Communicator interface: argument checks, cross-rank agreement, sub-communicators.

A backend subclasses :class:`Communicator` and implements the ``_*_impl`` methods. The public
methods check their arguments on this rank first (bad input raises :class:`ValueError` naming the
argument before any communication), then, when ``check`` is on, exchange a small signature of the
call (collective, dtype, shape, root, device) so that ranks that disagree all raise
:class:`MismatchError` naming the ranks instead of moving corrupted data or hanging.
Implementations receive contiguous tensors that every rank agreed on.
"""
from __future__ import annotations

import abc
import os
import socket
import sys
import zlib
from typing import Callable, Sequence

import torch

REDUCE_OPS = ("sum", "avg", "max", "min")

#: collectives in the order of their signature code (the code is exchanged between ranks)
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "send", "recv")

#: dtypes that reductions accept (others may still be gathered, scattered and broadcast)
REDUCIBLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64,
                    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_DTYPE_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
_DEVICE_TYPES = ("cpu", "cuda")

#: signature: [collective, dtype, device type, ndim, root/op, dim 0, numel of one row, dims 1..6]
_SIG_DIMS = 6
_SIG_LEN = 7 + _SIG_DIMS

DEFAULT_TIMEOUT_S = 300.0

#: overrides the host name that decides which ranks share a node (tests simulate several nodes)
NODE_ENV = "GEMCORE_COMMS_NODE"


class MismatchError(ValueError):
    """Ranks called a collective with different arguments (shape, dtype, root, op, device)."""


class CommsTimeout(RuntimeError):
    """A collective did not complete within the communicator's ``timeout_s``."""


def node_id() -> int:
    """A 63-bit id of this host (``$GEMCORE_COMMS_NODE`` overrides the host name)."""
    name = os.environ.get(NODE_ENV) or socket.gethostname()
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


class Communicator(abc.ABC):
    """One group of ranks and its collectives. Every method is collective over the group.

    Attributes: ``rank`` (this process in the group), ``world_size``, ``local_rank`` and
    ``local_size`` (this process among the group's ranks on the same node), ``backend`` (name),
    ``timeout_s`` (seconds a collective may wait for the other ranks) and ``check`` (exchange a
    signature of every call so that mismatched calls raise instead of corrupting data).
    """

    backend: str = "?"

    def __init__(self, *, timeout_s: float | None = DEFAULT_TIMEOUT_S, check: bool = True) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive or None, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self.check = bool(check)
        self.rank = 0
        self.world_size = 1
        self.local_rank = 0
        self.local_size = 1
        #: (node id, local rank on that node) of every rank of this group, by group rank
        self.peers: list[tuple[int, int]] = [(node_id(), 0)]

    # ------------------------------------------------------------------ set-up helpers
    def _set_place(self, rank: int, world_size: int, local_rank: int | None = None,
                   peers: list[tuple[int, int]] | None = None) -> None:
        """Record this rank's place; gather (node, local rank) of every rank unless ``peers`` is given.

        ``local_rank`` is the launcher's word for this process (None: number the ranks of each node
        in rank order). If the launcher's local ranks do not number each node's ranks 0..k-1 (for
        example when ``$GEMCORE_COMMS_NODE`` simulates nodes), the rank order is used instead.
        """
        self.rank, self.world_size = rank, world_size
        if peers is None:
            mine = torch.tensor([node_id(), -1 if local_rank is None else local_rank], dtype=torch.int64)
            table = self._all_gather_impl(mine).view(world_size, 2) if world_size > 1 else mine.view(1, 2)
            peers = [(int(n), int(lr)) for n, lr in table.tolist()]
            by_node: dict[int, list[int]] = {}
            for n, lr in peers:
                by_node.setdefault(n, []).append(lr)
            if any(sorted(lrs) != list(range(len(lrs))) for lrs in by_node.values()):
                peers = [(n, sum(1 for m, _ in peers[:r] if m == n)) for r, (n, _) in enumerate(peers)]
        self.peers = peers
        my_node = peers[rank][0]
        self.local_size = sum(1 for n, _ in peers if n == my_node)
        self.local_rank = peers[rank][1]

    @property
    def num_nodes(self) -> int:
        return len({n for n, _ in self.peers})

    def describe(self) -> str:
        """One line for logs."""
        return (f"{self.backend}: rank {self.rank}/{self.world_size}, local {self.local_rank}/"
                f"{self.local_size}, {self.num_nodes} node(s)")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"

    # ------------------------------------------------------------------ public collectives
    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``t`` along dim 0 in rank order.

        :param t: ``(n, ...)``, the same shape and dtype on every rank.
        :return: ``(world_size * n, ...)``, a new tensor on ``t``'s device.
        """
        _need_tensor(t, "t", min_dim=1)
        self._agree("all_gather", t)
        return self._all_gather_impl(t.contiguous())

    def reduce_scatter(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``t`` over ranks and return this rank's chunk of dim 0.

        :param t: ``(world_size * m, ...)``; dim 0 divisible by ``world_size``.
        :param op: ``"sum" | "avg" | "max" | "min"``.
        :return: ``(m, ...)``: rows ``[rank * m, (rank + 1) * m)`` of the reduction.
        """
        _need_tensor(t, "t", min_dim=1)
        _need_op(op, t)
        if t.shape[0] % self.world_size:
            raise ValueError(f"t: dim 0 ({t.shape[0]}) must be divisible by world_size ({self.world_size})")
        self._agree("reduce_scatter", t, REDUCE_OPS.index(op))
        return self._reduce_scatter_impl(t.contiguous(), op)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``t`` elementwise over ranks; returns a new tensor (``t`` is left unchanged).

        ``avg`` divides the sum by ``world_size`` (floating dtypes only).
        """
        _need_tensor(t, "t")
        _need_op(op, t)
        self._agree("all_reduce", t, REDUCE_OPS.index(op))
        return self._all_reduce_impl(t.contiguous(), op)

    def all_to_all(self, t: torch.Tensor, in_splits: Sequence[int] | None = None,
                   out_splits: Sequence[int] | None = None) -> torch.Tensor:
        """All-to-all-v along dim 0: rows ``in_splits[0]`` go to rank 0, the next ``in_splits[1]`` to
        rank 1, ...; the result holds what every rank sent here, in rank order.

        :param t: ``(sum(in_splits), ...)``; trailing shape and dtype equal on every rank.
        :param in_splits: rows sent to each rank (None: ``t.shape[0] / world_size`` each).
        :param out_splits: rows received from each rank (None: exchanged between the ranks).
        :return: ``(sum(out_splits), ...)``.
        """
        _need_tensor(t, "t", min_dim=1)
        in_splits, out_splits = self._agree_splits(t, in_splits, out_splits)
        return self._all_to_all_impl(t.contiguous(), in_splits, out_splits)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy ``t`` of rank ``src`` into ``t`` of every other rank (in place); returns ``t``."""
        _need_tensor(t, "t")
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.world_size:
            raise ValueError(f"src must be a rank in [0, {self.world_size}), got {src!r}")
        self._agree("broadcast", t, src)
        if t.is_contiguous():
            self._broadcast_impl(t, src)
        else:
            buf = t.contiguous()
            self._broadcast_impl(buf, src)
            t.copy_(buf)
        return t

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """:meth:`all_gather` written into ``out`` (``(world_size * n, ...)``, contiguous, ``t``'s
        dtype and device); returns ``out``. Backends that can write there directly skip a copy."""
        _need_tensor(t, "t", min_dim=1)
        _need_out(out, t, (self.world_size * t.shape[0], *t.shape[1:]))
        self._agree("all_gather", t)
        self._all_gather_into_impl(out, t.contiguous())
        return out

    def reduce_scatter_into(self, out: torch.Tensor, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """:meth:`reduce_scatter` written into ``out`` (``(m, ...)``, contiguous); returns ``out``."""
        _need_tensor(t, "t", min_dim=1)
        _need_op(op, t)
        if t.shape[0] % self.world_size:
            raise ValueError(f"t: dim 0 ({t.shape[0]}) must be divisible by world_size ({self.world_size})")
        _need_out(out, t, (t.shape[0] // self.world_size, *t.shape[1:]))
        self._agree("reduce_scatter", t, REDUCE_OPS.index(op))
        self._reduce_scatter_into_impl(out, t.contiguous(), op)
        return out

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> Callable[[], None]:
        """Start sending ``t`` to rank ``dst`` of this group (point to point; ``dst`` posts a matching
        receive of the same shape and dtype). Returns ``wait()``: after it, ``t`` may be reused.
        Sends and receives posted together complete in any order (pipeline schedules rely on it)."""
        _need_tensor(t, "t")
        _need_peer(dst, "dst", self.rank, self.world_size)
        return self._isend_impl(t.contiguous(), dst, int(tag))

    def irecv(self, t: torch.Tensor, src: int, tag: int = 0) -> Callable[[], None]:
        """Start receiving into ``t`` (in place) what rank ``src`` sends; returns ``wait()``."""
        _need_tensor(t, "t")
        _need_peer(src, "src", self.rank, self.world_size)
        if t.is_contiguous():
            return self._irecv_impl(t, src, int(tag))
        buf = torch.empty_like(t, memory_format=torch.contiguous_format)
        pending = self._irecv_impl(buf, src, int(tag))

        def wait() -> None:
            pending()
            t.copy_(buf)
        return wait

    def all_reduce_into(self, out: torch.Tensor, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """:meth:`all_reduce` written into ``out`` (``t``'s shape, contiguous; may be ``t`` itself
        for an in-place reduction); returns ``out``."""
        _need_tensor(t, "t")
        _need_op(op, t)
        _need_out(out, t, tuple(t.shape))
        self._agree("all_reduce", t, REDUCE_OPS.index(op))
        self._all_reduce_into_impl(out, t.contiguous(), op)
        return out

    def all_to_all_into(self, out: torch.Tensor, t: torch.Tensor, in_splits: Sequence[int] | None = None,
                        out_splits: Sequence[int] | None = None) -> torch.Tensor:
        """:meth:`all_to_all` written into ``out`` (``(sum(out_splits), ...)``, contiguous)."""
        _need_tensor(t, "t", min_dim=1)
        in_splits, out_splits = self._agree_splits(t, in_splits, out_splits)
        _need_out(out, t, (sum(out_splits), *t.shape[1:]))
        self._all_to_all_into_impl(out, t.contiguous(), in_splits, out_splits)
        return out

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        """:meth:`isend` and wait for it."""
        self.isend(t, dst, tag)()

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """:meth:`irecv` and wait for it; returns ``t``."""
        self.irecv(t, src, tag)()
        return t

    def barrier(self) -> None:
        """Return once every rank of the group has entered the barrier."""
        self._barrier_impl()

    def subgroup(self, ranks: Sequence[int], store=None) -> "Communicator":
        """A communicator of this backend over ``ranks`` (ranks of this group, in increasing order),
        collective over those ranks only: the ranks outside do not take part, as torch.distributed
        creates a sub-group's backend on its members only.

        :param store: the torch.distributed store of the new group (a backend without its own
            rendezvous, such as ``ce``'s delegate, meets there); may be None for backends that
            need none (``mpi``).
        """
        members = sorted(int(r) for r in ranks)
        if len(set(members)) != len(members) or any(not 0 <= r < self.world_size for r in members):
            raise ValueError(f"ranks must be distinct ranks in [0, {self.world_size}), got {list(ranks)!r}")
        if self.rank not in members:
            raise ValueError(f"ranks {members} must contain this rank ({self.rank})")
        return self._subgroup_impl(members, store)

    def split(self, ranks: Sequence[int] | Sequence[Sequence[int]]) -> "Communicator":
        """A sub-communicator (collective: every rank of this group calls it).

        :param ranks: the ranks of this group that form this rank's sub-group (it must contain this
            rank; every member must pass the same set), or a partition of the group as a list of
            lists (the same on every rank), e.g. ``[[0, 1], [2, 3]]`` for intra-node groups.
        :return: a communicator of the same backend whose ranks are numbered in increasing order of
            their rank here.
        """
        mine = _need_group(ranks, self.rank, self.world_size)
        row = torch.zeros(self.world_size, dtype=torch.uint8)
        row[mine] = 1
        table = (self._all_gather_impl(row).view(self.world_size, self.world_size)
                 if self.world_size > 1 else row.view(1, 1))
        groups: list[list[int]] = []
        for r in range(self.world_size):
            members = table[r].nonzero().flatten().tolist()
            if members not in groups:
                groups.append(members)
        for r in range(self.world_size):  # every member of a group must name the same group
            for p in table[r].nonzero().flatten().tolist():
                if not torch.equal(table[p], table[r]):
                    raise ValueError(f"ranks: rank {r} asked for group {table[r].nonzero().flatten().tolist()} "
                                     f"but its member {p} asked for {table[p].nonzero().flatten().tolist()}")
        index = groups.index(mine)
        return self._split_impl(groups, index)

    def finalize(self) -> None:
        """Release the backend's resources (the communicator is unusable afterwards)."""
        self._finalize_impl()

    def abort(self, code: int = 1) -> None:
        """End every process of the job now (used for unhandled errors so that no rank hangs)."""
        sys.stdout.flush()
        sys.stderr.flush()
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.COMM_WORLD.Abort(code)
        os._exit(code)

    # ------------------------------------------------------------------ agreement
    def _agree(self, collective: str, t: torch.Tensor, extra: int = 0) -> None:
        """Raise :class:`MismatchError` on every rank if the ranks' calls differ."""
        if not self.check or self.world_size == 1:
            return
        sig = _signature(collective, t, extra)
        table = self._all_gather_impl(sig).view(self.world_size, _SIG_LEN)
        compared = table.clone()
        if collective == "all_to_all":  # the rows each rank sends may differ
            compared[:, 5] = 0
        differs = (compared != compared[0]).any(dim=1).nonzero().flatten().tolist()
        if not differs:
            return
        r = differs[0]
        name0, what0 = _describe_sig(table[0].tolist())
        name_r, what_r = _describe_sig(table[r].tolist())
        raise MismatchError(f"[rank {self.rank}] {collective}: the ranks' calls differ: rank 0 called "
                            f"{name0} with {what0}, rank {r} called {name_r} with {what_r}")

    def _agree_splits(self, t: torch.Tensor, in_splits, out_splits) -> tuple[list[int], list[int]]:
        """All-to-all's checked ``(in_splits, out_splits)``; the ranks agree on the call first."""
        w = self.world_size
        in_splits = _send_splits(t, in_splits, w)
        if out_splits is not None:
            out_splits = _need_splits(out_splits, "out_splits", w)
        self._agree("all_to_all", t)
        if out_splits is None or self.check:
            told = self._exchange_splits(in_splits)
            if out_splits is not None and told != out_splits:
                raise MismatchError(f"[rank {self.rank}] out_splits={out_splits} but the ranks send "
                                    f"{told} rows here")
            out_splits = told
        return in_splits, out_splits

    def _exchange_splits(self, in_splits: list[int]) -> list[int]:
        """Rows every rank sends here, given the rows this rank sends to each rank."""
        if self.world_size == 1:
            return list(in_splits)
        mine = torch.tensor(in_splits, dtype=torch.int64)
        ones = [1] * self.world_size
        return self._all_to_all_impl(mine, ones, ones).tolist()

    # ------------------------------------------------------------------ backend hooks
    @abc.abstractmethod
    def _all_gather_impl(self, t: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def _reduce_scatter_impl(self, t: torch.Tensor, op: str) -> torch.Tensor: ...

    @abc.abstractmethod
    def _all_reduce_impl(self, t: torch.Tensor, op: str) -> torch.Tensor: ...

    @abc.abstractmethod
    def _all_to_all_impl(self, t: torch.Tensor, in_splits: list[int], out_splits: list[int]) -> torch.Tensor: ...

    @abc.abstractmethod
    def _broadcast_impl(self, t: torch.Tensor, src: int) -> None: ...

    @abc.abstractmethod
    def _barrier_impl(self) -> None: ...

    @abc.abstractmethod
    def _split_impl(self, groups: list[list[int]], index: int) -> "Communicator": ...

    def _all_gather_into_impl(self, out: torch.Tensor, t: torch.Tensor) -> None:
        out.copy_(self._all_gather_impl(t))

    def _reduce_scatter_into_impl(self, out: torch.Tensor, t: torch.Tensor, op: str) -> None:
        out.copy_(self._reduce_scatter_impl(t, op))

    def _all_reduce_into_impl(self, out: torch.Tensor, t: torch.Tensor, op: str) -> None:
        out.copy_(self._all_reduce_impl(t, op))

    def _all_to_all_into_impl(self, out: torch.Tensor, t: torch.Tensor, in_splits: list[int],
                              out_splits: list[int]) -> None:
        out.copy_(self._all_to_all_impl(t, in_splits, out_splits))

    def _isend_impl(self, t: torch.Tensor, dst: int, tag: int) -> Callable[[], None]:
        raise NotImplementedError(f"backend {self.backend!r} has no point-to-point send")

    def _irecv_impl(self, t: torch.Tensor, src: int, tag: int) -> Callable[[], None]:
        raise NotImplementedError(f"backend {self.backend!r} has no point-to-point recv")

    def _subgroup_impl(self, members: list[int], store) -> "Communicator":
        raise NotImplementedError(f"backend {self.backend!r} cannot make a sub-group on its members "
                                  f"alone (needed to serve torch.distributed sub-groups)")

    def _finalize_impl(self) -> None:
        pass

    def _sub_peers(self, members: list[int]) -> list[tuple[int, int]]:
        """(node, local rank) of ``members`` renumbered within the sub-group."""
        peers = [self.peers[r] for r in members]
        return [(n, sum(1 for m, lr2 in peers if m == n and lr2 < lr)) for n, lr in peers]


# ---------------------------------------------------------------------- argument checks
def _need_tensor(t, name: str, min_dim: int = 0) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimension(s) (collectives work along "
                         f"dim 0), got shape {tuple(t.shape)}")
    if t.dtype not in _DTYPE_CODE:
        raise ValueError(f"{name}: dtype {t.dtype} is not supported (one of {', '.join(map(str, _DTYPES))})")
    if t.device.type not in _DEVICE_TYPES:
        raise ValueError(f"{name}: device {t.device} is not supported (cpu or cuda)")


def _need_out(out, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != t.dtype or out.device != t.device:
        raise ValueError(f"out must be {t.dtype} {tuple(shape)} on {t.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")


def _need_peer(peer, name: str, rank: int, world_size: int) -> None:
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < world_size:
        raise ValueError(f"{name} must be a rank in [0, {world_size}), got {peer!r}")
    if peer == rank:
        raise ValueError(f"{name}={peer} is this rank: point-to-point needs another rank")


def _need_op(op, t: torch.Tensor) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {', '.join(map(repr, REDUCE_OPS))}, got {op!r}")
    if t.dtype not in REDUCIBLE_DTYPES:
        raise ValueError(f"t: dtype {t.dtype} cannot be reduced (op={op!r})")
    if op == "avg" and not t.dtype.is_floating_point:
        raise ValueError(f"op='avg' needs a floating-point t, got {t.dtype}")


def _need_splits(splits, name: str, world_size: int) -> list[int]:
    try:
        values = [int(s) for s in splits]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a sequence of {world_size} non-negative ints, got {splits!r}") from None
    if len(values) != world_size or any(v < 0 for v in values) or any(
            isinstance(s, float) and not float(s).is_integer() for s in splits):
        raise ValueError(f"{name} must be a sequence of {world_size} non-negative ints (one per rank), "
                         f"got {list(splits)!r}")
    return values


def _send_splits(t: torch.Tensor, in_splits, world_size: int) -> list[int]:
    """All-to-all's ``in_splits`` checked against ``t``'s rows (None: equal parts)."""
    if in_splits is None:
        if t.shape[0] % world_size:
            raise ValueError(f"t: dim 0 ({t.shape[0]}) must be divisible by world_size ({world_size}) "
                             f"when in_splits is None")
        return [t.shape[0] // world_size] * world_size
    in_splits = _need_splits(in_splits, "in_splits", world_size)
    if sum(in_splits) != t.shape[0]:
        raise ValueError(f"in_splits sums to {sum(in_splits)} but t has {t.shape[0]} rows (dim 0)")
    return in_splits


def _need_group(ranks, rank: int, world_size: int) -> list[int]:
    if isinstance(ranks, torch.Tensor):
        ranks = ranks.tolist()
    try:
        items = list(ranks)
    except TypeError:
        raise ValueError(f"ranks must be a list of ranks or a list of lists of ranks, got {ranks!r}") from None
    if items and all(isinstance(g, (list, tuple, range)) for g in items):  # a partition
        flat = [r for g in items for r in g]
        if sorted(flat) != list(range(world_size)):
            raise ValueError(f"ranks: a partition must name every rank in [0, {world_size}) exactly once, "
                             f"got {[list(g) for g in items]}")
        items = next(list(g) for g in items if rank in g)
    if not items or any(isinstance(r, bool) or not isinstance(r, int) for r in items):
        raise ValueError(f"ranks must be a non-empty list of int ranks, got {items!r}")
    if any(not 0 <= r < world_size for r in items) or len(set(items)) != len(items):
        raise ValueError(f"ranks must be distinct ranks in [0, {world_size}), got {items!r}")
    if rank not in items:
        raise ValueError(f"ranks {items} must contain this rank ({rank}): every rank calls split with "
                         f"its own group")
    return sorted(items)


def _signature(collective: str, t: torch.Tensor, extra: int) -> torch.Tensor:
    shape = list(t.shape)
    row = 1
    for d in shape[1:]:
        row *= d
    dims = (shape[1:] + [0] * _SIG_DIMS)[:_SIG_DIMS]
    values = [COLLECTIVES.index(collective), _DTYPE_CODE[t.dtype], _DEVICE_TYPES.index(t.device.type),
              t.dim(), extra, shape[0] if shape else 1, row, *dims]
    return torch.tensor(values, dtype=torch.int64)


def _describe_sig(sig: list[int]) -> tuple[str, str]:
    collective, dtype, device, ndim, extra, dim0, _, *dims = sig
    shape = tuple([dim0] + dims[: max(ndim - 1, 0)]) if ndim else ()
    what = f"{_DTYPES[dtype]} {shape} on {_DEVICE_TYPES[device]}"
    name = COLLECTIVES[collective]
    if name in ("reduce_scatter", "all_reduce"):
        what += f", op={REDUCE_OPS[extra]!r}"
    elif name == "broadcast":
        what += f", src={extra}"
    return name, what
