"""Which parameters' gradients differ between two identical backward passes on the GPU?

A bf16 GemModel (Triton attention, hidden 512 x 4 blocks x 4 heads) computes the gradients of the
same batch twice from the same weights, for several batches, with PyTorch's deterministic
algorithms off and then on; prints the parameters whose gradients were not bitwise equal (the
op behind each is the one that accumulates in arrival order).

    python scripts/nondeterministic_grads.py --batches 8
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=8)
    args = ap.parse_args()
    import torch

    from gemcore.config import AttentionConfig, ModelConfig
    from gemcore.data.synthetic import make_synthetic
    from gemcore.kernels.jagged_attention import make_attention
    from gemcore.model import GemModel

    torch.manual_seed(0)
    cfg = ModelConfig(num_items=2000, hidden=512, num_blocks=4, num_heads=4)
    model = GemModel(cfg, make_attention(AttentionConfig(), backend="triton")).to("cuda", torch.bfloat16)
    data = make_synthetic(num_users=64 * args.batches, num_items=cfg.num_items, num_actions=cfg.num_actions,
                          max_len=256, num_candidates=4, num_clusters=16, kind="heavytail", seed=0)

    def grads(users: list[int]) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model.loss(data.__getitems__(users).to("cuda")).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    for deterministic in (False, True):
        torch.use_deterministic_algorithms(deterministic)
        differ: dict[str, int] = {}
        for b in range(args.batches):
            users = list(range(64 * b, 64 * (b + 1)))
            first, second = grads(users), grads(users)
            for name in first:
                if not torch.equal(first[name], second[name]):
                    differ[name] = differ.get(name, 0) + 1
        print(f"deterministic algorithms {'on' if deterministic else 'off'}: parameters whose gradients "
              f"differed (batches of {args.batches}): {differ or 'none'}", flush=True)


if __name__ == "__main__":
    main()
