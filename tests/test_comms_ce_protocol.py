"""The ce backend's copy-engine protocol, run on CPU against a simulated runtime that checks it
for data races (no GPU needed).

The real ``CopyEngineCommunicator`` code runs on threads, one per rank; only its stream
primitives (``_current``, ``_record``, ``_wait``, ``_write_flag``, ``_wait_flag``, ``_copy``,
``_follow``, ``_host_barrier``, ``_reduce``) and its buffers are replaced. The simulation records
every GPU operation each rank issues, in the global order of issue, and builds the happens-before
graph CUDA guarantees: operations of one stream in order; a stream wait on an (IPC) event follows
the most recent record of that event issued before the wait (a wait on a never-recorded event
orders nothing); a stream wait for a counter ``>= v`` follows the first write of a value ``>= v``
to that counter, whenever it is issued (before or after the wait), and a counter's writes must
themselves be ordered (else a later value could land first); host barriers order issue only,
never execution. A counter wait that no write satisfies, or a cycle in the graph, is a
deadlock. Two operations that touch overlapping bytes, at least one writing, must be ordered by
that graph, or the check reports a race. The user's own writes of inputs and reads of results,
and the reduction of reduce-scatter, are operations on the caller's stream. Random delays
between operations vary the interleaving; broken variants of the protocol must be caught, so the
check can fail.
"""
from __future__ import annotations

import collections
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
        #: (rank, counter) -> [(value, node)] in order of issue
        self.flag_writes: dict[tuple[int, str], list[tuple[int, int]]] = collections.defaultdict(list)

    def jitter(self, rank: int) -> None:
        if self.rng[rank].random() < 0.3:
            time.sleep(self.rng[rank].random() * 2e-4)

    def op(self, rank: int, stream: Stream, what: str, reads=(), writes=(), after_key=None, record=None,
           after_flag=None, flag_write=None) -> None:
        """Issue one operation; ``after_key`` names what it waits for: ``(rank, event)``, the most
        recent record of that event, or a stream name, the last operation queued on that stream
        (both read at the moment of issue). ``after_flag=(rank, counter, value)``: it waits for the
        first write of a value >= ``value`` to that counter (resolved when the run is over).
        ``flag_write=(counter, value)``: it writes this rank's counter."""
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
            self.nodes.append({"rank": rank, "what": what, "deps": deps, "after_flag": after_flag,
                               "reads": [r for r in reads if r[1] > r[0]],
                               "writes": [w for w in writes if w[1] > w[0]]})
            self.last_on_stream[stream.name] = node
            if record is not None:
                self.last_record[(rank, record)] = node
            if flag_write is not None:
                self.flag_writes[(rank, flag_write[0])].append((flag_write[1], node))

    def wait_for(self, rank: int, stream: Stream, key) -> None:
        self.op(rank, stream, f"wait {key}", after_key=key)

    def _resolve_flags(self) -> list[str]:
        """Add the counter waits' edges; returns the waits no write satisfies (deadlocks)."""
        stuck = []
        for i, node in enumerate(self.nodes):
            if node["after_flag"] is None:
                continue
            rank, counter, value = node["after_flag"]
            writes = self.flag_writes.get((rank, counter), [])
            assert all(a[0] <= b[0] for a, b in zip(writes, writes[1:])), f"counter {rank}.{counter} decreased"
            first = next((n for v, n in writes if v >= value), None)
            if first is None:
                stuck.append(f"deadlock: {node['what']} (rank {node['rank']}) is never satisfied")
            else:
                node["deps"].add(first)
        return stuck

    def _ancestors(self) -> list[int] | None:
        """Bit set of every node's ancestors, or None when the graph has a cycle (a deadlock)."""
        order, state = [], [0] * len(self.nodes)  # 0 new, 1 on the path, 2 done
        for root in range(len(self.nodes)):
            stack = [(root, iter(sorted(self.nodes[root]["deps"])))]
            if state[root]:
                continue
            state[root] = 1
            while stack:
                node, deps = stack[-1]
                d = next(deps, None)
                if d is None:
                    state[node] = 2
                    order.append(node)
                    stack.pop()
                elif state[d] == 1:
                    return None
                elif state[d] == 0:
                    state[d] = 1
                    stack.append((d, iter(sorted(self.nodes[d]["deps"]))))
        ancestors = [0] * len(self.nodes)
        for node in order:  # every node after its dependencies
            a = 0
            for d in self.nodes[node]["deps"]:
                a |= ancestors[d] | (1 << d)
            ancestors[node] = a
        return ancestors

    def races(self) -> list[str]:
        """Pairs of conflicting operations that the happens-before graph leaves unordered, and
        deadlocks (counter waits never satisfied, cycles)."""
        stuck = self._resolve_flags()
        if stuck:
            return stuck
        ancestors = self._ancestors()
        if ancestors is None:
            return ["deadlock: the happens-before graph has a cycle"]
        # a counter's writes must land in the order of issue (each after the one before it), or a
        # wait for >= v could be satisfied by a later value that lands early
        unordered = [f"counter {rank}.{counter}: write {self.nodes[b]['what']} may land before "
                     f"{self.nodes[a]['what']}"
                     for (rank, counter), writes in self.flag_writes.items()
                     for (_, a), (_, b) in zip(writes, writes[1:]) if not (ancestors[b] >> a) & 1]
        if unordered:
            return unordered
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
                if not ((ancestors[b] >> a) & 1 or (ancestors[a] >> b) & 1):
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

    def reshape(self, *shape) -> "Buffer":
        return Buffer(self.ptr, (self.numel(),), self.dtype)

    view = reshape

    def __getitem__(self, span: slice) -> "Buffer":  # 1-D slices only
        lo, hi, _ = span.indices(self.numel())
        return Buffer(self.ptr + lo * self.element_size(), (max(hi - lo, 0),), self.dtype)


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
        self._slots = 1 if sync == "barrier" else 2
        self._slot_streams = [None] * self._slots
        self._calls = 0
        self._counts = collections.defaultdict(int)
        self._capacity = WINDOW_BYTES
        self._window = self.window_base(rank)
        self._peer_windows = [self.window_base(r) for r in range(sim.world)]
        self._streams = [Stream(f"r{rank}.pull{p}") for p in range(sim.world)]
        #: the caller's streams; each call runs on the one the plan names (FSDP2 alternates streams)
        self._curs = [Stream(f"r{rank}.cur"), Stream(f"r{rank}.cur2")]
        self._cur = self._curs[0]
        self.intra_node = True
        self.one_shot_bytes = 1 << 20
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

    def _write_flag(self, stream, flag: str, value: int) -> None:
        self.sim.op(self.rank, stream, f"write {flag}={value}", flag_write=(flag, value))

    def _wait_flag(self, stream, peer: int, flag: str, value: int) -> None:
        self.sim.op(self.rank, stream, f"wait {peer}.{flag}>={value}", after_flag=(peer, flag, value))

    def _copy(self, dst: int, src: int, nbytes: int, stream) -> None:
        self.sim.op(self.rank, stream, f"copy call {self._calls} on {stream.name}",
                    reads=[(src, src + nbytes)], writes=[(dst, dst + nbytes)])

    def _peer_view(self, peer: int, slot: int, offset: int, numel: int, dtype):
        return Buffer(self._slot_ptr(self._peer_windows[peer], slot) + offset, (numel,), dtype)

    def _reduce(self, stage, out, op: str) -> None:
        rows = stage if isinstance(stage, list) else [stage]
        self.keep += [*rows, out]
        self.sim.op(self.rank, self._cur, f"reduce call {self._calls}",
                    reads=[_span(r) for r in rows], writes=[_span(out)])

    def _follow(self, stream, other) -> None:
        self.sim.wait_for(self.rank, stream, other.name)

    def _host_barrier(self) -> None:
        self.delegate._barrier_impl()

    # the user's side, on the caller's stream
    def user(self, what: str, t, write: bool) -> None:
        span = [_span(t)]
        self.sim.op(self.rank, self._cur, f"user {what} call {self._calls}",
                    writes=span if write else (), reads=() if write else span)


def _span(t) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


KINDS = ["all_gather", "broadcast", "all_to_all", "window_gather", "window_broadcast", "reduce_scatter",
         "window_reduce_scatter", "all_reduce", "gather_into", "all_reduce_in_place", "all_to_all_into",
         "gather_in_place"]


def schedule(world: int, seed: int, calls: int, kinds=KINDS, streams: int = 1) -> list[tuple]:
    """The same list of collectives for every rank, each with the caller's stream it runs on."""
    rng, pick = random.Random(seed), random.Random(seed + 1000)
    plan = []
    for _ in range(calls):
        kind = rng.choice(kinds)
        rows = rng.randint(0, 6)
        src = rng.randrange(world)
        splits = [[rng.randint(0, 3) for _ in range(world)] for _ in range(world)]
        plan.append((kind, rows, src, splits, pick.randrange(streams)))
    return plan


def run_rank(c: SimCE, plan: list[tuple]) -> None:
    w = c.world_size
    for kind, rows, src, splits, stream in plan:
        c._cur = c._curs[stream]
        # reductions: pulls (all_reduce: two-step) or in-place window reads (same on every rank)
        c.one_shot_bytes = 0 if rows % 2 else 1 << 20
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
        elif kind == "reduce_scatter":
            t = torch.empty(w * rows, 3)
            c.keep.append(t)
            c.user("writes input", t, True)
            out = c._reduce_scatter_impl(t, "sum")
        elif kind == "all_reduce":
            t = torch.empty(rows * 3 + 1)  # chunks of ceil(n / w) elements, the last ones shorter
            c.keep.append(t)
            c.user("writes input", t, True)
            out = c._all_reduce_impl(t, "avg")
        elif kind == "all_reduce_in_place":
            out = torch.empty(rows * 2 + 1)
            c.keep.append(out)
            c.user("writes input", out, True)
            c._all_reduce_into_impl(out, out, "max")
        elif kind == "all_to_all_into":
            mine = splits[c.rank]
            t = torch.empty(sum(mine), 2)
            out = torch.empty(sum(splits[p][c.rank] for p in range(w)), 2)
            c.keep += [t, out]
            c.user("writes input", t, True)
            c._all_to_all_into_impl(out, t, mine, [splits[p][c.rank] for p in range(w)])
        elif kind == "gather_in_place":  # the input is this rank's chunk of the output (FSDP2's layout)
            out = torch.empty(w * (rows + 1), 2)
            t = out[c.rank * (rows + 1):(c.rank + 1) * (rows + 1)]
            c.keep.append(out)
            c.user("writes input", t, True)
            c._all_gather_into_impl(out, t)
        elif kind == "gather_into":
            t = torch.empty(rows, 2)
            out = torch.empty(w * rows, 2)
            c.keep += [t, out]
            c.user("writes input", t, True)
            c._all_gather_into_impl(out, t)
        else:
            t = c.window((w * max(rows, 1), 4), torch.float32)
            c.user("writes window", t, True)
            if kind == "window_gather":
                out = c._all_gather_impl(t)
            elif kind == "window_reduce_scatter":
                out = c._reduce_scatter_impl(t, "max")
            else:
                c._broadcast_impl(t, src)
                out = t
        c.keep.append(out)
        c.user("reads result", out, False)


def simulate(world: int, seed: int, sync: str, calls: int = 14, cls=SimCE, kinds=KINDS,
             streams: int = 1) -> list[str]:
    sim = Sim(world, seed)
    plan = schedule(world, seed, calls, kinds, streams)
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
    assert len(sim.nodes) > 5 * calls * min(world, 2)
    return sim.races()


SYNCS = ["flags", "event", "barrier"]


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("world,seed", [(1, 5), (2, 0), (2, 1), (3, 2), (3, 3), (4, 4)])
def test_protocol_has_no_race(sync, world, seed):
    races = simulate(world, seed, sync)
    assert not races, f"{len(races)} races, first: {races[:3]}"


#: calls whose buffers belong to the call (no window tensor the user keeps reading): these may run
#: on any of the caller's streams
STREAM_KINDS = [k for k in KINDS if not k.startswith("window")]


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("world,seed", [(2, 10), (3, 11), (4, 12)])
def test_protocol_across_caller_streams(sync, world, seed):
    """Successive calls on two different caller streams (as FSDP2 queues all-gathers and
    reduce-scatters) are race-free too."""
    races = simulate(world, seed, sync, calls=20, kinds=STREAM_KINDS, streams=2)
    assert not races, f"{len(races)} races, first: {races[:3]}"


class OneCounter(SimCE):
    """Broken (flags): one ready and one done counter for both slots; calls on different streams
    may then land their writes out of order."""

    def _write_flag(self, stream, flag: str, value: int) -> None:
        super()._write_flag(stream, flag[:-1], value)

    def _wait_flag(self, stream, peer: int, flag: str, value: int) -> None:
        super()._wait_flag(stream, peer, flag[:-1], value)


def test_the_check_catches_shared_counters_across_streams():
    assert any(simulate(3, seed, "flags", calls=20, cls=OneCounter, kinds=STREAM_KINDS, streams=2)
               for seed in range(3))


class NoOwnDoneWait(SimCE):
    """Broken: before rewriting a slot, waits for the peers' reads only, not for this rank's own
    copy out of it (queued on another caller stream)."""

    def _wait_flag(self, stream, peer: int, flag: str, value: int) -> None:
        if not (flag.startswith("done") and peer == self.rank):
            super()._wait_flag(stream, peer, flag, value)

    def _wait(self, stream, peer: int, event: str) -> None:
        if not (event.startswith("done") and peer == self.rank):
            super()._wait(stream, peer, event)


@pytest.mark.parametrize("sync", SYNCS)
def test_the_check_catches_a_missing_own_wait_across_streams(sync):
    assert any(simulate(3, seed, sync, calls=20, cls=NoOwnDoneWait, kinds=STREAM_KINDS, streams=2)
               for seed in range(4)), sync


class NoDoneWait(SimCE):
    """Broken: never waits for the peers' reads before rewriting the window."""

    def _wait(self, stream, peer: int, event: str) -> None:
        if not event.startswith("done"):
            super()._wait(stream, peer, event)

    def _wait_flag(self, stream, peer: int, flag: str, value: int) -> None:
        if not flag.startswith("done"):
            super()._wait_flag(stream, peer, flag, value)


class NoReadyWait(SimCE):
    """Broken: pulls without waiting for the peer's staging copy."""

    def _wait(self, stream, peer: int, event: str) -> None:
        if not event.startswith("ready"):
            super()._wait(stream, peer, event)

    def _wait_flag(self, stream, peer: int, flag: str, value: int) -> None:
        if not flag.startswith("ready"):
            super()._wait_flag(stream, peer, flag, value)


class DoneOneUseEarly(SimCE):
    """Broken (flags): waits for the reads of the slot's use before its last one."""

    def _wait_flag(self, stream, peer: int, flag: str, value: int) -> None:
        super()._wait_flag(stream, peer, flag, value - self._slots if flag.startswith("done") else value)


class ReadyTooEarly(SimCE):
    """Broken (flags): signals ready before the input is staged in the window."""

    def _copy(self, dst: int, src: int, nbytes: int, stream) -> None:
        if stream is self._cur:  # the staging copy: signal first, then copy
            self._write_flag(stream, f"ready{(self._calls - 1) % self._slots}", self._calls)
        super()._copy(dst, src, nbytes, stream)


class WaitsForTheFuture(SimCE):
    """Broken (flags): waits for a ready value nobody writes (a hang the check must report)."""

    def _wait_flag(self, stream, peer: int, flag: str, value: int) -> None:
        super()._wait_flag(stream, peer, flag, value + 100 if flag.startswith("ready") else value)


class NoJoin(SimCE):
    """Broken: the caller's stream does not wait for the pull streams."""

    def _follow(self, stream, other) -> None:
        if stream not in self._curs:
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


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("broken", [NoDoneWait, NoReadyWait, NoJoin])
def test_the_check_catches_a_broken_protocol(sync, broken):
    assert any(simulate(3, seed, sync, cls=broken) for seed in (7, 8)), f"{broken.__name__} ({sync}) passed"


@pytest.mark.parametrize("sync,broken", [("event", OneSlot), ("event", WindowNoWait), ("flags", WindowNoWait)])
def test_the_check_catches_a_broken_two_slot_protocol(sync, broken):
    """These races depend on the interleaving; one of three seeds is enough."""
    assert any(simulate(3, seed, sync, calls=20, cls=broken) for seed in range(3)), broken.__name__


def test_flags_with_one_slot_are_race_free():
    """The counters say which call a peer finished, so one slot is enough (with less overlap);
    the event protocol needs two (OneSlot above)."""
    for seed in range(3):
        assert not simulate(3, seed, "flags", calls=20, cls=OneSlot)


@pytest.mark.parametrize("broken", [DoneOneUseEarly, ReadyTooEarly])
def test_the_check_catches_a_broken_flag_protocol(broken):
    assert any(simulate(3, seed, "flags", calls=20, cls=broken) for seed in range(3)), broken.__name__


def test_the_check_reports_a_wait_nobody_satisfies():
    found = simulate(2, 0, "flags", cls=WaitsForTheFuture)
    assert found and found[0].startswith("deadlock"), found[:2]


def test_sync_must_be_known():
    with pytest.raises(ValueError, match="sync"):
        CopyEngineCommunicator(sync="spin")


@pytest.mark.parametrize("value", [-1, "many", None])
def test_one_shot_bytes_must_be_a_byte_count(value):
    with pytest.raises(ValueError, match=f"one_shot_bytes must be a byte count >= 0, got {value!r}"):
        CopyEngineCommunicator(one_shot_bytes=value)


def test_all_reduce_into_window_memory_is_refused():
    """The peers read a rank's window while its all_reduce writes the result: a window tensor as
    the output is an error naming the argument, not a race."""
    c = SimCE(Sim(2, 0), 0, "flags")
    t = c.window((8,), torch.float32)
    with pytest.raises(ValueError, match="all_reduce: out is window memory"):
        c._all_reduce_into_impl(t, t, "sum")


class DirectReadOffStream(SimCE):
    """Broken: the in-place reduction of the peers' windows runs on a side stream that *done* does
    not wait for, so a peer may restage its slot while it is read."""

    def _reduce(self, stage, out, op: str) -> None:
        if not isinstance(stage, list):
            return super()._reduce(stage, out, op)
        side = self._streams[self.rank]
        self._follow(side, self._cur)
        self.keep += [*stage, out]
        self.sim.op(self.rank, side, f"reduce call {self._calls} off stream",
                    reads=[_span(r) for r in stage], writes=[_span(out)])


def test_the_check_catches_window_reads_after_done():
    kinds = ["reduce_scatter", "all_reduce", "all_gather"]
    assert any(simulate(3, seed, "flags", calls=20, cls=DirectReadOffStream, kinds=kinds) for seed in range(3))


class CountsWaits(SimCE):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.own_done_waits = 0

    def _wait_flag(self, stream, peer: int, flag: str, value: int) -> None:
        self.own_done_waits += flag.startswith("done") and peer == self.rank
        super()._wait_flag(stream, peer, flag, value)


@pytest.mark.parametrize("streams,expected", [(1, False), (2, True)])
def test_own_done_is_waited_on_only_across_streams(streams, expected):
    """On one caller stream, stream order already orders this rank's own reads of a slot before
    its next write: no own *done* wait is queued; across two streams it is."""
    sim = Sim(2, 0)
    ranks = [CountsWaits(sim, r, "flags") for r in range(2)]
    plan = [("all_gather", 2, 0, None, (i // 2) % streams) for i in range(8)]  # a slot changes streams
    threads = [threading.Thread(target=run_rank, args=(c, plan)) for c in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not sim.races()
    assert all((c.own_done_waits > 0) == expected for c in ranks), [c.own_done_waits for c in ranks]
