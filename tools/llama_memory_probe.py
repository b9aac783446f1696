"""Peak memory of a TorchTitan-style Llama 3 8B training step on one GPU, beside the planner's
prediction for the same model and layout: the check behind the memory figures of docs/planner.md
("Memory, measured").

The model follows Llama 3's published shapes (hidden 4096, 32 heads, 8 kv heads, FFN 14336,
vocabulary 128256) with fewer layers; the step is what TorchTitan runs: FSDP2 (one rank, bf16
parameters, fp32 reduction; every block sharded, the root not resharded after forward), selective
op activation checkpointing that recomputes every second ``aten.mm`` of a block in forward order,
SDPA attention, the loss as eager fp32 cross-entropy over the flattened logits, AdamW.

    python tools/llama_memory_probe.py --layers 2 4 8 --batch 2 --seq 8192 [--compile]

Needs one CUDA GPU (NCCL). Per layer count, in a fresh process: bytes allocated after the first
step (the training state), the peak allocated and reserved of the later steps, and the planner's
predicted peak; the slope over layers isolates one block's activations, the intercept the loss
and the edge weights. Units: GB = 1e9 bytes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

GB = 1e9


@dataclasses.dataclass
class LlamaShape:
    layers: int
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 14336
    vocab: int = 128256
    rope_theta: float = 500000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, S, H, D); cos/sin: (S, D/2). Rotates pairs (even, odd) of the last dimension."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).type_as(x)


class Block(nn.Module):
    def __init__(self, m: LlamaShape):
        super().__init__()
        self.m, d = m, m.hidden // m.heads
        self.attn_norm, self.mlp_norm = RMSNorm(m.hidden), RMSNorm(m.hidden)
        self.wq = nn.Linear(m.hidden, m.heads * d, bias=False)
        self.wk = nn.Linear(m.hidden, m.kv_heads * d, bias=False)
        self.wv = nn.Linear(m.hidden, m.kv_heads * d, bias=False)
        self.wo = nn.Linear(m.heads * d, m.hidden, bias=False)
        self.w1 = nn.Linear(m.hidden, m.ffn, bias=False)
        self.w3 = nn.Linear(m.hidden, m.ffn, bias=False)
        self.w2 = nn.Linear(m.ffn, m.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        m, d = self.m, self.m.hidden // self.m.heads
        h = self.attn_norm(x)
        q = rope(self.wq(h).view(B, S, m.heads, d), cos, sin)
        k = rope(self.wk(h).view(B, S, m.kv_heads, d), cos, sin)
        v = self.wv(h).view(B, S, m.kv_heads, d)
        rep = m.heads // m.kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.wo(o.transpose(1, 2).reshape(B, S, -1))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def every_other_mm_context():
    """TorchTitan's selective op AC as a fresh policy per checkpointed call: keep the outputs of
    attention and of the odd-numbered ``aten.mm`` calls, recompute the even-numbered ones and all else."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    keep = {getattr(aten, name).default for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention") if hasattr(aten, name)}
    counts = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs):
        if op == aten.mm.default:
            counts[ctx.is_recompute] += 1
            return (CheckpointPolicy.PREFER_RECOMPUTE if counts[ctx.is_recompute] % 2 == 0
                    else CheckpointPolicy.MUST_SAVE)
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class CheckpointedBlock(nn.Module):
    """A block under the selective op AC policy (TorchTitan wraps each block the same way)."""

    def __init__(self, block: Block):
        super().__init__()
        self.block = block

    def forward(self, x, cos, sin):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, cos, sin, use_reentrant=False, context_fn=every_other_mm_context)


class Llama(nn.Module):
    def __init__(self, m: LlamaShape, sac: bool, compile_blocks: bool = False):
        super().__init__()
        self.m = m
        self.tok = nn.Embedding(m.vocab, m.hidden)
        blocks = [CheckpointedBlock(Block(m)) if sac else Block(m) for _ in range(m.layers)]
        # TorchTitan's compile scope: each (checkpointed) block, the loss and optimizer stay eager
        self.layers = nn.ModuleList(torch.compile(b, fullgraph=True) if compile_blocks else b for b in blocks)
        self.norm = RMSNorm(m.hidden)
        self.out = nn.Linear(m.hidden, m.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        S, d = ids.shape[1], self.m.hidden // self.m.heads
        inv = 1.0 / self.m.rope_theta ** (torch.arange(0, d, 2, device=ids.device).float() / d)
        ang = torch.outer(torch.arange(S, device=ids.device).float(), inv)
        x = self.tok(ids)
        # in the blocks' dtype: FSDP2 casts a block's inputs in its forward but not in AC's recompute
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.out(self.norm(x))


def measure(layers: int, batch: int, seq: int, steps: int, sac: bool, compile_blocks: bool) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    dev = torch.device("cuda")
    with torch.device("meta"):
        model = Llama(LlamaShape(layers), sac, compile_blocks)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, layer in enumerate(model.layers):
        fully_shard(layer, mp_policy=mp, reshard_after_forward=i < layers - 1)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device=dev)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    ids = torch.randint(0, model.m.vocab, (batch, seq + 1), device=dev)
    rows = []
    for step in range(steps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(0, 1))
        del logits
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        rows.append({"before": before, "peak_allocated": torch.cuda.max_memory_allocated(),
                     "peak_reserved": torch.cuda.max_memory_reserved(), "loss": float(loss)})
    state = torch.cuda.memory_allocated()
    return {"layers": layers, "state_bytes": state, "steps": rows}


def predicted(layers: int, batch: int, seq: int, kernels: str) -> dict:
    from gemcore.planner.cluster import make_cluster
    from gemcore.planner.cost import estimate
    from gemcore.planner.models import load_model
    from gemcore.planner.plan import Plan

    spec = dataclasses.replace(load_model("llama3-8b"), num_layers=layers, seq_len=seq)
    plan = Plan(dp_shard=1, mbs=batch, ac="selective", sac="every_other_mm")
    est = estimate(spec, make_cluster("h200", 1, 1, kernels=kernels), plan, seq_len=seq, global_batch=batch)
    # FSDP2 on one rank still gathers the root (never resharded after forward) and two blocks in bf16,
    # which a dp_shard=1 plan does not hold
    gathers = 2 * (spec.embedding_params() + spec.head_params() + 2 * sum(spec.layer_params) / layers)
    return {**est.memory, "peak": est.memory_total + gathers}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-sac", action="store_true")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block (TorchTitan's scope)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)   # internal: one layer count, this process
    args = ap.parse_args(argv)
    if args.one is not None:
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
        torch.cuda.set_device(0)
        out = measure(args.one, args.batch, args.seq, args.steps, not args.no_sac, args.compile)
        print(json.dumps(out))
        dist.destroy_process_group()
        return 0
    import subprocess

    results = []
    for n in args.layers:        # a fresh process per layer count: a clean caching allocator
        cmd = [sys.executable, __file__, "--one", str(n), "--batch", str(args.batch), "--seq", str(args.seq),
               "--steps", str(args.steps)] + (["--no-sac"] if args.no_sac else []) + (["--compile"] if args.compile else [])
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            print(run.stderr[-3000:], file=sys.stderr)
            return run.returncode
        r = json.loads(run.stdout.strip().splitlines()[-1])
        last = r["steps"][-1]
        pred = predicted(n, args.batch, args.seq, "compiled-blocks" if args.compile else "eager")
        r["predicted"] = pred
        results.append(r)
        print(f"layers {n}: state {r['state_bytes'] / GB:.2f} GB, peak allocated "
              f"{last['peak_allocated'] / GB:.2f} (predicted {pred['peak'] / GB:.2f}), "
              f"reserved {last['peak_reserved'] / GB:.2f} (above the state: "
              f"{(last['peak_allocated'] - last['before']) / GB:.2f} allocated) | predicted "
              + ", ".join(f"{k} {v / GB:.2f}" for k, v in pred.items()), flush=True)
    if len(results) > 1:
        a, b = results[0], results[-1]
        dn = b["layers"] - a["layers"]
        for key in ("peak_allocated", "peak_reserved"):
            slope = (b["steps"][-1][key] - a["steps"][-1][key]) / dn
            print(f"per layer, {key}: {slope / GB:.3f} GB (predicted activations per layer "
                  f"{(b['predicted']['activations'] - a['predicted']['activations']) / dn / GB:.3f}, "
                  f"state per layer {(b['state_bytes'] - a['state_bytes']) / dn / GB:.3f} measured)")
    print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
