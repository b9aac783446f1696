"""The conformance suite through the torch.distributed API, on a process group of a gemcore backend.

    mpirun -n 3 python -m gemcore.comms.dist_conformance --backend mpi
    torchrun --nproc-per-node 2 -m gemcore.comms.dist_conformance --backend ce --device cuda

Every check calls torch.distributed (``dist.all_gather_into_tensor``, ``dist.reduce_scatter_tensor``,
functional collectives, DeviceMesh sub-groups, ...) on the default group made by
:func:`gemcore.comms.process_group.init_process_group`, and compares with the value computed
locally from every rank's deterministic input. It does not assume a world size. Output lines carry
the rank; the first failure raises and the whole job aborts.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from gemcore import comms
from gemcore.comms import process_group

DTYPES = (torch.float32, torch.bfloat16)

# torch >= 2.13 renamed the single-tensor collectives; older releases only have the old names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _value(rank: int, shape, dtype, device, salt: int = 0) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    base = (torch.arange(n, dtype=torch.int64) * 7 + 3 * rank + salt) % 23
    return base.reshape(shape).to(dtype).to(device)


class DistSuite:
    """Checks of the torch.distributed entry points training uses; ``checks`` counts passes."""

    def __init__(self, device: torch.device, log) -> None:
        self.device, self.log = device, log
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.checks = 0

    def expect(self, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        want = want.to(got.device)
        ok = got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)
        if not ok:
            raise AssertionError(f"[rank {self.rank}] {what}: got {got.flatten()[:8].tolist()} "
                                 f"{tuple(got.shape)}, want {want.flatten()[:8].tolist()} {tuple(want.shape)}")
        self.checks += 1

    def run(self) -> int:
        for dtype in DTYPES:
            for shape in [(0,), (1,), (5, 3)]:
                self.gather_scatter(shape, dtype)
                self.all_reduce(shape, dtype)
                self.broadcast(shape, dtype)
        self.coalesced()
        if self.device.type == "cuda":
            self.other_stream()
        self.all_to_all_uneven()
        self.functional()
        self.point_to_point()
        self.sub_groups()
        self.scatter_gather()
        dist.barrier()
        self.checks += 1
        return self.checks

    def gather_scatter(self, shape, dtype) -> None:
        w, d = self.world, self.device
        x = _value(self.rank, shape, dtype, d)
        out = torch.empty((w * shape[0], *shape[1:]), dtype=dtype, device=d)
        _all_gather_single(out, x)
        self.expect(out, torch.cat([_value(r, shape, dtype, d) for r in range(w)]), f"all_gather_into_tensor {dtype} {shape}")
        outs = [torch.empty(shape, dtype=dtype, device=d) for _ in range(w)]
        dist.all_gather(outs, x)
        for r in range(w):
            self.expect(outs[r], _value(r, shape, dtype, d), f"all_gather (list) {dtype} {shape}")
        big = (w * shape[0], *shape[1:])
        for op, name in [(dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "avg"), (dist.ReduceOp.MAX, "max")]:
            out = torch.empty(shape, dtype=dtype, device=d)
            _reduce_scatter_single(out, _value(self.rank, big, dtype, d), op=op)
            stack = torch.stack([_value(r, big, dtype, d).double() for r in range(w)])
            full = {"sum": stack.sum(0), "avg": stack.sum(0) / w, "max": stack.max(0).values}[name]
            want = full[self.rank * shape[0]:(self.rank + 1) * shape[0]].to(dtype)
            if name == "avg" and dtype == torch.bfloat16:
                want = (stack.sum(0).to(dtype) / w)[self.rank * shape[0]:(self.rank + 1) * shape[0]]
                got_ok = torch.allclose(out.double(), want.double(), rtol=1e-2, atol=1e-2)
                if not got_ok:
                    raise AssertionError(f"[rank {self.rank}] reduce_scatter avg bf16: {out} vs {want}")
                self.checks += 1
                continue
            self.expect(out, want, f"reduce_scatter_tensor {name} {dtype} {shape}")

    def all_reduce(self, shape, dtype) -> None:
        x = _value(self.rank, shape, dtype, self.device)
        dist.all_reduce(x)
        want = sum(_value(r, shape, torch.float64, self.device) for r in range(self.world)).to(dtype)
        self.expect(x, want, f"all_reduce {dtype} {shape}")

    def broadcast(self, shape, dtype) -> None:
        for root in range(self.world):
            x = _value(self.rank, shape, dtype, self.device, salt=5)
            dist.broadcast(x, src=root)
            self.expect(x, _value(root, shape, dtype, self.device, salt=5), f"broadcast root {root}")

    def other_stream(self) -> None:
        """An async all_gather queued on a busy side stream: ``wait()`` orders the caller's stream
        after it (reading before the side stream finishes would see the uninitialised output),
        and ``get_future()`` holds the output."""
        d, w = self.device, self.world
        x = _value(self.rank, (1 << 16,), torch.float32, d, salt=9)
        out = torch.empty((1 << 16) * w, device=d)
        side = torch.cuda.Stream(d)
        side.wait_stream(torch.cuda.current_stream(d))
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)  # about 10 ms of GPU time before the collective
            work = _all_gather_single(out, x, async_op=True)
        work.wait()
        want = torch.cat([_value(r, (1 << 16,), torch.float32, d, salt=9) for r in range(w)])
        self.expect(out, want, "all_gather_into_tensor on another stream, then wait()")
        (got,) = work.get_future().wait()
        self.expect(got, want, "get_future() of an all_gather on another stream")
        side.synchronize()
        if not work.is_completed():
            raise AssertionError(f"[rank {self.rank}] is_completed() is False after its stream finished")
        self.checks += 1

    def coalesced(self) -> None:
        from torch.distributed.distributed_c10d import _coalescing_manager

        d, w = self.device, self.world
        xs = [_value(self.rank, (4,), torch.float32, d, salt=s) for s in range(3)]
        outs = [torch.empty(4 * w, device=d) for _ in xs]
        with _coalescing_manager(async_ops=True) as cm:
            for out, x in zip(outs, xs):
                _all_gather_single(out, x)
        cm.wait()
        for s, out in enumerate(outs):
            self.expect(out, torch.cat([_value(r, (4,), torch.float32, d, salt=s) for r in range(w)]),
                        "coalesced all_gather_into_tensor")
        outs = [torch.empty(2, device=d) for _ in xs]
        with _coalescing_manager(async_ops=True) as cm:
            for out, s in zip(outs, range(3)):
                _reduce_scatter_single(out, _value(self.rank, (2 * w,), torch.float32, d, salt=s))
        cm.wait()
        for s, out in enumerate(outs):
            full = sum(_value(r, (2 * w,), torch.float64, d, salt=s) for r in range(w))
            self.expect(out, full[2 * self.rank:2 * self.rank + 2].float(), "coalesced reduce_scatter_tensor")

    def all_to_all_uneven(self) -> None:
        d, w = self.device, self.world
        # rank r sends (r + p) % 3 rows to rank p (zero-size chunks included)
        sends = [(self.rank + p) % 3 for p in range(w)]
        recvs = [(p + self.rank) % 3 for p in range(w)]
        x = _value(self.rank, (sum(sends), 2), torch.float32, d)
        out = torch.empty((sum(recvs), 2), device=d)
        dist.all_to_all_single(out, x, output_split_sizes=recvs, input_split_sizes=sends)
        want = []
        for p in range(w):
            theirs = _value(p, (sum((p + q) % 3 for q in range(w)), 2), torch.float32, d)
            start = sum((p + q) % 3 for q in range(self.rank))
            want.append(theirs[start:start + recvs[p]])
        self.expect(out, torch.cat(want), "all_to_all_single uneven")

    def functional(self) -> None:
        import torch.distributed._functional_collectives as funcol

        d, w, group = self.device, self.world, dist.group.WORLD
        x = _value(self.rank, (3,), torch.float32, d)
        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
        scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
        got = funcol.wait_tensor(gather(x, 0, group))
        self.expect(got, torch.cat([_value(r, (3,), torch.float32, d) for r in range(w)]), "functional all_gather")
        got = funcol.wait_tensor(funcol.all_reduce(x, "sum", group))
        self.expect(got, sum(_value(r, (3,), torch.float64, d) for r in range(w)).float(), "functional all_reduce")
        big = _value(self.rank, (3 * w,), torch.float32, d)
        got = funcol.wait_tensor(scatter(big, "sum", 0, group))
        full = sum(_value(r, (3 * w,), torch.float64, d) for r in range(w)).float()
        self.expect(got, full[3 * self.rank:3 * self.rank + 3], "functional reduce_scatter")

    def point_to_point(self) -> None:
        if self.world < 2:
            return
        d = self.device
        nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        x = _value(self.rank, (6,), torch.float32, d, salt=9)
        got = torch.empty(6, device=d)
        if self.rank % 2 == 0:
            dist.send(x, nxt)
            dist.recv(got, prv)
        else:
            dist.recv(got, prv)
            dist.send(x, nxt)
        self.expect(got, _value(prv, (6,), torch.float32, d, salt=9), "send/recv ring")

    def sub_groups(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        w, d = self.world, self.device
        rows = 2 if w % 2 == 0 and w > 2 else 1
        mesh = init_device_mesh(d.type, (rows, w // rows), mesh_dim_names=("outer", "inner"))
        inner = mesh["inner"].get_group()
        backend = process_group._group_backend(inner)
        if not backend.startswith(process_group.PREFIX):
            raise AssertionError(f"[rank {self.rank}] mesh dimension 'inner' runs on {backend}")
        members = dist.get_process_group_ranks(inner)
        x = _value(self.rank, (2,), torch.float32, d)
        out = torch.empty(2 * len(members), device=d)
        _all_gather_single(out, x, group=inner)
        self.expect(out, torch.cat([_value(r, (2,), torch.float32, d) for r in members]), "mesh sub-group all_gather")
        from torch.distributed.tensor import Shard, distribute_tensor

        full = torch.arange(4.0 * w, device=d).view(w, 4)
        dt = distribute_tensor(full, mesh["inner"], [Shard(0)])
        self.expect(dt.full_tensor(), full, "DTensor shard and full_tensor")

    def scatter_gather(self) -> None:
        d, w = self.device, self.world
        out = torch.empty(3, device=d)
        pieces = [_value(r, (3,), torch.float32, d, salt=2) for r in range(w)] if self.rank == 0 else None
        dist.scatter(out, pieces, src=0)
        self.expect(out, _value(self.rank, (3,), torch.float32, d, salt=2), "scatter")
        outs = [torch.empty(3, device=d) for _ in range(w)] if self.rank == 0 else None
        dist.gather(_value(self.rank, (3,), torch.float32, d, salt=4), outs, dst=0)
        if self.rank == 0:
            for r in range(w):
                self.expect(outs[r], _value(r, (3,), torch.float32, d, salt=4), "gather")


def _plant(fault: str, rank: int, world: int, device: torch.device) -> None:
    import os
    import time

    last = rank == world - 1
    if last:
        print(f"[rank {rank}] planting fault {fault!r}", flush=True)
    if fault == "raise" and last:
        raise RuntimeError("planted fault")
    if fault == "exit" and last:
        os._exit(3)
    if fault == "mismatch":
        n = 3 if last else 2
        out = torch.empty(n * world, device=device)
        _all_gather_single(out, torch.ones(n, device=device))
    else:
        x = torch.ones(4, device=device)
        for _ in range(1000):  # the healthy ranks keep calling collectives: they must not hang
            dist.all_reduce(x)
            time.sleep(0.01)
    print(f"[rank {rank}] fault not detected", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gemcore.comms.dist_conformance")
    parser.add_argument("--backend", default="mpi")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--fault", choices=("raise", "exit", "mismatch"),
                        help="plant a failure on the last rank after the suite: it raises, dies, or "
                             "calls all_gather_into_tensor with another shape than the others")
    args = parser.parse_args(argv)
    comm = comms.init(args.backend, timeout_s=60)
    device = torch.device(args.device, comm.local_rank % torch.cuda.device_count()) if args.device == "cuda" \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    name = process_group.init_process_group(comm)
    checks = DistSuite(device, print).run()
    print(f"[rank {comm.rank}] {name}: {checks} torch.distributed checks passed on {device.type} "
          f"(world {comm.world_size})", flush=True)
    if args.fault:
        _plant(args.fault, comm.rank, comm.world_size, device)
    dist.destroy_process_group()
    comms.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
