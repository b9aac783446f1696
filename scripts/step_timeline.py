"""Device experiment: where a small GemModel train step's time goes on one GPU (the planner's
host-bound row). The smoke's model and step (bf16, Triton attention, AdamW, clipping, one sync at
the end), then torch.profiler over a few steps: per step the wall time, the GPU's busy time (the
union of its kernels' intervals), the kernel count, and the largest idle gaps between kernels.

    python scripts/step_timeline.py --hidden 512 --blocks 4 --max-len 512 --batch 16
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from gemcore.config import AttentionConfig, ModelConfig
from gemcore.data.synthetic import make_synthetic
from gemcore.kernels.jagged_attention import make_attention
from gemcore.model import GemModel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cpu-ops", type=int, default=0, help="also print the N ops with most host time")
    args = ap.parse_args()
    device = torch.device(args.device)
    cfg = ModelConfig(num_items=300, hidden=args.hidden, num_blocks=args.blocks, num_heads=4, mlp_ratio=2)
    torch.manual_seed(0)
    model = GemModel(cfg, make_attention(AttentionConfig(), backend="triton" if args.device == "cuda" else "reference")).to(device=device, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = make_synthetic(num_users=args.batch * args.steps, num_items=cfg.num_items, num_actions=cfg.num_actions,
                          max_len=args.max_len, num_candidates=2, num_clusters=4, kind="uniform", seed=0)
    batches = [data.__getitems__(list(range(s * args.batch, (s + 1) * args.batch))).to(device)
               for s in range(args.steps)]

    def step(batch):
        opt.zero_grad(set_to_none=True)
        loss = model.loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss.detach())

    def phased_step(batch):
        """The same step with host clock readings and CUDA events at the phase borders (no sync
        until the end): (host seconds at each border, GPU seconds at each border), from step start."""
        names = ["zero_grad", "forward", "backward", "clip", "optimizer", "loss sync"]
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(names) + 1)]
        host = [time.perf_counter()]
        events[0].record()
        opt.zero_grad(set_to_none=True)

        def mark():
            events[len(host)].record()
            host.append(time.perf_counter())

        mark()
        loss = model.loss(batch)
        mark()
        loss.backward()
        mark()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        mark()
        opt.step()
        mark()
        float(loss.detach())
        mark()
        torch.cuda.synchronize()
        return names, [h - host[0] for h in host[1:]], [events[0].elapsed_time(e) / 1e3 for e in events[1:]]

    for b in batches * 2:                          # compile every length variant first
        step(b)
    if device.type == "cuda":
        rows = [phased_step(b) for b in batches * 2]
        names = rows[0][0]
        print("phase borders, ms from step start (mean of %d steps): host issued / GPU done" % len(rows))
        for i, name in enumerate(names):
            h = sum(r[1][i] for r in rows) / len(rows)
            g = sum(r[2][i] for r in rows) / len(rows)
            print(f"  {name:10s} host {1e3 * h:7.2f}  GPU {1e3 * g:7.2f}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    walls = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for b in batches:
            t0 = time.perf_counter()
            step(b)
            walls.append(time.perf_counter() - t0)
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    busy, end, gaps = 0.0, None, []
    for e in kernels:
        s, t = e.time_range.start, e.time_range.end
        if end is None or s >= end:
            if end is not None:
                gaps.append(s - end)
            busy += t - s
            end = t
        elif t > end:
            busy += t - end
            end = t
    n = len(batches)
    gaps.sort(reverse=True)
    print(f"wall per step {1e3 * sum(walls) / n:.2f} ms (steps {[round(1e3 * w, 2) for w in walls]})")
    print(f"GPU busy per step {busy / 1e3 / n:.2f} ms, kernels per step {len(kernels) / n:.0f}, "
          f"idle gaps between kernels per step {sum(gaps) / 1e3 / n:.2f} ms (largest: {[round(g) for g in gaps[:8]]} us)")
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name[:60]] = by_name.get(e.name[:60], 0.0) + e.time_range.end - e.time_range.start
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {us / 1e3 / n:7.3f} ms/step  {name}")
    if args.cpu_ops:
        print("host time per step by op (self, ms) and calls per step:")
        rows = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:args.cpu_ops]
        for a in rows:
            print(f"  {a.self_cpu_time_total / 1e3 / n:7.3f} ms  {a.count / n:6.0f}  {a.key[:70]}")


if __name__ == "__main__":
    main()
