"""Hierarchical collectives of the ce backend across nodes (comms/hierarchy.py), on CPU.

Node layouts are simulated: every rank is a thread, and each sub-communicator the hierarchy
splits off is a :class:`ThreadComm` over the member threads (an exchange board and a barrier per
group). The intra-node communicator, a copy-engine one on a GPU, is such a ThreadComm here too,
so these tests check the composition (layouts, leaders, splits, chunk order, fallbacks) against
the flat collective; the copy-engine step itself is covered by tests/test_comms_ce_protocol.py
(CPU race check) and tests/test_comms_ce.py (GPU).
"""
from __future__ import annotations

import random
import threading

import pytest
import torch

from gemcore.comms.base import Communicator
from gemcore.comms.ce_backend import CopyEngineCommunicator
from gemcore.comms.hierarchy import Hierarchy, broadcast_leaders, node_groups, node_layout

BLOCKS = ["a", "a", "b", "b"]
EQUAL = [
    BLOCKS,                                    # blocks (the usual launch)
    ["a", "b", "a", "b"],                      # round-robin
    ["a", "b", "b", "a"],                      # inter groups in different node orders
    ["x", "y", "z", "x", "z", "y"],            # 3 nodes of 2, mixed
    ["a", "a", "a", "b", "b", "b"],            # 2 nodes of 3
]
ONE_PER_NODE = ["a", "b", "c", "d"]
UNEQUAL = [
    ["a", "a", "b"],
    ["a", "b", "b", "b"],
    ["a", "b", "a", "c", "c", "c"],
    ["a", "b", "b", "c", "c"],
]


def _peers(nodes: list[str]) -> list[tuple[int, int]]:
    return [(hash(n) & 0xFFFF, 0) for n in nodes]


# ---------------------------------------------------------------------- layouts
def test_layout_of_blocks():
    layout = node_layout(_peers(["a", "a", "b", "b", "c", "c"]))
    assert layout.intra == ((0, 1), (2, 3), (4, 5)) and layout.inter == ((0, 2, 4), (1, 3, 5))
    assert layout.num_nodes == 3 and layout.local_size == 2
    assert [layout.inter_index(r) for r in range(6)] == [0, 1, 0, 1, 0, 1]
    assert [layout.intra_index(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    # the two-step result: [rank 0, 2, 4 | rank 1, 3, 5]
    assert layout.position == (0, 3, 1, 4, 2, 5) and not layout.in_rank_order


def test_layout_in_rank_order_with_one_rank_per_node():
    layout = node_layout(_peers(["a", "b", "c"]))
    assert layout.local_size == 1 and layout.in_rank_order


@pytest.mark.parametrize("nodes", [["a", "a", "b"], ["a", "a", "a"], ["a"]])
def test_no_layout_for_unequal_or_single_nodes(nodes):
    assert node_layout(_peers(nodes)) is None


def test_layout_needs_peers():
    with pytest.raises(ValueError, match="peers"):
        node_layout([])
    with pytest.raises(ValueError, match="peers"):
        node_groups([])


def test_node_groups_of_unequal_nodes():
    assert node_groups(_peers(["a", "b", "a", "c", "c", "c"])) == ((0, 2), (1,), (3, 4, 5))


def test_broadcast_leaders():
    groups = node_groups(_peers(["a", "b", "a", "c", "c", "c"]))  # (0, 2), (1,), (3, 4, 5)
    assert broadcast_leaders(groups, 0) == (0, 1, 3)
    assert broadcast_leaders(groups, 2) == (1, 2, 4)  # place 1; node (1,) has none: its first rank
    assert broadcast_leaders(groups, 5) == (0, 1, 5)  # place 2 exists only on the root's node
    assert broadcast_leaders(groups, 1) == (0, 1, 3)


# ---------------------------------------------------------------------- simulated ranks
class _Group:
    """The members' exchange board: every member posts, all read, then the board is free again."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=10)
        self.board: list = [None] * size

    def exchange(self, index: int, item):
        self.board[index] = item
        self.barrier.wait()
        items = list(self.board)
        self.barrier.wait()
        return items


class World:
    """Threads standing for the ranks of a job on simulated nodes; ``log`` records which group
    moved floating-point data with which collective (the data path, not the control path)."""

    def __init__(self, nodes: list[str]) -> None:
        self.nodes = nodes
        self.lock = threading.Lock()
        self.groups: dict[tuple[int, ...], _Group] = {}
        self.log: list[tuple[tuple[int, ...], str]] = []

    def group(self, members: tuple[int, ...]) -> _Group:
        with self.lock:
            return self.groups.setdefault(members, _Group(len(members)))

    def abort(self) -> None:
        with self.lock:
            for g in self.groups.values():
                g.barrier.abort()

    def run(self, fn) -> list:
        """``fn(rank, comm)`` on every rank (comm: the whole job); the results by rank."""
        world = len(self.nodes)
        results, errors = [None] * world, []

        def main(rank: int) -> None:
            try:
                results[rank] = fn(rank, ThreadComm(self, tuple(range(world)), rank))
            except BaseException as exc:  # noqa: BLE001 (reported below)
                errors.append((rank, exc))
                self.abort()

        threads = [threading.Thread(target=main, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            errors.sort(key=lambda e: isinstance(e[1], threading.BrokenBarrierError))
            rank, exc = errors[0]
            raise AssertionError(f"rank {rank} of layout {self.nodes}: {exc!r}") from exc
        return results


class ThreadComm(Communicator):
    """A group of simulated ranks (``members``: their ranks in the job)."""

    backend = "thread"

    def __init__(self, world: World, members: tuple[int, ...], rank: int) -> None:
        super().__init__(timeout_s=None, check=False)
        self.world, self.members, self.board = world, members, world.group(members)
        names = [world.nodes[m] for m in members]
        peers = [(ord(n[0]), names[:r].count(n)) for r, n in enumerate(names)]
        self._set_place(rank, len(members), peers=peers)

    def _swap(self, what: str, item, t: torch.Tensor):
        if t.is_floating_point():
            with self.world.lock:
                self.world.log.append((self.members, what))
        return self.board.exchange(self.rank, item)

    def _all_gather_impl(self, t):
        return torch.cat(self._swap("all_gather", t.clone(), t))

    def _all_to_all_impl(self, t, in_splits, out_splits):
        parts = self._swap("all_to_all", [p.clone() for p in t.split(in_splits)], t)
        got = [parts[p][self.rank] for p in range(self.world_size)]
        assert [g.shape[0] for g in got] == list(out_splits), "out_splits disagree with the senders"
        return torch.cat(got)

    def _broadcast_impl(self, t, src):
        items = self._swap("broadcast", t.clone() if self.rank == src else None, t)
        t.copy_(items[src])

    def _barrier_impl(self):
        self.board.exchange(self.rank, None)

    def _split_impl(self, groups, index):
        members = tuple(self.members[r] for r in groups[index])
        return ThreadComm(self.world, members, groups[index].index(self.rank))

    def _all_reduce_impl(self, t, op):
        raise NotImplementedError

    def _reduce_scatter_impl(self, t, op):
        raise NotImplementedError


def _hierarchy(comm: ThreadComm) -> Hierarchy:
    return Hierarchy(comm, make_intra=lambda sub: sub)


def _value(rank: int, shape, salt: int = 0) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float32) + 1000 * rank + salt).reshape(shape)


def _splits(world: int, seed: int) -> list[list[int]]:
    """``splits[src][dst]``: rows src sends to dst, zeros included."""
    rng = random.Random(seed)
    return [[rng.choice([0, 0, 1, 2, 5]) for _ in range(world)] for _ in range(world)]


def _flat_all_to_all(splits: list[list[int]], rank: int, trailing) -> torch.Tensor:
    parts = []
    for src, row in enumerate(splits):
        theirs = _value(src, (sum(row), *trailing))
        start = sum(row[:rank])
        parts.append(theirs[start:start + row[rank]])
    return torch.cat(parts)


# ---------------------------------------------------------------------- all_gather
@pytest.mark.parametrize("nodes", EQUAL + [ONE_PER_NODE])
@pytest.mark.parametrize("shape", [(2, 3), (0, 2), (1,)])
def test_hierarchical_all_gather_equals_the_flat_one(nodes, shape):
    world = World(nodes)
    got = world.run(lambda rank, comm: _hierarchy(comm).all_gather(_value(rank, shape)))
    flat = torch.cat([_value(r, shape) for r in range(len(nodes))])
    for rank, out in enumerate(got):
        assert torch.equal(out, flat), f"rank {rank} of layout {nodes}"


@pytest.mark.parametrize("nodes", UNEQUAL)
def test_all_gather_of_unequal_nodes_is_left_to_the_delegate(nodes):
    assert World(nodes).run(lambda rank, comm: _hierarchy(comm).all_gather(_value(rank, (2,)))) == \
        [None] * len(nodes)


# ---------------------------------------------------------------------- broadcast
@pytest.mark.parametrize("nodes", EQUAL + [ONE_PER_NODE] + UNEQUAL)
def test_hierarchical_broadcast_from_every_root(nodes):
    world = World(nodes)
    shapes = [(2, 3), (0, 2), ()]

    def job(rank, comm):
        hier = _hierarchy(comm)
        got = []
        for src in range(len(nodes)):
            for shape in shapes:
                t = _value(rank, shape, salt=7 * src)
                hier.broadcast(t, src)
                got.append(t)
        hier.finalize()
        return got

    results = world.run(job)
    want = [_value(src, shape, salt=7 * src) for src in range(len(nodes)) for shape in shapes]
    for rank, got in enumerate(results):
        for g, w in zip(got, want):
            assert torch.equal(g, w), f"rank {rank} of layout {nodes}"
    # one delegate broadcast across nodes per call (among the leaders), the rest within nodes
    num_nodes = len(node_groups(_peers(nodes)))
    crossing = [m for m, what in world.log if what == "broadcast" and len({nodes[r] for r in m}) > 1]
    assert len(crossing) == len(nodes) * len(shapes) * num_nodes  # each leader logs its own call
    assert all(len(m) == num_nodes for m in crossing)


# ---------------------------------------------------------------------- all_to_all
@pytest.mark.parametrize("nodes", EQUAL)
@pytest.mark.parametrize("trailing", [(), (2, 3)])
def test_hierarchical_all_to_all_equals_the_flat_one(nodes, trailing):
    world = World(nodes)
    w = len(nodes)
    cases = [_splits(w, seed) for seed in range(4)] + [[[0] * w for _ in range(w)],  # all empty
                                                        [[3] * w for _ in range(w)]]  # even

    def job(rank, comm):
        hier = _hierarchy(comm)
        got = []
        for splits in cases:
            out_splits = [row[rank] for row in splits]
            got.append(hier.all_to_all(_value(rank, (sum(splits[rank]), *trailing)), splits[rank], out_splits))
        return got

    for rank, got in enumerate(world.run(job)):
        for case, (g, splits) in enumerate(zip(got, cases)):
            want = _flat_all_to_all(splits, rank, trailing)
            assert g.shape == want.shape and torch.equal(g, want), f"rank {rank}, case {case}, layout {nodes}"
    # the data crossed nodes only within inter groups (ranks at one place), never the whole job
    layout = node_layout(_peers(nodes))
    moved = {m for m, what in world.log if what == "all_to_all"}
    assert moved == set(layout.intra) | set(layout.inter)


@pytest.mark.parametrize("nodes", UNEQUAL + [ONE_PER_NODE])
def test_all_to_all_falls_back_for_unequal_nodes_or_one_rank_each(nodes):
    w = len(nodes)
    got = World(nodes).run(lambda rank, comm: _hierarchy(comm).all_to_all(_value(rank, (w,)), [1] * w, [1] * w))
    assert got == [None] * w


# ---------------------------------------------------------------------- the ce backend's dispatch
class CpuCE(CopyEngineCommunicator):
    """The ce communicator's dispatch on CPU: floating tensors stand for CUDA ones (the control
    tensors, signatures and splits, are int64 in the real code too) and the intra-node
    communicator is the delegate's own sub-group instead of a copy-engine one."""

    def __init__(self, delegate: ThreadComm) -> None:
        Communicator.__init__(self, timeout_s=None, check=True)
        self.delegate, self.sync, self._slots, self._calls = delegate, "barrier", 1, 0
        self._set_place(delegate.rank, delegate.world_size, peers=list(delegate.peers))
        self.intra_node = self.num_nodes == 1
        self._hier, self._window, self._events, self._peer_events = None, 0, {}, {}
        self._thread_events = []
        self._flags, self._peer_flags = 0, []

    def _spans_nodes(self, t) -> bool:
        return not self.intra_node and t.is_floating_point()

    def _use_ce(self, t) -> bool:
        return False

    def _served(self, t, op: str) -> None:  # CPU tensors stand for CUDA ones
        pass

    def _make_intra(self, sub):
        return sub


@pytest.mark.parametrize("nodes", [BLOCKS, ["a", "b", "a", "b", "b"], ONE_PER_NODE])
def test_ce_dispatch_through_the_public_api(nodes):
    """c.all_gather / all_to_all / broadcast with the argument checks on: hierarchical where the
    layout allows it, the flat delegate otherwise (seen in which groups moved the data)."""
    world = World(nodes)
    w = len(nodes)
    splits = _splits(w, seed=11)

    def job(rank, comm):
        c = CpuCE(comm)
        gathered = c.all_gather(_value(rank, (2,)))
        exchanged = c.all_to_all(_value(rank, (sum(splits[rank]), 3)), in_splits=splits[rank])
        bcast = [c.broadcast(_value(rank, (4,), salt=src), src=src).clone() for src in range(w)]
        c.finalize()
        return gathered, exchanged, bcast

    for rank, (gathered, exchanged, bcast) in enumerate(world.run(job)):
        assert torch.equal(gathered, torch.cat([_value(r, (2,)) for r in range(w)]))
        assert torch.equal(exchanged, _flat_all_to_all(splits, rank, (3,)))
        for src, got in enumerate(bcast):
            assert torch.equal(got, _value(src, (4,), salt=src))
    whole = tuple(range(w))
    flat_ops = {what for m, what in world.log if m == whole}
    layout = node_layout(_peers(nodes))
    if layout is None:  # unequal nodes: all_gather and all_to_all go to the delegate whole
        assert flat_ops == {"all_gather", "all_to_all"}
    elif layout.local_size == 1:  # one rank per node: all_to_all flat; inter groups = the whole job
        assert "all_to_all" in flat_ops
    else:
        assert flat_ops == set()
