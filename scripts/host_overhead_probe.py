"""Device experiment: the calibration's host overheads (calibrate._host_overheads' one- and
three-block train steps) measured on tiny models of different shapes, to see which one carries the
per-layer host work of the run's model: width 2·heads on one event (the calibration until session
21), the run's head dim on one event (the Triton attention path), and the run's head dim on a
history long enough for the Gluon path. Prints ms per layer and per step, the forward's share and
the optimizer's part.

    python scripts/host_overhead_probe.py --heads 4 --head-dim 128
"""
from __future__ import annotations

import argparse

import torch

from gemcore.planner import calibrate


def overheads(heads: int, head_dim: int, events: int) -> dict[str, float]:
    (one, fwd1, after1, _), (three, fwd3, after3, _) = calibrate._tiny_steps_s(
        (1, 3), heads, "triton", "cuda", torch.bfloat16, head_dim=head_dim, events=events)
    layer = (three - one) / 2
    return {"step_1block_ms": 1e3 * one, "step_3block_ms": 1e3 * three, "layer_ms": 1e3 * layer,
            "rest_ms": 1e3 * (one - layer), "fwd_share_1": fwd1, "fwd_share_3": fwd3,
            "after_1_ms": 1e3 * one * after1, "after_3_ms": 1e3 * three * after3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--events", type=int, default=300)
    args = ap.parse_args()
    for head_dim, events in ((2, 1), (args.head_dim, 1), (args.head_dim, args.events)):
        for _ in range(2):
            row = overheads(args.heads, head_dim, events)
            print(f"head_dim={head_dim:4d} events={events:4d} " +
                  " ".join(f"{k}={v:.3f}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
