"""Do the host-bound planner row's run and its calibration drift together within one process?

Calls ``gemcore.planner.smoke --predict`` ``--pairs`` times in one process (each call: an untimed
pass, the timed steps, then the calibration, so each pair is adjacent in time) and prints, per
pair, the measured and predicted step, their ratio, the calibration's per-layer and per-step host
figures, and the host's state over the pair from /proc: the share of CPU time the hypervisor stole
and the CPU the process last ran on.

    python scripts/small_row_pairs.py --pairs 4 -- --device cuda --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 20
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json


def cpu_times() -> list[int]:
    """The aggregate line of /proc/stat: user nice system idle iowait irq softirq steal (jiffies)."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def last_cpu() -> int:
    """The CPU this process last ran on (/proc/self/stat, field 39)."""
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("smoke_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    from gemcore.planner.smoke import main as smoke

    smoke_args = [a for a in args.smoke_args if a != "--"] + ["--predict"]
    for pair in range(args.pairs):
        before = cpu_times()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            smoke(smoke_args)
        after = cpu_times()
        delta = [b - a for a, b in zip(before, after)]
        d = json.loads(out.getvalue().strip().splitlines()[-1])
        cal = d["calibration"]
        print(f"pair {pair}: measured {d['step_s_measured'] * 1e3:.2f} ms, predicted "
              f"{d['step_s_predicted'] * 1e3:.2f} ms, ratio {d['predicted_over_measured']:.3f}, "
              f"per-step ratios {[round(r, 3) for r in d['per_step_ratio_min_max']]}, "
              f"calibration {{{', '.join(f'{k}: {v}' for k, v in cal.items() if 'overhead' in k)}}}, "
              f"steal {delta[7] / max(1, sum(delta)):.4f}, busy {1 - delta[3] / max(1, sum(delta)):.3f}, "
              f"cpu {last_cpu()}", flush=True)


if __name__ == "__main__":
    main()
