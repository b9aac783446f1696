"""collective bandwidth in the nccl-tests format (size, count, type, time, algbw, busbw)

    mpirun -n 4 gem bench comms --backend mpi --op all_gather --min 1K --max 64M
    mpirun -n 2 gem bench comms --backend ce --op all_gather,broadcast --min 1M --max 1G --overlap-gemm
    torchrun --nproc-per-node 8 -m gemcore.cli.main bench comms --backend torch --op all_reduce --json

Run one process per GPU (or per CPU rank). Definitions follow nccl-tests: ``size`` is the bytes of
the op's full buffer (all_gather: the gathered output; reduce_scatter: the input; all_to_all: one
rank's send buffer; all_reduce and broadcast: the tensor), ``algbw = size / time`` with
GB = 1e9 bytes, and ``busbw = algbw * factor`` with factor (n-1)/n for all_gather,
reduce_scatter and all_to_all, 2(n-1)/n for all_reduce and 1 for broadcast. ``time`` is the mean
over ``--iters`` calls after ``--warmup``, the slowest rank's (max over ranks).

``time`` includes the host (``perf_counter`` around the calls and a final synchronisation): what
a caller feels. ``gpu-only(us)`` (CUDA) is the GPU's time per call alone: a spacer kernel holds
the stream while the host queues 40 calls, and two CUDA events time them once they run back to
back (:func:`gpu_only_s`); ``time`` above it means the host's enqueue bounds the call.
``--api dist`` calls the collectives through torch.distributed (``dist.all_gather_into_tensor``,
``dist.reduce_scatter_tensor``, ... on the default group of the ``gemcore_<backend>`` process group),
as training calls them; ``--api comm`` (default) calls the communicator. ``--anchor`` (CUDA) adds
``d2d(GB/s)``, a same-device device-to-device copy of the same size measured in the same run on one
process while the others wait, ``bus/d2d%`` = busbw / d2d, and for ``ce`` ``copies(GB/s)``: the
bytes every rank's copy-engine pulls and staging copies moved, per GPU, over the GPU time (with
several ranks on one GPU their copies share it, so busbw alone cannot reach the d2d figure).
``--in-place`` (with ``--api dist``) gathers from this rank's chunk of the output, as FSDP2 does.
``--sm-free`` (ce) profiles the collectives instead of timing them (:mod:`gemcore.bench.comms_dist`).

``--overlap-gemm`` (CUDA) adds the SM-interference figure per size: a loop of bf16 GEMMs
(``--gemm-n``³, ``--gemm-iters`` of them) on another stream, its TFLOP/s alone (once, before the
sizes) and while the collective is called back to back (enough calls to outlast the loop), and
``cover``: the share of the GEMM loop during which the collective's stream was busy. The GEMM runs
on the first rank of each GPU only (ranks sharing a GPU would otherwise compete with each other's
GEMMs); the figures are the worst (min) over those ranks. The one-GPU copy-engine demonstration
(device -> host vs same-device copies) is ``python -m gemcore.bench.comms_overlap``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
import math
from typing import Callable

import torch

from gemcore.bench.comms_common import GemmLoop, check_gemm_args, coverage, parse_bytes, slowdown_pct
from gemcore.bench.comms_dist import copy_gbs, make_dist_case, sm_free_profile
from gemcore.bench.timing import queued_gpu_ms

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int64": torch.int64, "uint8": torch.uint8}
def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw for ``op`` on ``n`` ranks."""
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")


def sizes(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(f"--min ({min_bytes}) must be >= 1 and <= --max ({max_bytes})")
    if factor < 2:
        raise ValueError(f"--step-factor must be >= 2, got {factor}")
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


@dataclass
class Row:
    """One line of the table."""

    op: str
    size_bytes: int
    count: int
    dtype: str
    time_us: float
    algbw_gbs: float
    busbw_gbs: float
    ranks: int
    backend: str
    checked: bool
    #: --overlap-gemm only: GEMM TFLOP/s alone and during the collective, slowdown %, cover (0..1)
    gemm_alone_tflops: float | None = None
    gemm_during_tflops: float | None = None
    gemm_slowdown_pct: float | None = None
    gemm_cover: float | None = None
    #: CUDA: the caller's stream time per call (events), the slowest rank's
    gpu_us: float | None = None
    #: --anchor: same-device copy GB/s at this size; ce: its copies' GB/s per GPU
    anchor_gbs: float | None = None
    copies_gbs: float | None = None


@dataclass
class Case:
    """One collective call at one size: ``call()`` runs it on prepared buffers."""

    op: str
    size_bytes: int
    count: int
    call: Callable[[], object]
    check: Callable[[], bool]


def host_comm(comm):
    """The communicator for the benchmark's own host-side figures (``ce`` serves CUDA only: its
    delegate)."""
    return comm.delegate if comm.backend == "ce" else comm


def make_case(comm, op: str, size_bytes: int, dtype: torch.dtype, device: torch.device,
              api: str = "comm", in_place: bool = False) -> Case | None:
    """Buffers for ``op`` moving ``size_bytes`` (rounded down to whole elements per rank); None if
    the size holds less than one element per rank. ``api="dist"``: through torch.distributed."""
    n, elem = comm.world_size, torch.empty((), dtype=dtype).element_size()
    count = size_bytes // elem
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        count -= count % n
    if count < (n if op != "all_reduce" and op != "broadcast" else 1):
        return None
    if api == "dist":
        return Case(op, count * elem, count, *make_dist_case(op, count, n, comm.rank, dtype, device, in_place))
    value = float(comm.rank + 1)
    if op == "all_gather":
        x = torch.full((count // n,), value, dtype=dtype, device=device)
        call = lambda: comm.all_gather(x)  # noqa: E731
        check = lambda: bool((comm.all_gather(x)[:: max(1, count // n)] ==  # noqa: E731
                              torch.arange(1, n + 1, dtype=dtype, device=device)).all())
    elif op == "reduce_scatter":
        x = torch.full((count,), value, dtype=dtype, device=device)
        call = lambda: comm.reduce_scatter(x)  # noqa: E731
        check = lambda: bool((comm.reduce_scatter(x) == n * (n + 1) // 2).all())  # noqa: E731
    elif op == "all_reduce":
        x = torch.full((count,), value, dtype=dtype, device=device)
        call = lambda: comm.all_reduce(x)  # noqa: E731
        check = lambda: bool((comm.all_reduce(x) == n * (n + 1) // 2).all())  # noqa: E731
    elif op == "all_to_all":
        x = torch.full((count,), value, dtype=dtype, device=device)
        splits = [count // n] * n
        call = lambda: comm.all_to_all(x, splits, splits)  # noqa: E731
        check = lambda: bool((comm.all_to_all(x, splits, splits)[:: max(1, count // n)] ==  # noqa: E731
                              torch.arange(1, n + 1, dtype=dtype, device=device)).all())
    else:
        x = torch.full((count,), value, dtype=dtype, device=device)
        call = lambda: comm.broadcast(x, src=0)  # noqa: E731
        check = lambda: bool((comm.broadcast(x.fill_(value), src=0) == 1).all())  # noqa: E731
    return Case(op, count * elem, count, call, check)


def time_case(comm, case: Case, warmup: int, iters: int, device: torch.device) -> tuple[float, float]:
    """(mean seconds per call including the host; on CUDA, mean GPU seconds per call with the
    host's enqueue hidden (:func:`gpu_only_s`), NaN on CPU), the slowest rank's."""
    for _ in range(warmup):
        case.call()
    _sync(device)
    comm.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        case.call()
    _sync(device)
    mine = (time.perf_counter() - start) / iters
    gpu = gpu_only_s(comm, case, mine, device, min(iters, GPU_ONLY_CALLS)) if device.type == "cuda" else math.nan
    worst = host_comm(comm).all_reduce(torch.tensor([mine, gpu], dtype=torch.float64), op="max")
    return float(worst[0]), float(worst[1])


#: calls timed by :func:`gpu_only_s` (their stream operations must fit the GPU's launch queue)
GPU_ONLY_CALLS = 40


def gpu_only_s(comm, case: Case, host_s: float, device: torch.device, calls: int) -> float:
    """GPU seconds per call with the host's work hidden (:func:`timing.queued_gpu_ms`): every
    rank, after a barrier, queues a spacer kernel that outlasts its enqueue of ``calls`` calls,
    then the calls; the queued work then runs back to back, ordered only by the GPU-side waits.
    NaN when the enqueue outlasted the spacer."""
    return queued_gpu_ms(case.call, calls, 1e3 * host_s, before=comm.barrier) / 1e3


def anchor_gbs(comm, nbytes: int, device: torch.device) -> float:
    """Same-device copy GB/s of ``nbytes`` on the first rank of each GPU while the others wait
    (the min over those ranks)."""
    hc = host_comm(comm)
    hc.barrier()
    mine = copy_gbs(nbytes, device) if comm.local_rank < torch.cuda.device_count() else math.inf
    hc.barrier()
    return float(hc.all_reduce(torch.tensor([mine], dtype=torch.float64), op="min")[0])


def _copied_bytes(comm) -> int:
    stats = comm.stats() if hasattr(comm, "stats") else {}
    return stats.get("copied_bytes", 0) + stats.get("staged_bytes", 0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calls_to_cover(loop_s: float, call_s: float, margin: float = 2.0, max_calls: int = 100_000) -> int:
    """Collective calls to issue so that they outlast a GEMM loop of ``loop_s`` seconds, given one
    call takes ``call_s`` alone (``margin`` allows for both slowing down when they overlap)."""
    if not loop_s > 0 or not call_s > 0:
        raise ValueError(f"loop_s and call_s must be positive, got {loop_s} and {call_s}")
    return max(2, min(max_calls, math.ceil(margin * loop_s / call_s) + 1))


def gemm_ranks_loop(comm, device: torch.device, n: int, iters: int) -> tuple[GemmLoop | None, float, float]:
    """(this rank's GEMM loop or None, TFLOP/s alone (min over GEMM ranks), loop seconds (max)).

    The first rank on each GPU runs the GEMM; the others only communicate."""
    gemm = GemmLoop(device, n, iters) if comm.local_rank < torch.cuda.device_count() else None
    alone = gemm.alone() if gemm else math.inf
    loop_s = gemm.iters * 2.0 * n ** 3 / (alone * 1e12) if gemm else 0.0
    alone = float(host_comm(comm).all_reduce(torch.tensor([alone], dtype=torch.float64), op="min")[0])
    loop_s = float(host_comm(comm).all_reduce(torch.tensor([loop_s], dtype=torch.float64), op="max")[0])
    return gemm, alone, loop_s


def overlap_case(comm, case: Case, calls: int, gemm: GemmLoop | None, device: torch.device) -> tuple[float, float]:
    """(GEMM TFLOP/s, cover) while ``calls`` calls of ``case`` run; the min over GEMM ranks."""
    _sync(device)
    comm.barrier()
    current = torch.cuda.current_stream(device)
    ref, first, last = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    ref.record(current)
    first.record(current)
    if gemm is not None:
        gemm.enqueue()
    for _ in range(calls):
        case.call()
    last.record(current)
    _sync(device)
    during, cover = math.inf, math.inf
    if gemm is not None:
        during = gemm.tflops()
        loop = (ref.elapsed_time(gemm.start), ref.elapsed_time(gemm.end))
        cover = coverage(loop, (ref.elapsed_time(first), ref.elapsed_time(last)))
    worst = host_comm(comm).all_reduce(torch.tensor([during, cover], dtype=torch.float64), op="min")
    return float(worst[0]), float(worst[1])


def measure(comm, ops: list[str], byte_sizes: list[int], dtype_name: str, device: torch.device,
            warmup: int, iters: int, check: bool, overlap: tuple[int, int] | None = None,
            api: str = "comm", anchor: bool = False, in_place: bool = False) -> list[Row]:
    """Rows for every op and size; ``overlap=(gemm_n, gemm_iters)`` adds the GEMM columns (CUDA),
    ``anchor`` the same-device copy columns (CUDA)."""
    rows = []
    gemm, alone, loop_s = gemm_ranks_loop(comm, device, *overlap) if overlap else (None, 0.0, 0.0)
    gpus = comm.num_nodes * min(comm.local_size, max(torch.cuda.device_count(), 1))
    for op in ops:
        for size in byte_sizes:
            case = make_case(comm, op, size, DTYPES[dtype_name], device, api, in_place)
            if case is None:
                continue
            if check and not case.check():
                raise RuntimeError(f"[rank {comm.rank}] {comm.backend} {op} at {size} bytes gave a wrong result")
            copied = _copied_bytes(comm)
            seconds, gpu_s = time_case(comm, case, warmup, iters, device)
            copied = _copied_bytes(comm) - copied
            algbw = case.size_bytes / seconds / 1e9
            row = Row(op, case.size_bytes, case.count, dtype_name, seconds * 1e6, algbw,
                      algbw * bus_factor(op, comm.world_size), comm.world_size, comm.backend, check)
            if device.type == "cuda":
                row.gpu_us = gpu_s * 1e6
            if anchor:
                row.anchor_gbs = anchor_gbs(comm, case.size_bytes, device)
                if copied:
                    total = float(host_comm(comm).all_reduce(torch.tensor([float(copied)], dtype=torch.float64))[0])
                    calls = warmup + iters + min(iters, GPU_ONLY_CALLS)  # time_case's calls
                    row.copies_gbs = total / calls / gpus / gpu_s / 1e9
            if overlap:
                during, cover = overlap_case(comm, case, calls_to_cover(loop_s, seconds), gemm, device)
                row.gemm_alone_tflops, row.gemm_during_tflops, row.gemm_cover = alone, during, cover
                row.gemm_slowdown_pct = slowdown_pct(alone, during)
            rows.append(row)
    return rows


def format_table(rows: list[Row]) -> str:
    lines = []
    for op in dict.fromkeys(r.op for r in rows):
        mine = [r for r in rows if r.op == op]
        lines.append(f"# {op}, backend {mine[0].backend}, {mine[0].ranks} ranks")
        gemm = mine[0].gemm_alone_tflops is not None
        gpu = mine[0].gpu_us is not None
        anchor = mine[0].anchor_gbs is not None
        lines.append(f"# {'size(B)':>12} {'count':>12} {'type':>9} {'time(us)':>10} "
                     + (f"{'gpu-only(us)':>12} " if gpu else "") + f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11}"
                     + (f" {'d2d(GB/s)':>10} {'bus/d2d%':>8} {'copies(GB/s)':>12}" if anchor else "")
                     + (f" {'gemm alone':>10} {'gemm during':>11} {'slowdown%':>9} {'cover%':>6}" if gemm else ""))
        for r in mine:
            line = (f"  {r.size_bytes:>12} {r.count:>12} {r.dtype:>9} {r.time_us:>10.1f} "
                    + (f"{r.gpu_us:>12.1f} " if gpu else "") + f"{r.algbw_gbs:>11.3f} {r.busbw_gbs:>11.3f}")
            if anchor:
                copies = f"{r.copies_gbs:>12.1f}" if r.copies_gbs is not None else f"{'-':>12}"
                line += f" {r.anchor_gbs:>10.1f} {100 * r.busbw_gbs / r.anchor_gbs:>8.1f} {copies}"
            if gemm:
                line += (f" {r.gemm_alone_tflops:>10.1f} {r.gemm_during_tflops:>11.1f} "
                         f"{r.gemm_slowdown_pct:>9.2f} {100 * r.gemm_cover:>6.1f}")
            lines.append(line)
        if gemm:
            lines.append("#  gemm: bf16 TFLOP/s on the first rank of each GPU, alone and during back-to-back calls")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="auto", help="communication backend (auto, torch, mpi, ce, ...)")
    p.add_argument("--op", default="all_gather",
                   help=f"collective(s), comma-separated, or 'all': {'|'.join(OPS)}")
    p.add_argument("--min", "--min-bytes", dest="min_bytes", default="1K", help="smallest size (e.g. 1K)")
    p.add_argument("--max", "--max-bytes", dest="max_bytes", default="64M", help="largest size (e.g. 1G)")
    p.add_argument("--step-factor", type=int, default=2, help="size multiplier between rows")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: the local GPU when CUDA is present")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the one correctness check per size")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="backend option, e.g. delegate=mpi for ce")
    p.add_argument("--overlap-gemm", action="store_true",
                   help="also a bf16 GEMM loop on another stream: TFLOP/s alone and during the collective (CUDA)")
    p.add_argument("--gemm-n", type=int, default=8192, help="--overlap-gemm: GEMM size n (n^3)")
    p.add_argument("--gemm-iters", type=int, default=40, help="--overlap-gemm: GEMMs per measured loop")
    p.add_argument("--api", default="comm", choices=["comm", "dist"],
                   help="dist: call torch.distributed (dist.all_gather_into_tensor, ...) on the gemcore process group")
    p.add_argument("--in-place", action="store_true",
                   help="--api dist: all_gather's input is this rank's chunk of the output (FSDP2's layout)")
    p.add_argument("--anchor", action="store_true",
                   help="also a same-device copy of each size in the same run (CUDA): d2d GB/s and busbw / d2d")
    p.add_argument("--sm-free", action="store_true",
                   help="ce: profile the collectives (at --max) and check that no kernel moves data")
    p.add_argument("--fsdp", action="store_true", help="--sm-free: profile two steps of a small FSDP2 model instead")
    p.add_argument("--json", action="store_true", help="print one JSON list of rows instead of the table")


def run(args: argparse.Namespace) -> int:
    ops = list(OPS) if args.op == "all" else [o.strip() for o in args.op.split(",") if o.strip()]
    for op in ops:
        if op not in OPS:
            raise ValueError(f"--op must be one of {', '.join(OPS)} or 'all', got {op!r}")
    if args.warmup < 0 or args.iters < 1:
        raise ValueError(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    byte_sizes = sizes(parse_bytes(args.min_bytes, "--min"), parse_bytes(args.max_bytes, "--max"),
                       args.step_factor)
    overlap = None
    if getattr(args, "overlap_gemm", False):
        check_gemm_args(args.gemm_n, args.gemm_iters)
        if args.device == "cpu" or not torch.cuda.is_available():
            raise ValueError("--overlap-gemm needs a CUDA GPU (--device cuda or auto with CUDA present)")
        overlap = (args.gemm_n, args.gemm_iters)
    api, anchor, sm_free = getattr(args, "api", "comm"), getattr(args, "anchor", False), getattr(args, "sm_free", False)
    cuda_ok = args.device != "cpu" and torch.cuda.is_available()
    for flag, on in (("--anchor", anchor), ("--sm-free", sm_free)):
        if on and not cuda_ok:
            raise ValueError(f"{flag} needs a CUDA GPU (--device cuda or auto with CUDA present)")
    if getattr(args, "fsdp", False) and not sm_free:
        raise ValueError("--fsdp goes with --sm-free")
    if getattr(args, "in_place", False) and api != "dist":
        raise ValueError("--in-place goes with --api dist")
    options = dict(kv.split("=", 1) for kv in args.option)
    from gemcore import comms

    # the signature check costs one small exchange per call: off while timing, on for the check
    comm = comms.init(args.backend, timeout_s=args.timeout_s, check=False, **options)
    try:
        use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        device = torch.device("cpu")
        if use_cuda:
            device = torch.device("cuda", comm.local_rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        if api == "dist" or sm_free:
            from gemcore.comms import process_group
            process_group.init_process_group(comm)
        if sm_free:
            count = byte_sizes[-1] // torch.empty((), dtype=DTYPES[args.dtype]).element_size()
            count -= count % comm.world_size
            lines = sm_free_profile(comm, ops, count, DTYPES[args.dtype], device, args.iters, args.fsdp)
            print("\n".join(f"[rank {comm.rank}] {line}" for line in lines), flush=True)
            return 1 if any(line.startswith("FAIL") for line in lines) else 0
        rows = measure(comm, ops, byte_sizes, args.dtype, device, args.warmup, args.iters, args.check, overlap,
                       api, anchor, getattr(args, "in_place", False))
        if comm.rank == 0:
            if args.json:
                print(json.dumps([asdict(r) for r in rows], indent=1))
            else:
                where = ", all_gather in place" if getattr(args, "in_place", False) else ""
                print(f"# gem bench comms: {comm.describe()}, device {device}, api {api}{where}, {args.iters} iters "
                      f"after {args.warmup} warm-up, time = slowest rank's mean")
                print(format_table(rows))
            sys.stdout.flush()
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
        comms.finalize()
    return 0
