"""``gem bench comms`` through torch.distributed, the copy-bandwidth anchor and the SM-free profile.

* :func:`make_dist_case`: the collective called as training calls it, ``dist.all_gather_into_tensor``
  / ``dist.reduce_scatter_tensor`` / ... on the default group of the ``gemcore_<backend>``
  process group (``--api dist``).
* :func:`copy_gbs`: the anchor, a same-device device-to-device ``cudaMemcpyAsync`` of the same
  size on one process while the others wait, timed with CUDA events (GB/s, 1e9 B/s).
* :func:`sm_free_profile` (``--sm-free``): the collectives run under ``torch.profiler`` with the
  ``ce`` communicator's exchanges and reductions marked (``record_function``); every GPU activity
  launched inside a mark is attributed to it through the trace's correlation ids. Pass: no kernel
  inside an exchange (only memcpy entries) and exactly the kernels the communicator counted inside
  its reductions. ``--fsdp`` profiles two steps of a small FSDP2 model on the group instead.
"""
from __future__ import annotations

import collections
import json
import os
import tempfile
from typing import Callable

import torch

#: record_function names of the ce communicator's two kinds of GPU work
EXCHANGE, REDUCE = "gemcore_ce.exchange", "gemcore_ce.reduce"
_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def make_dist_case(op: str, count: int, n: int, rank: int, dtype: torch.dtype, device: torch.device,
                   in_place: bool = False) -> tuple[Callable[[], object], Callable[[], bool]]:
    """(call, check) of ``op`` on ``count`` elements of the full buffer through torch.distributed;
    ``in_place``: all_gather's input is this rank's chunk of its output (FSDP2's layout)."""
    import torch.distributed as dist

    # torch >= 2.13 renamed the single-tensor collectives; older releases only have the old names
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    value = float(rank + 1)
    ranks = torch.arange(1, n + 1, dtype=dtype, device=device)
    total = n * (n + 1) // 2
    if op == "all_gather":
        out = torch.empty(count, dtype=dtype, device=device)
        x = out.narrow(0, rank * (count // n), count // n) if in_place else torch.empty(count // n, dtype=dtype,
                                                                                      device=device)
        x.fill_(value)
        call = lambda: gather(out, x)  # noqa: E731
        check = lambda: call() or bool((out[:: max(1, count // n)] == ranks).all())  # noqa: E731
    elif op == "reduce_scatter":
        x = torch.full((count,), value, dtype=dtype, device=device)
        out = torch.empty(count // n, dtype=dtype, device=device)
        call = lambda: scatter(out, x)  # noqa: E731
        check = lambda: call() or bool((out == total).all())  # noqa: E731
    elif op == "all_reduce":
        x = torch.full((count,), value, dtype=dtype, device=device)

        def call():
            x.fill_(value)  # in place: refill so repeated sums stay finite
            dist.all_reduce(x)

        check = lambda: call() or bool((x == total).all())  # noqa: E731
    elif op == "all_to_all":
        x = torch.full((count,), value, dtype=dtype, device=device)
        out = torch.empty(count, dtype=dtype, device=device)
        call = lambda: dist.all_to_all_single(out, x)  # noqa: E731
        check = lambda: call() or bool((out[:: max(1, count // n)] == ranks).all())  # noqa: E731
    else:
        x = torch.full((count,), value, dtype=dtype, device=device)
        call = lambda: dist.broadcast(x, src=0)  # noqa: E731
        check = lambda: x.fill_(value) is None or call() or bool((x == 1).all())  # noqa: E731
    return call, check


def copy_gbs(nbytes: int, device: torch.device, iters: int = 10) -> float:
    """GB/s of a same-device ``cudaMemcpyAsync`` of ``nbytes`` (mean over ``iters`` after one)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return nbytes * iters / (start.elapsed_time(end) / 1e3) / 1e9


# ---------------------------------------------------------------------- SM-free profile
def mark(comm) -> None:
    """Wrap ``comm``'s exchanges and reductions in ``record_function`` marks (ce only)."""
    exchange, reduce = comm._exchange, comm._reduce

    def marked_exchange(*args, **kwargs):
        with torch.profiler.record_function(EXCHANGE):
            return exchange(*args, **kwargs)

    def marked_reduce(*args, **kwargs):
        with torch.profiler.record_function(REDUCE):
            return reduce(*args, **kwargs)

    comm._exchange, comm._reduce = marked_exchange, marked_reduce


def attribute(trace: dict) -> dict[str, collections.Counter]:
    """GPU activities of a chrome trace (``torch.profiler`` export) by the mark they were launched
    in: ``{mark: Counter({"kernel": n, "gpu_memcpy": m, ...}), ..., "kernel names": Counter}``,
    plus ``"window"``: every GPU activity in the trace. A launch belongs to the innermost mark on
    the same thread whose interval holds the launch's start (on any thread of the process when
    none of its own does)."""
    events = trace.get("traceEvents", [])
    marks = collections.defaultdict(list)  # (pid, tid) -> [(start, end, name)]
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("name") in (EXCHANGE, REDUCE) and e.get("ph") == "X":
            marks[(e.get("pid"), e.get("tid"))].append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
    by_pid = collections.defaultdict(list)  # the same marks by process (if threads are named differently)
    for (pid, _), spans in marks.items():
        by_pid[pid] += spans
    owner = {}  # correlation id -> mark
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            inside = [m for m in marks.get((e.get("pid"), e.get("tid")), []) if m[0] <= e["ts"] <= m[1]]
            inside = inside or [m for m in by_pid.get(e.get("pid"), []) if m[0] <= e["ts"] <= m[1]]
            if inside:
                owner[e["args"]["correlation"]] = min(inside, key=lambda m: m[1] - m[0])[2]
    out = {EXCHANGE: collections.Counter(), REDUCE: collections.Counter(), "window": collections.Counter()}
    names = collections.defaultdict(collections.Counter)
    for e in events:
        cat = e.get("cat")
        if cat not in _GPU_CATEGORIES:
            continue
        out["window"][cat] += 1
        where = owner.get(e.get("args", {}).get("correlation"))
        if where is not None:
            out[where][cat] += 1
            if cat == "kernel":
                names[where][e.get("name", "?")] += 1
    out["exchange kernel names"] = names[EXCHANGE]
    out["reduce kernel names"] = names[REDUCE]
    return out


def verdict(found: dict[str, collections.Counter], reduce_kernels: int, what: str,
            only_ce: bool = False) -> list[str]:
    """PASS/FAIL lines: no kernel inside exchanges; the counted reduction kernels inside reductions.
    The exchanges' copies must be seen: linked to the marks, or, when the profile window holds
    nothing but ce work (``only_ce``), the window's kernels are exactly the counted reductions."""
    ex, red, window = found[EXCHANGE], found[REDUCE], found["window"]
    lines = []
    named = f" ({dict(found['exchange kernel names'])})" if ex["kernel"] else ""
    if ex["kernel"] == 0 and ex["gpu_memcpy"] > 0:
        lines.append(f"PASS sm-free {what}: exchanges moved data with {ex['gpu_memcpy']} memcpy, 0 kernels")
    elif ex["kernel"] == 0 and only_ce and window["gpu_memcpy"] > 0 and window["kernel"] == reduce_kernels:
        lines.append(f"PASS sm-free {what}: the window holds only ce work: {window['gpu_memcpy']} memcpy and "
                     f"{window['kernel']} kernels = the counted reductions (memcpys not linked to the marks)")
    else:
        lines.append(f"FAIL sm-free {what}: exchanges: {ex['gpu_memcpy']} memcpy, {ex['kernel']} kernels{named}"
                     + ("" if ex["gpu_memcpy"] else " (no copy seen inside the exchanges)"))
    ok = red["kernel"] == reduce_kernels
    lines.append(f"{'PASS' if ok else 'FAIL'} sm-free {what}: reductions ran {red['kernel']} kernels, "
                 f"the communicator counted {reduce_kernels} ({dict(found['reduce kernel names'])})")
    lines.append(f"#  whole profile window: {window['kernel']} kernels, {window['gpu_memcpy']} memcpy, "
                 f"{window['gpu_memset']} memset")
    return lines


def profile(run: Callable[[], None], device: torch.device) -> dict:
    """The chrome trace (as a dict) of ``run()`` under torch.profiler (CPU + CUDA)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    torch.cuda.synchronize(device)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)


def fsdp_steps(device: torch.device, steps: int = 2, width: int = 1024) -> Callable[[], None]:
    """A closure running ``steps`` forward/backward passes of a small FSDP2 MLP (bf16 parameters
    gathered, float32 gradients reduce-scattered) on the default process group; one warm-up step
    runs now."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]).to(device)
    mesh = init_device_mesh("cuda", (torch.distributed.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    x = torch.randn(64, width, device=device)

    def run() -> None:
        for _ in range(steps):
            model(x).float().square().mean().backward()

    run()
    return run


def sm_free_profile(comm, ops: list[str], count: int, dtype: torch.dtype, device: torch.device,
                    iters: int, fsdp: bool) -> list[str]:
    """PASS/FAIL lines of the SM-free check (ce only): ``ops`` through torch.distributed, or FSDP2."""
    if comm.backend != "ce":
        raise ValueError(f"--sm-free profiles the ce backend's copies, got backend {comm.backend!r}")
    mark(comm)
    lines = []
    if fsdp:
        run = fsdp_steps(device)
        before = comm.stats()["reduce_kernels"]
        found = attribute(profile(run, device))
        lines += verdict(found, comm.stats()["reduce_kernels"] - before, "FSDP2 steps")
        return lines
    for op in ops:
        call, _ = make_dist_case(op, count, comm.world_size, comm.rank, dtype, device)
        call()
        before = comm.stats()["reduce_kernels"]

        def run() -> None:
            for _ in range(iters):
                call()

        found = attribute(profile(run, device))
        reduce_kernels = comm.stats()["reduce_kernels"] - before
        lines += verdict(found, reduce_kernels, f"{op} x{iters}", only_ce=op in ("all_gather", "reduce_scatter"))
    return lines
