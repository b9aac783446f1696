"""Train a small GemModel a few steps under a plan and print the losses (one JSON line, rank 0).

    torchrun --nproc-per-node 4 -m gemcore.planner.smoke --degrees dp_shard=2,tp=2 --steps 3
    python -m gemcore.planner.smoke --steps 3          # one process: the reference losses

Every run draws the same model initialisation and the same global batches (users
``[s*B, (s+1)*B)`` at step s, split over the data-parallel ranks as the ``random`` sampler does),
so losses of any plan must match the single-process run up to reduction order. Used by the tests
and to check a plan on a launcher before a long job.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gemcore.planner.smoke")
    ap.add_argument("--degrees", default="", help="plan degrees (default: every rank in dp_shard)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="global batch, users")
    ap.add_argument("--experts", type=int, default=0, help="MoE experts (0: dense MLP)")
    ap.add_argument("--clip", type=float, default=1.0, help="max gradient norm (0: off)")
    ap.add_argument("--same-batch", action="store_true", help="train on the first batch every step")
    args = ap.parse_args(argv)

    from gemcore.config import AttentionConfig, ModelConfig
    from gemcore.data.synthetic import make_synthetic
    from gemcore.kernels.jagged_attention import make_attention
    from gemcore.model import GemModel
    from gemcore.planner.apply import clip_grad_norm_
    from gemcore.planner.plan import Plan
    from gemcore.plugins.parallel_planned import PlannedParallelism, launcher_env

    env = launcher_env()
    plan = Plan.parse(args.degrees) if args.degrees else Plan(dp_shard=env["world_size"])
    par = PlannedParallelism(plan, env)
    cfg = ModelConfig(num_items=300, hidden=32, num_blocks=2, num_heads=4, mlp_ratio=2,
                      moe_experts=args.experts, moe_top_k=2)
    torch.manual_seed(0)
    model = GemModel(cfg, make_attention(AttentionConfig(), backend="reference"))
    model = par.apply(model, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = make_synthetic(num_users=args.batch * args.steps, num_items=cfg.num_items,
                          num_actions=cfg.num_actions, max_len=24, num_candidates=2, num_clusters=4,
                          kind="uniform", seed=0)
    losses = []
    for step in range(args.steps):
        first = 0 if args.same_batch else step * args.batch
        users = list(range(first, first + args.batch))[par.rank::par.world_size]
        loss = model.loss(data.__getitems__(users))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if args.clip:
            clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        losses.append(float(par.all_reduce_mean(loss.detach())))
    if env["rank"] == 0:
        print(json.dumps({"plan": par.describe(), "losses": losses}), flush=True)
    if par.mesh is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
