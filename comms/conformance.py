"""The collective conformance suite every backend must pass, run on every rank of a real job.

    mpirun -n 3 python -m gemcore.comms.conformance --backend mpi
    torchrun --nproc-per-node 2 -m gemcore.comms.conformance --backend torch
    mpirun -n 2 python -m gemcore.comms.conformance --backend ce --device cuda

It does not assume a world size: it loops over collectives, dtypes, shapes (empty ones included),
roots, reduce ops, uneven all-to-all splits with zero-size chunks and sub-communicators, and
checks each result against the value computed locally from every rank's (deterministic) input.
Output lines carry the rank; the first failed check raises, and ``comms.init``'s error hook aborts
the whole job so that no rank hangs. ``--fault raise|exit`` plants a failure on the last rank
(the job must end non-zero, naming the rank).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from gemcore import comms
from gemcore.comms.base import NODE_ENV, MismatchError
from gemcore.comms.hierarchy import Hierarchy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64,
          "float16": torch.float16, "uint8": torch.uint8, "bool": torch.bool}
#: dtypes the reductions are checked in (bool cannot be reduced)
REDUCE_DTYPES = ("float32", "bfloat16", "int64")


class Suite:
    """Runs the checks on one communicator; ``checks`` counts those that passed."""

    def __init__(self, comm: comms.Communicator, device: torch.device, dtypes: list[str], log) -> None:
        self.c, self.device, self.dtypes, self.log = comm, device, dtypes, log
        self.checks = 0

    # ------------------------------------------------------------------ helpers
    def value(self, rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
        """Rank ``rank``'s input: small integers (exact in bfloat16 and in sums over ranks)."""
        n = 1
        for d in shape:
            n *= d
        base = (torch.arange(n, dtype=torch.int64) * 7 + 3 * rank + salt) % 23
        if dtype == torch.bool:
            return (base % 2 == 1).reshape(shape).to(self.device)
        return base.reshape(shape).to(dtype).to(self.device)

    def expect(self, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        want = want.to(got.device)
        ok = got.shape == want.shape and got.dtype == want.dtype and got.device.type == self.device.type
        if ok and got.numel():
            if got.dtype.is_floating_point:
                tol = {torch.bfloat16: 1e-2, torch.float16: 1e-3}.get(got.dtype, 1e-6)
                ok = torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)
            else:
                ok = torch.equal(got, want)
        if not ok:
            raise AssertionError(f"{self.c.backend} {what}: got {got.dtype} {tuple(got.shape)} on "
                                 f"{got.device} {got.flatten()[:8].tolist()}, want {want.dtype} "
                                 f"{tuple(want.shape)} {want.flatten()[:8].tolist()}")
        self.checks += 1

    def raises(self, error: type, words: str, fn, what: str) -> None:
        try:
            fn()
        except error as exc:
            if words not in str(exc):
                raise AssertionError(f"{what}: {type(exc).__name__} does not name {words!r}: {exc}") from exc
            self.checks += 1
            return
        raise AssertionError(f"{what}: no {error.__name__} raised")

    # ------------------------------------------------------------------ checks
    def run(self, large: bool, hierarchy: bool = False) -> None:
        """Every check; ``hierarchy``: also the hierarchical compositions when ``c`` spans nodes
        (top-level communicators only: they split ``c`` again, and the torch backend's
        ``new_group`` must be called by every rank of the job, not only a sub-group's)."""
        c = self.c
        for name in self.dtypes:
            dt = DTYPES[name]
            self.all_gather(dt, name)
            self.all_to_all(dt, name)
            self.broadcast(dt, name)
            if name in REDUCE_DTYPES:
                self.reductions(dt, name)
        c.barrier()
        self.validation()
        if c.check and c.world_size > 1:
            self.mismatch()
        if large:
            self.large()
        if hasattr(c, "window") and self.device.type == "cuda":
            self.registered()
        if hierarchy and c.num_nodes > 1 and c.backend != "ce":  # ce composes its own (checked above)
            self.hierarchy()

    def all_gather(self, dt, name) -> None:
        c = self.c
        for shape in [(0,), (1,), (5,), (3, 4), (2, 0, 3), (2, 3, 2)]:
            got = c.all_gather(self.value(c.rank, shape, dt))
            want = torch.cat([self.value(r, shape, dt) for r in range(c.world_size)])
            self.expect(got, want, f"all_gather {name} {shape}")

    def reductions(self, dt, name) -> None:
        c, w = self.c, self.c.world_size
        ops = ["sum", "max", "min"] + (["avg"] if dt.is_floating_point else [])
        for op in ops:
            for shape in [(), (0,), (7,), (3, 5)]:
                mine = self.value(c.rank, shape, dt, salt=1)
                before = mine.clone()
                got = c.all_reduce(mine, op=op)
                self.expect(mine, before, f"all_reduce {name} {op} leaves t unchanged")
                self.expect(got, _reduce([self.value(r, shape, dt, salt=1) for r in range(w)], op, dt),
                            f"all_reduce {name} {op} {shape}")
            for rows in (1, 2):
                shape = (rows * w, 3)
                got = c.reduce_scatter(self.value(c.rank, shape, dt, salt=2), op=op)
                full = _reduce([self.value(r, shape, dt, salt=2) for r in range(w)], op, dt)
                self.expect(got, full[c.rank * rows:(c.rank + 1) * rows], f"reduce_scatter {name} {op} {shape}")
            got = c.reduce_scatter(self.value(c.rank, (0, 2), dt), op=op)
            self.expect(got, self.value(0, (0, 2), dt), f"reduce_scatter {name} {op} empty")

    def all_to_all(self, dt, name) -> None:
        c, w = self.c, self.c.world_size

        def splits(src: int) -> list[int]:  # rows src sends to each rank; zeros included
            return [(src + 2 * dst) % 3 for dst in range(w)]

        for trailing in [(), (2,), (2, 3)]:
            for give_out in (False, True):
                mine = self.value(c.rank, (sum(splits(c.rank)), *trailing), dt, salt=4)
                out_splits = [splits(src)[c.rank] for src in range(w)] if give_out else None
                got = c.all_to_all(mine, in_splits=splits(c.rank), out_splits=out_splits)
                parts = []
                for src in range(w):
                    theirs = self.value(src, (sum(splits(src)), *trailing), dt, salt=4)
                    start = sum(splits(src)[:c.rank])
                    parts.append(theirs[start:start + splits(src)[c.rank]])
                self.expect(got, torch.cat(parts), f"all_to_all {name} uneven {trailing} out_splits={give_out}")
            mine = self.value(c.rank, (2 * w, *trailing), dt, salt=5)
            got = c.all_to_all(mine)
            want = torch.cat([self.value(src, (2 * w, *trailing), dt, salt=5)[2 * c.rank:2 * c.rank + 2]
                              for src in range(w)])
            self.expect(got, want, f"all_to_all {name} even {trailing}")

    def broadcast(self, dt, name) -> None:
        c = self.c
        for src in range(c.world_size):
            for shape in [(0,), (), (5,), (2, 3)]:
                t = self.value(c.rank, shape, dt, salt=6)
                got = c.broadcast(t, src=src)
                want = self.value(src, shape, dt, salt=6)
                self.expect(t, want, f"broadcast {name} src={src} {shape} in place")
                self.expect(got, want, f"broadcast {name} src={src} {shape} returned")
            t = self.value(c.rank, (4, 3), dt, salt=7).t()  # not contiguous
            c.broadcast(t, src=src)
            self.expect(t, self.value(src, (4, 3), dt, salt=7).t(), f"broadcast {name} src={src} transposed")

    def validation(self) -> None:
        c, w = self.c, self.c.world_size
        x = self.value(c.rank, (w, 2), torch.float32)
        self.raises(ValueError, "op", lambda: c.all_reduce(x, op="prod"), "bad op")
        self.raises(ValueError, "op", lambda: c.reduce_scatter(x, op="mean"), "bad op")
        self.raises(ValueError, "avg", lambda: c.all_reduce(x.long(), op="avg"), "avg of ints")
        self.raises(ValueError, "in_splits", lambda: c.all_to_all(x, in_splits=[1] * (w + 1)), "split count")
        self.raises(ValueError, "in_splits", lambda: c.all_to_all(x, in_splits=[w + 1] + [0] * (w - 1)),
                    "split sum")
        self.raises(ValueError, "in_splits", lambda: c.all_to_all(x, in_splits=[-1] + [0] * (w - 1)),
                    "negative split")
        self.raises(ValueError, "out_splits", lambda: c.all_to_all(x, out_splits=[2] * w + [0]), "out count")
        if w > 1:
            self.raises(ValueError, "dim 0", lambda: c.reduce_scatter(self.value(0, (w + 1, 2), torch.float32)),
                        "reduce_scatter not divisible")
            self.raises(ValueError, "dim 0", lambda: c.all_to_all(self.value(0, (w + 1,), torch.float32)),
                        "all_to_all not divisible")
        self.raises(ValueError, "src", lambda: c.broadcast(x, src=w), "src out of range")
        self.raises(ValueError, "t", lambda: c.all_gather(x.sum()), "0-dim all_gather")
        self.raises(ValueError, "t", lambda: c.all_gather([1, 2]), "not a tensor")
        self.raises(ValueError, "ranks", lambda: c.split([w]), "split rank out of range")

    def mismatch(self) -> None:
        c = self.c
        dt = torch.float32 if c.rank == 0 else torch.int64
        self.raises(MismatchError, "rank", lambda: c.all_gather(self.value(c.rank, (2,), dt)), "dtype mismatch")
        shape = (2,) if c.rank == 0 else (3,)
        self.raises(MismatchError, "rank", lambda: c.all_reduce(self.value(c.rank, shape, torch.float32)),
                    "shape mismatch")
        self.raises(MismatchError, "src", lambda: c.broadcast(self.value(0, (2,), torch.float32),
                                                             src=c.rank % 2), "root mismatch")
        if c.world_size > 1:
            wrong = [1] * c.world_size  # in_splits of zeros everywhere: no rank sends any row here
            self.raises(MismatchError, "out_splits", lambda: c.all_to_all(
                self.value(0, (0,), torch.float32), in_splits=[0] * c.world_size, out_splits=wrong),
                "out_splits mismatch")
        c.barrier()

    def hierarchy(self) -> None:
        """The hierarchical compositions of comms/hierarchy.py over this backend's own
        sub-communicators (the intra-node one standing in for ce's copy-engine communicator), on
        a group spanning several (simulated) nodes: each against the value computed locally."""
        c, w = self.c, self.c.world_size
        hier = Hierarchy(c, make_intra=lambda sub: sub)
        equal = hier.layout is not None
        for name in [d for d in self.dtypes if d in ("float32", "int64")]:
            dt = DTYPES[name]
            for shape in [(0, 2), (3,), (2, 3)]:
                got = hier.all_gather(self.value(c.rank, shape, dt))
                if equal:
                    want = torch.cat([self.value(r, shape, dt) for r in range(w)])
                    self.expect(got, want, f"hierarchical all_gather {name} {shape}")
                elif got is not None:
                    raise AssertionError("hierarchical all_gather on unequal nodes did not fall back")
            for src in range(w):
                for shape in [(0,), (), (5, 2)]:
                    t = self.value(c.rank, shape, dt, salt=10)
                    hier.broadcast(t, src)
                    self.expect(t, self.value(src, shape, dt, salt=10), f"hierarchical broadcast {name} src={src} {shape}")

            def splits(src: int) -> list[int]:  # zeros included
                return [(3 * src + dst) % 4 for dst in range(w)]

            for trailing in [(), (3,)]:
                mine = self.value(c.rank, (sum(splits(c.rank)), *trailing), dt, salt=11)
                out_splits = [splits(src)[c.rank] for src in range(w)]
                got = hier.all_to_all(mine, splits(c.rank), out_splits)
                if equal and hier.layout.local_size > 1:
                    parts = []
                    for src in range(w):
                        theirs = self.value(src, (sum(splits(src)), *trailing), dt, salt=11)
                        start = sum(splits(src)[:c.rank])
                        parts.append(theirs[start:start + splits(src)[c.rank]])
                    self.expect(got, torch.cat(parts), f"hierarchical all_to_all {name} {trailing}")
                elif got is not None:
                    raise AssertionError("hierarchical all_to_all did not fall back")
        hier.finalize()
        c.barrier()

    def registered(self) -> None:
        """Zero-copy inputs that already live in the backend's registered window (ce)."""
        c = self.c
        for shape in [(3, 4), (1000, 33)]:
            x = c.window(shape, torch.float32)
            x.copy_(self.value(c.rank, shape, torch.float32, salt=8))
            got = c.all_gather(x)
            want = torch.cat([self.value(r, shape, torch.float32, salt=8) for r in range(c.world_size)])
            self.expect(got, want, f"all_gather from the window {shape}")
            x = c.window(shape, torch.bfloat16)
            x.copy_(self.value(c.rank, shape, torch.bfloat16, salt=9))
            self.expect(c.broadcast(x, src=c.world_size - 1),
                        self.value(c.world_size - 1, shape, torch.bfloat16, salt=9), f"broadcast from the window {shape}")

    def large(self) -> None:
        """64 MiB results: all_gather of float32 and all_reduce of bfloat16."""
        c, w = self.c, self.c.world_size
        rows = (64 << 20) // 4 // w // 1024
        mine = torch.full((rows, 1024), float(c.rank + 1), device=self.device)
        got = c.all_gather(mine)
        want = torch.arange(1, w + 1, dtype=torch.float32, device=self.device).repeat_interleave(rows)
        self.expect(got[:, 0], want, "all_gather 64 MiB (column 0)")
        self.expect(got[:, -1], want, "all_gather 64 MiB (last column)")
        big = torch.full(((32 << 20) // 2,), 1.0, dtype=torch.bfloat16, device=self.device)
        got = c.all_reduce(big)
        self.expect(got[::4096], torch.full_like(big[::4096], float(w)), "all_reduce 32 Mi bfloat16")


def _reduce(values: list[torch.Tensor], op: str, dt: torch.dtype) -> torch.Tensor:
    stack = torch.stack([v.double() for v in values])
    out = {"sum": stack.sum(0), "avg": stack.mean(0), "max": stack.amax(0) if stack.numel() else stack.sum(0),
           "min": stack.amin(0) if stack.numel() else stack.sum(0)}[op]
    return out.to(dt)


def check_nodes(c: comms.Communicator, nodes: int) -> None:
    """local_rank / local_size / num_nodes of ``c`` and of a split, for blocks of consecutive ranks."""
    node_of = [r * nodes // c.world_size for r in range(c.world_size)]

    def want(ranks: list[int], rank: int) -> tuple[int, int, int]:
        mates = [r for r in ranks if node_of[r] == node_of[rank]]
        return mates.index(rank), len(mates), len({node_of[r] for r in ranks})

    got = (c.local_rank, c.local_size, c.num_nodes)
    if got != want(list(range(c.world_size)), c.rank):
        raise AssertionError(f"{nodes} simulated nodes: got local {got}, want {want(list(range(c.world_size)), c.rank)}")
    evens = [r for r in range(c.world_size) if r % 2 == c.rank % 2]
    sub = c.split(evens)
    got = (sub.local_rank, sub.local_size, sub.num_nodes)
    if got != want(evens, c.rank):
        raise AssertionError(f"split {evens} on {nodes} simulated nodes: got local {got}, want {want(evens, c.rank)}")
    sub.finalize()


def run_suite(comm: comms.Communicator, device: torch.device, dtypes: list[str], large: bool, log) -> int:
    """All checks on ``comm`` and on sub-communicators split from it; returns the number passed."""
    suite = Suite(comm, device, dtypes, log)
    suite.run(large, hierarchy=True)
    total = suite.checks
    w = comm.world_size
    if w > 1:
        halves = [list(range(0, w, 2)), list(range(1, w, 2))]  # even / odd ranks (partition form)
        sub = comm.split(halves)
        want_size = len(halves[comm.rank % 2])
        if sub.world_size != want_size or sub.rank != comm.rank // 2 or sub.backend != comm.backend:
            raise AssertionError(f"split {halves}: got rank {sub.rank}/{sub.world_size} ({sub.backend})")
        inner = Suite(sub, device, dtypes[:2], log)
        inner.run(large=False)
        total += inner.checks + 1
        own = comm.split([comm.rank])  # own-group form: every rank alone
        if own.world_size != 1 or own.rank != 0:
            raise AssertionError(f"split([rank]): got rank {own.rank}/{own.world_size}")
        alone = Suite(own, device, dtypes[:1], log)
        alone.run(large=False)
        total += alone.checks + 1
        sub.finalize()
        own.finalize()
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gemcore.comms.conformance", description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="auto", help="backend name(s), comma-separated, run in turn (default: auto)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtypes", default="float32,bfloat16,int64,float16,bool",
                   help=f"comma-separated, of {', '.join(DTYPES)}")
    p.add_argument("--large", action="store_true", help="also 64 MiB tensors")
    p.add_argument("--no-check", action="store_true", help="turn the cross-rank signature check off")
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra backend option (e.g. delegate=mpi for ce)")
    p.add_argument("--fault", choices=["raise", "exit"], help="plant a failure on the last rank")
    p.add_argument("--nodes", type=int, default=0,
                   help="simulate this many nodes (blocks of consecutive ranks, via $GEMCORE_COMMS_NODE) "
                        "and check local_rank/local_size")
    args = p.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"--dtypes: unknown dtype {d!r}")
    options = dict(kv.split("=", 1) for kv in args.option)
    for backend in args.backend.split(","):
        code = _run_backend(backend, args, dtypes, options)
        if code:
            return code
    return 0


def _run_backend(backend: str, args, dtypes: list[str], options: dict) -> int:
    start = time.monotonic()
    if args.nodes:
        launch = comms.detect()
        os.environ[NODE_ENV] = f"node{launch.rank * args.nodes // launch.world_size}"
    c = comms.init(backend, timeout_s=args.timeout_s, check=not args.no_check, **options)

    def log(msg: str) -> None:
        print(f"[rank {c.rank}] {msg}", flush=True)

    device = torch.device("cpu")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA GPU here")
        device = torch.device("cuda", c.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    log(f"{c.describe()} device={device}")
    if args.nodes:
        check_nodes(c, args.nodes)
    if args.fault:
        c.barrier()
        if c.rank == c.world_size - 1:
            log(f"planting fault {args.fault!r}")
            if args.fault == "raise":
                raise RuntimeError("planted fault")
            os._exit(3)
        c.all_reduce(torch.ones(1))  # the others wait here for the failed rank
        time.sleep(60)  # never reached in a working job: the failed rank ends it
        log("fault not detected")
        return 1
    n = run_suite(c, device, dtypes, args.large, log)
    c.barrier()
    log(f"OK {c.backend} {n} checks in {time.monotonic() - start:.1f}s")
    comms.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
