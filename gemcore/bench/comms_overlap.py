"""SM interference: a bf16 GEMM loop's TFLOP/s alone and while data moves on another stream.

    python -m gemcore.bench.comms_overlap --transfer none,host,device,kernel,peer --size 512M

One process, one GPU. A loop of ``--gemm-iters`` GEMMs ``a @ b`` (``--gemm-n``³, bfloat16) runs
on one stream while another stream keeps moving ``--size`` bytes at a time:

* ``host``: device -> pinned host (``cudaMemcpyAsync`` D2H): must cross a copy engine;
* ``peer``: device -> another GPU (``cudaMemcpyPeerAsync``): crosses a copy engine (needs 2 GPUs);
* ``device``: same-device ``cudaMemcpyAsync`` D2D, which the driver may run on SMs;
* ``kernel``: an SM copy kernel (``torch.add(src, 0, out=dst)``), the NCCL-kernel stand-in;
* ``none``: the GEMM alone (the baseline, measured in the same run).

The copy-engine claim of the ``ce`` backend rests on the first two rows: between GPUs its pulls
are peer copies. On one GPU, its peer pulls between processes are same-device copies (``device``
row), so a one-GPU ``mpirun`` overlap run shows time-slicing and SM sharing, not copy-engine
behaviour. ``gem bench comms --overlap-gemm`` is the multi-rank form (both use
:mod:`gemcore.bench.comms_common`).

Reported per transfer: GEMM TFLOP/s (analytic 2·n³ per GEMM over the loop's CUDA-event time),
slowdown against ``none``, the transfer's GB/s (1e9 B), and ``cover``: the share of the GEMM
loop's time during which the transfer stream was busy (a row with low cover did not measure
interference over the whole loop).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass

import torch

from gemcore.bench.comms_common import (GemmLoop, check_gemm_args, coverage, gemm_flops, median_spread,  # noqa: F401
                                        noise_pct, parse_bytes, slowdown_pct, slowdown_verdict, tflops)

TRANSFERS = ("none", "host", "peer", "device", "kernel")
#: the goal for copy-engine transfers: at most this GEMM slowdown
GOAL_SLOWDOWN_PCT = 1.0


def parse_transfers(text: str) -> list[str]:
    """``"none,host"`` -> ``["none", "host"]``; ``"all"`` is every transfer."""
    if text.strip() == "all":
        return list(TRANSFERS)
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError(f"--transfer must name at least one of {', '.join(TRANSFERS)}, got {text!r}")
    for name in names:
        if name not in TRANSFERS:
            raise ValueError(f"--transfer must be one of {', '.join(TRANSFERS)} or 'all', got {name!r}")
    return list(dict.fromkeys(names))


# ---------------------------------------------------------------------- one-GPU transfer demo
@dataclass
class TransferRow:
    transfer: str
    gemm_tflops: float
    slowdown_pct: float
    transfer_gbs: float
    cover: float
    note: str = ""
    #: GEMM TFLOP/s over the repeats (the row holds the median run's figures)
    tflops_min: float = float("nan")
    tflops_max: float = float("nan")
    #: the noise in %: the widest relative range of the GEMM alone and of this row's repeats
    noise_pct: float = float("nan")
    repeats: int = 1


class _Transfer:
    """``step()`` moves ``nbytes`` once on ``stream``."""

    def __init__(self, kind: str, nbytes: int, device: torch.device) -> None:
        self.kind, self.nbytes = kind, nbytes
        self.stream = torch.cuda.Stream(device)
        self.src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
        if kind == "host":
            self.dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        elif kind == "peer":
            self.dst = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", (device.index + 1)
                                                                                    % torch.cuda.device_count()))
        else:
            self.dst = torch.empty_like(self.src)

    def step(self) -> None:
        with torch.cuda.stream(self.stream):
            if self.kind == "kernel":
                torch.add(self.src, 0, out=self.dst)
            else:
                self.dst.copy_(self.src, non_blocking=True)


def run_transfer(move: _Transfer, gemm: GemmLoop, alone: float) -> TransferRow:
    """The GEMM loop while ``move``'s transfers run back to back on another stream."""
    device, kind, nbytes = gemm.device, move.kind, move.nbytes
    move.step()  # warm-up (and peer access set-up)
    torch.cuda.synchronize()
    ref = torch.cuda.Event(enable_timing=True)
    first = torch.cuda.Event(enable_timing=True)
    last = torch.cuda.Event(enable_timing=True)
    ref.record(torch.cuda.current_stream(device))
    move.stream.wait_event(ref)
    first.record(move.stream)
    inflight = []
    for _ in range(2):  # the transfer stream is busy before the first GEMM starts
        move.step()
        done = torch.cuda.Event()
        done.record(move.stream)
        inflight.append(done)
    gemm.enqueue()
    count = 2
    while not gemm.end.query():  # keep two transfers queued until the GEMM loop has finished
        inflight.pop(0).synchronize()
        move.step()
        done = torch.cuda.Event()
        done.record(move.stream)
        inflight.append(done)
        count += 1
    last.record(move.stream)
    torch.cuda.synchronize(device)
    during = gemm.tflops()
    span = (ref.elapsed_time(first) / 1e3, ref.elapsed_time(last) / 1e3)
    loop = (ref.elapsed_time(gemm.start) / 1e3, ref.elapsed_time(gemm.end) / 1e3)
    gbs = count * nbytes / (span[1] - span[0]) / 1e9
    return TransferRow(kind, during, slowdown_pct(alone, during), gbs, coverage(loop, span))


def format_rows(rows: list[TransferRow], gemm: GemmLoop, nbytes: int) -> str:
    lines = [f"# GEMM {gemm.n}^3 bf16 x {gemm.iters} on one stream, {nbytes} B transfers on another "
             f"({torch.cuda.get_device_name(gemm.device)})",
             f"# median of {rows[0].repeats if rows else 0} repeats; range = min..max GEMM TFLOP/s over them; "
             f"noise = the widest relative range (GEMM alone, this row)",
             f"# {'transfer':>9} {'GEMM TFLOP/s':>13} {'range':>15} {'slowdown %':>11} {'noise %':>8} "
             f"{'xfer GB/s':>10} {'cover %':>8}"]
    for r in rows:
        spread = f"{r.tflops_min:.1f}..{r.tflops_max:.1f}"
        lines.append(f"  {r.transfer:>9} {r.gemm_tflops:>13.1f} {spread:>15} {r.slowdown_pct:>11.2f} "
                     f"{r.noise_pct:>8.2f} {r.transfer_gbs:>10.1f} {100 * r.cover:>8.1f} {r.note}".rstrip())
    lines += verdicts(rows)
    return "\n".join(lines)


def verdicts(rows: list[TransferRow], goal_pct: float = GOAL_SLOWDOWN_PCT) -> list[str]:
    """One line per measured copy-engine transfer (host, peer): its median slowdown against the
    goal, with a verdict only when the noise allows one (:func:`slowdown_verdict`)."""
    out = []
    for r in rows:
        if r.transfer in ("host", "peer") and not math.isnan(r.slowdown_pct):
            verdict = slowdown_verdict(r.slowdown_pct, r.noise_pct, goal_pct)
            out.append(f"# {r.transfer}: GEMM slowdown {r.slowdown_pct:.2f}% (noise ±{r.noise_pct:.2f}%, "
                       f"{r.repeats} repeats) beside a copy-engine transfer (goal <= {goal_pct:g}%: {verdict}; "
                       f"cover {100 * r.cover:.0f}%)")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transfer", default="all", help=f"comma-separated, or 'all': {', '.join(TRANSFERS)}")
    p.add_argument("--size", default="512M", help="bytes per transfer (e.g. 512M)")
    p.add_argument("--gemm-n", type=int, default=8192, help="GEMM size n (n x n @ n x n, bfloat16)")
    p.add_argument("--gemm-iters", type=int, default=40, help="GEMMs per measured loop")
    p.add_argument("--repeats", type=int, default=5,
                   help="measure the GEMM alone and each transfer this many times: median, range and noise")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    kinds = parse_transfers(args.transfer)
    nbytes = parse_bytes(args.size, "--size")
    check_gemm_args(args.gemm_n, args.gemm_iters)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if not torch.cuda.is_available():
        raise RuntimeError("comms_overlap needs a CUDA GPU (it measures SM interference)")
    device = torch.device("cuda", torch.cuda.current_device())
    gemm = GemmLoop(device, args.gemm_n, args.gemm_iters)
    alone_runs = [gemm.alone() for _ in range(args.repeats)]
    alone, lo, hi = median_spread(alone_runs)
    rows = []
    for kind in kinds:
        if kind == "none":
            rows.append(TransferRow(kind, alone, 0.0, 0.0, 0.0, "GEMM alone", lo, hi, noise_pct(alone_runs),
                                    args.repeats))
            continue
        if kind == "peer" and torch.cuda.device_count() < 2:
            rows.append(TransferRow(kind, float("nan"), float("nan"), float("nan"), 0.0, "skipped: needs 2 GPUs"))
            continue
        move = _Transfer(kind, nbytes, device)
        runs = sorted((run_transfer(move, gemm, alone) for _ in range(args.repeats)), key=lambda r: r.gemm_tflops)
        row = runs[len(runs) // 2]
        during = [r.gemm_tflops for r in runs]
        row.tflops_min, row.tflops_max = min(during), max(during)
        row.noise_pct, row.repeats = noise_pct(alone_runs, during), args.repeats
        rows.append(row)
        del move
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        print(format_rows(rows, gemm, nbytes))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gemcore.bench.comms_overlap",
                                description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
