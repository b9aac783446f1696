"""Device experiment (session 23): how much the calibration's per-layer and per-step host figures
spread from one calibration to the next in one process, with the one- and three-block tiny models
timed one after the other (as until session 22) and interleaved round by round
(calibrate._tiny_steps_s). Alternates the two ways ``--repeats`` times each; prints ms.

    python scripts/host_overhead_spread.py --head-dim 128 --events 256
"""
from __future__ import annotations

import argparse
import statistics

import torch

from gemcore.planner import calibrate


def split(one: float, three: float) -> tuple[float, float]:
    layer = (three - one) / 2
    return 1e3 * layer, 1e3 * (one - layer)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--events", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    shape = dict(heads=1, backend="triton", device="cuda", dtype=torch.bfloat16,
                 head_dim=args.head_dim, events=args.events)
    calibrate._tiny_steps_s((1, 3), **shape)                  # compiles, warms the allocator
    rows = {"sequential": [], "interleaved": []}
    for _ in range(args.repeats):
        (one, *_), = calibrate._tiny_steps_s((1,), **shape)
        (three, *_), = calibrate._tiny_steps_s((3,), **shape)
        rows["sequential"].append(split(one, three))
        (one, *_), (three, *_) = calibrate._tiny_steps_s((1, 3), **shape)
        rows["interleaved"].append(split(one, three))
    for way, pairs in rows.items():
        layers, steps = zip(*pairs)
        print(f"{way:11s} layer ms {[round(x, 3) for x in layers]} (stdev {statistics.stdev(layers):.3f}) "
              f"step ms {[round(x, 3) for x in steps]} (stdev {statistics.stdev(steps):.3f})", flush=True)


if __name__ == "__main__":
    main()
