"""The ce backend's copy-engine protocol, run on CPU against a simulated runtime that checks it
for data races (no GPU needed).

The real ``CopyEngineCommunicator`` code runs on threads, one per rank; only its six stream
primitives (``_current``, ``_record``, ``_wait``, ``_copy``, ``_follow``, ``_host_barrier``) and
its buffers are replaced. The simulation records every GPU operation each rank issues, in the
global order of issue, and builds the happens-before graph CUDA guarantees: operations of one
stream in order; a stream wait on an (IPC) event follows the most recent record of that event
issued before the wait (a wait on a never-recorded event orders nothing); host barriers order
issue only, never execution. Two operations that touch overlapping bytes, at least one writing,
must be ordered by that graph, or the check reports a race. The user's own writes of inputs and
reads of results are operations on the caller's stream. Random delays between operations vary
the interleaving; broken variants of the protocol must be caught, so the check can fail.
"""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from gemcore.comms.ce_backend import CopyEngineCommunicator

WINDOW_BYTES = 1 << 16


class Stream:
    def __init__(self, name: str) -> None:
        self.name = name


class Sim:
    """The shared 'GPU': issued operations and their happens-before edges."""

    def __init__(self, world: int, seed: int) -> None:
        self.world = world
        self.lock = threading.Lock()
        self.nodes: list[dict] = []
        self.last_on_stream: dict[str, int] = {}
        self.last_record: dict[tuple[int, str], int] = {}
        self.barrier = threading.Barrier(world, timeout=30)
        self.rng = [random.Random(seed * 100 + r) for r in range(world)]
        self.board: list = [None] * world

    def jitter(self, rank: int) -> None:
        if self.rng[rank].random() < 0.3:
            time.sleep(self.rng[rank].random() * 2e-4)

    def op(self, rank: int, stream: Stream, what: str, reads=(), writes=(), after_key=None, record=None) -> None:
        """Issue one operation; ``after_key`` names what it waits for: ``(rank, event)``, the most
        recent record of that event, or a stream name, the last operation queued on that stream
        (both read at the moment of issue)."""
        self.jitter(rank)
        with self.lock:
            deps = set()
            if isinstance(after_key, tuple) and after_key in self.last_record:
                deps.add(self.last_record[after_key])
            elif isinstance(after_key, str) and after_key in self.last_on_stream:
                deps.add(self.last_on_stream[after_key])
            if stream.name in self.last_on_stream:
                deps.add(self.last_on_stream[stream.name])
            node = len(self.nodes)
            self.nodes.append({"rank": rank, "what": what, "deps": deps,
                               "reads": [r for r in reads if r[1] > r[0]],
                               "writes": [w for w in writes if w[1] > w[0]]})
            self.last_on_stream[stream.name] = node
            if record is not None:
                self.last_record[(rank, record)] = node

    def wait_for(self, rank: int, stream: Stream, key) -> None:
        self.op(rank, stream, f"wait {key}", after_key=key)

    def races(self) -> list[str]:
        """Pairs of conflicting operations that the happens-before graph leaves unordered."""
        ancestors: list[int] = []
        for node in self.nodes:  # nodes are in issue order, every edge points back: a topological order
            a = 0
            for d in node["deps"]:
                a |= ancestors[d] | (1 << d)
            ancestors.append(a)
        touched = []  # (lo, hi, node, writes?)
        for i, node in enumerate(self.nodes):
            touched += [(lo, hi, i, False) for lo, hi in node["reads"]]
            touched += [(lo, hi, i, True) for lo, hi in node["writes"]]
        touched.sort()
        found = []
        for k, (lo, hi, i, wi) in enumerate(touched):
            for lo2, hi2, j, wj in touched[k + 1:]:
                if lo2 >= hi:
                    break
                if i == j or not (wi or wj):
                    continue
                a, b = min(i, j), max(i, j)
                if not (ancestors[b] >> a) & 1:
                    found.append(f"{self.nodes[a]['what']} (rank {self.nodes[a]['rank']}) vs "
                                 f"{self.nodes[b]['what']} (rank {self.nodes[b]['rank']})")
        return found


class Buffer:
    """Stands for a tensor in simulated device memory (window slots)."""

    is_cuda = False  # the intra-node path either way (SimCE is one node)

    def __init__(self, ptr: int, shape, dtype: torch.dtype) -> None:
        self.ptr, self.shape, self.dtype = ptr, tuple(shape), dtype

    def data_ptr(self) -> int:
        return self.ptr

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def new_empty(self, shape) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype)


class SimDelegate:
    backend = "sim"

    def __init__(self, sim: Sim, rank: int) -> None:
        self.sim, self.rank = sim, rank

    def _barrier_impl(self) -> None:
        self.sim.jitter(self.rank)
        self.sim.barrier.wait()

    def _all_gather_impl(self, t: torch.Tensor) -> torch.Tensor:
        self.sim.board[self.rank] = t.clone()
        self.sim.barrier.wait()
        out = torch.cat(list(self.sim.board))
        self.sim.barrier.wait()
        return out


class SimCE(CopyEngineCommunicator):
    """The real protocol with simulated primitives (no CUDA, no CuPy)."""

    def __init__(self, sim: Sim, rank: int, sync: str) -> None:  # noqa: D107 (bypasses CUDA set-up)
        self.sim, self.rank, self.world_size, self.sync = sim, rank, sim.world, sync
        self.check, self.timeout_s = False, None
        self.local_rank, self.local_size, self.peers = rank, sim.world, [(0, r) for r in range(sim.world)]
        self.delegate = SimDelegate(sim, rank)
        self._slots = 2 if sync == "event" else 1
        self._calls = 0
        self._capacity = WINDOW_BYTES
        self._window = self.window_base(rank)
        self._peer_windows = [self.window_base(r) for r in range(sim.world)]
        self._streams = [Stream(f"r{rank}.pull{p}") for p in range(sim.world)]
        self._cur = Stream(f"r{rank}.cur")
        self.intra_node = True
        self.keep: list = []  # keep every host tensor alive: no address reuse between threads

    @staticmethod
    def window_base(rank: int) -> int:
        return (rank + 1) << 40  # far from any real address

    def _grow(self, nbytes: int) -> None:
        assert nbytes <= self._capacity, "the simulation does not grow windows"

    def _use_ce(self, t) -> bool:
        return True

    def _window_tensor(self, ptr: int, nbytes: int, shape, dtype):
        return Buffer(ptr, shape, dtype)

    def _current(self):
        return self._cur

    def _record(self, event: str, stream) -> None:
        self.sim.op(self.rank, stream, f"record {event} call {self._calls}", record=event)

    def _wait(self, stream, peer: int, event: str) -> None:
        self.sim.wait_for(self.rank, stream, (peer, event))

    def _copy(self, dst: int, src: int, nbytes: int, stream) -> None:
        self.sim.op(self.rank, stream, f"copy call {self._calls} on {stream.name}",
                    reads=[(src, src + nbytes)], writes=[(dst, dst + nbytes)])

    def _follow(self, stream, other) -> None:
        self.sim.wait_for(self.rank, stream, other.name)

    def _host_barrier(self) -> None:
        self.delegate._barrier_impl()

    # the user's side, on the caller's stream
    def user(self, what: str, t, write: bool) -> None:
        span = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())]
        self.sim.op(self.rank, self._cur, f"user {what} call {self._calls}",
                    writes=span if write else (), reads=() if write else span)


def schedule(world: int, seed: int, calls: int) -> list[tuple]:
    """The same list of collectives for every rank."""
    rng = random.Random(seed)
    plan = []
    for _ in range(calls):
        kind = rng.choice(["all_gather", "broadcast", "all_to_all", "window_gather", "window_broadcast"])
        rows = rng.randint(0, 6)
        src = rng.randrange(world)
        splits = [[rng.randint(0, 3) for _ in range(world)] for _ in range(world)]
        plan.append((kind, rows, src, splits))
    return plan


def run_rank(c: SimCE, plan: list[tuple]) -> None:
    w = c.world_size
    for kind, rows, src, splits in plan:
        if kind == "all_gather":
            t = torch.empty(rows, 4)
            c.keep.append(t)
            c.user("writes input", t, True)
            out = c._all_gather_impl(t)
        elif kind == "all_to_all":
            mine = splits[c.rank]
            t = torch.empty(sum(mine), 2)
            c.keep.append(t)
            c.user("writes input", t, True)
            out = c._all_to_all_impl(t, mine, [splits[p][c.rank] for p in range(w)])
        elif kind == "broadcast":
            out = torch.empty(rows, 3)
            c.user("writes buffer", out, True)
            c._broadcast_impl(out, src)
        else:
            t = c.window((max(rows, 1), 4), torch.float32)
            c.user("writes window", t, True)
            if kind == "window_gather":
                out = c._all_gather_impl(t)
            else:
                c._broadcast_impl(t, src)
                out = t
        c.keep.append(out)
        c.user("reads result", out, False)


def simulate(world: int, seed: int, sync: str, calls: int = 14, cls=SimCE) -> list[str]:
    sim = Sim(world, seed)
    plan = schedule(world, seed, calls)
    ranks = [cls(sim, r, sync) for r in range(world)]
    errors: list[BaseException] = []

    def body(c: SimCE) -> None:
        try:
            run_rank(c, plan)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)
            sim.barrier.abort()

    threads = [threading.Thread(target=body, args=(c,)) for c in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    assert len(sim.nodes) > 10 * calls
    return sim.races()


@pytest.mark.parametrize("sync", ["barrier", "event"])
@pytest.mark.parametrize("world,seed", [(2, 0), (2, 1), (3, 2), (3, 3), (4, 4)])
def test_protocol_has_no_race(sync, world, seed):
    races = simulate(world, seed, sync)
    assert not races, f"{len(races)} races, first: {races[:3]}"


class NoDoneWait(SimCE):
    """Broken: never waits for the peers' reads before rewriting the window."""

    def _wait_peers(self, event: str, stream) -> None:
        if not event.startswith("done"):
            super()._wait_peers(event, stream)


class NoReadyWait(SimCE):
    """Broken: pulls without waiting for the peer's staging copy."""

    def _wait(self, stream, peer: int, event: str) -> None:
        if not event.startswith("ready"):
            super()._wait(stream, peer, event)


class NoJoin(SimCE):
    """Broken: the caller's stream does not wait for the pull streams."""

    def _follow(self, stream, other) -> None:
        if not stream.name.endswith(".cur"):
            super()._follow(stream, other)


class OneSlot(SimCE):
    """Broken: sync="event" (one barrier) with a single window slot."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._slots = 1


class WindowNoWait(SimCE):
    """Broken: window() hands out a slot that peers may still be reading."""

    def window(self, shape, dtype):
        return Buffer(self._slot_ptr(self._window, self._calls % self._slots), shape, dtype)


@pytest.mark.parametrize("sync", ["barrier", "event"])
@pytest.mark.parametrize("broken", [NoDoneWait, NoReadyWait, NoJoin])
def test_the_check_catches_a_broken_protocol(sync, broken):
    assert simulate(3, 7, sync, cls=broken), f"{broken.__name__} ({sync}) passed the race check"


@pytest.mark.parametrize("broken", [OneSlot, WindowNoWait])
def test_the_check_catches_a_broken_event_protocol(broken):
    """These races depend on the interleaving; one of three seeds is enough (all 8 tried did)."""
    assert any(simulate(3, seed, "event", calls=20, cls=broken) for seed in range(3)), broken.__name__


def test_sync_must_be_known():
    with pytest.raises(ValueError, match="sync"):
        CopyEngineCommunicator(sync="flags")
