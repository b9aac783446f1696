"""Where a multi-rank smoke step's time goes: inside the collectives, or outside them on the slower rank?

Run under torchrun: every rank runs ``gemcore.planner.smoke`` with the given arguments and logs each
FSDP2 collective's entry and exit on the host clock (CLOCK_MONOTONIC, shared by the processes of one
machine) to ``$COLLECTIVE_LOG_DIR/rank{r}.json``. Then ``--analyze`` reads the logs of two ranks:
- per collective kind and size, its *core* time, from the later rank's entry to the first exit
  (what the transfer took once both were there), and the ranks' mean arrival skew;
- per step (a step ends with the loss all-reduce), the wall time, each rank's time outside the
  collectives, and the sum over the sync segments of the slower rank's segment; with ``--predict``
  (the timed steps then follow as many warm-up steps), beside them the slower rank's predicted
  compute (host time included) and the predicted exposed communication, from rank 0's calibration.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 scripts/collective_core_time.py --steps 20 --hidden 256 --blocks 2 --max-len 256
    python scripts/collective_core_time.py --analyze
"""
import json
import os
import statistics
import sys
import time
from collections import defaultdict

LOG_DIR = os.environ.get("COLLECTIVE_LOG_DIR", "/tmp")


def log_and_run(argv: list[str]) -> None:
    import runpy

    import torch.distributed as dist

    log = []

    def timed(name):
        op = getattr(dist, name)

        def call(*args, **kwargs):
            t0 = time.perf_counter()
            result = op(*args, **kwargs)
            numel = (args[0] if args else kwargs.get("output", kwargs.get("tensor"))).numel()
            log.append((name, numel, t0, time.perf_counter()))
            return result
        setattr(dist, name, call)

    # FSDP2's calls: torch 2.13 names them *_single, 2.11 *_into_tensor / *_tensor (one of each, so
    # no call is logged twice through a wrapper)
    for names in (("all_gather_single", "all_gather_into_tensor"),
                  ("reduce_scatter_single", "reduce_scatter_tensor"), ("all_reduce",)):
        timed(next(name for name in names if hasattr(dist, name)))
    import gemcore.planner.cost as cost

    estimates = []                      # with --predict: each step's estimate of each rank's share
    estimate = cost.estimate

    def recorded(*args, **kwargs):
        e = estimate(*args, **kwargs)
        if kwargs.get("length_moments"):
            estimates.append({"compute_s": e.compute_s, "comm_s": sum(e.comm_exposed_s.values())})
        return e
    cost.estimate = recorded
    sys.argv = ["smoke", *argv]
    smoke = runpy.run_module("gemcore.planner.smoke", run_name="smoke")
    try:
        smoke["main"]()
    finally:
        with open(os.path.join(LOG_DIR, f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump({"log": log, "estimates": estimates, "steps": int(argv[argv.index("--steps") + 1])}, f)
        sys.stdout.flush()
        os._exit(0)


def analyze() -> None:
    runs = [json.load(open(os.path.join(LOG_DIR, f"rank{r}.json"))) for r in (0, 1)]
    a, b = (run["log"] for run in runs)
    estimates, n_steps = runs[0]["estimates"], runs[0]["steps"]
    assert [(x[0], x[1]) for x in a] == [(y[0], y[1]) for y in b], "the ranks' collectives differ"

    def steps(log):
        out, cur = [], []
        for e in log:
            cur.append(e)
            if e[0] == "all_reduce":
                out.append(cur)
                cur = []
        return out
    sa, sb = steps(a), steps(b)
    # with --predict the timed steps follow as many warm-up steps (the calibration's collectives
    # come after them), and rank 0's calibration predicted each (both ranks' shares, in rank
    # order); without, every step but the first is shown
    timed = range(n_steps, 2 * n_steps) if estimates else range(1, len(sa))
    core, skew = defaultdict(list), defaultdict(list)
    for i in timed:
        for x, y in zip(sa[i], sb[i]):
            core[x[0], x[1]].append(min(x[3], y[3]) - max(x[2], y[2]))
            skew[x[0], x[1]].append(abs(x[2] - y[2]))
    for key in core:
        print(f"{key[0]} of {key[1]} elements: core median {statistics.median(core[key]) * 1e3:.2f} ms, "
              f"mean {statistics.mean(core[key]) * 1e3:.2f}; arrival skew mean {statistics.mean(skew[key]) * 1e3:.2f} ms")

    print("wall ms | outside the collectives, rank 0 / rank 1 | slower | core collectives | sum of the slower segments"
          + (" | the slower's predicted compute (incl. host) | predicted exposed communication" if estimates else ""))
    for i in timed:
        t0 = max(sa[i - 1][-1][3], sb[i - 1][-1][3])
        wall = max(sa[i][-1][3], sb[i][-1][3]) - t0
        out_a = wall - sum(e[3] - e[2] for e in sa[i])
        out_b = wall - sum(e[3] - e[2] for e in sb[i])
        core_s = sum(min(x[3], y[3]) - max(x[2], y[2]) for x, y in zip(sa[i], sb[i]))
        seg, pa, pb = 0.0, t0, t0
        for x, y in zip(sa[i], sb[i]):
            seg += max(x[2] - pa, y[2] - pb)
            pa, pb = x[3], y[3]
        line = (f"{wall * 1e3:7.1f} | {out_a * 1e3:6.1f} / {out_b * 1e3:6.1f} | {max(out_a, out_b) * 1e3:6.1f} "
                f"| {core_s * 1e3:5.1f} | {seg * 1e3:6.1f}")
        if estimates:
            e = estimates[2 * (i - n_steps) + (0 if out_a >= out_b else 1)]
            line += (f" | {e['compute_s'] * 1e3:6.1f} ({e['compute_s'] / max(out_a, out_b):.2f})"
                     f" | {e['comm_s'] * 1e3:5.1f} ({e['comm_s'] / core_s:.2f})")
        print(line)


if __name__ == "__main__":
    if sys.argv[1:] == ["--analyze"]:
        analyze()
    else:
        log_and_run(sys.argv[1:])
