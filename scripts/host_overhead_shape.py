"""Device experiment (session 23): which part of the run's shape the calibration's tiny models miss.
The small H200 row's backward issued 4.8-5.8 ms of host work per step where the calibration
predicted 3.9-4.3. Times the interleaved one- and three-block tiny steps (calibrate._tiny_steps_s)
per phase at one head or the run's heads, one user or the run's users; prints ms per phase.

    python scripts/host_overhead_shape.py --heads 4 --head-dim 128 --events 256 512 --users 16
"""
from __future__ import annotations

import argparse

import torch

from gemcore.planner import calibrate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--events", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--users", type=int, default=16)
    args = ap.parse_args()
    for events in args.events:
        calibrate._tiny_steps_s((1, 3), 1, "triton", "cuda", torch.bfloat16, head_dim=args.head_dim,
                                events=events)                   # compiles, warms the allocator
    for events in args.events:
        for heads in (1, args.heads):
            for users in (1, args.users):
                rows = calibrate._tiny_steps_s((1, 3), heads, "triton", "cuda", torch.bfloat16,
                                               head_dim=args.head_dim, events=events, users=users)
                text = []
                for blocks, (seconds, forward, after, _) in zip((1, 3), rows):
                    phases = (forward, 1 - forward - after, after)
                    text.append(f"{blocks} blocks {1e3 * seconds:.2f} ms (fwd/bwd/after " +
                                "/".join(f"{1e3 * seconds * p:.2f}" for p in phases) + ")")
                print(f"events={events} heads={heads} users={users:3d}: " + "; ".join(text), flush=True)


if __name__ == "__main__":
    main()
