"""Two facts the planner's byte counts rest on, measured on the GPU (issue 6):

1. peak memory of the LM loss, forward + backward, per logit: eager ``F.cross_entropy(x.float())``
   (as TorchTitan's loss) and the same under torch.compile, on bf16 logits of (tokens, vocab);
2. the kernels ``torch.nn.functional.rms_norm`` launches on CUDA (one fused kernel or the upcast ops).

    python scripts/loss_norm_probe.py [--tokens 16384 --vocab 128256]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F


def loss_bytes_per_logit(tokens: int, vocab: int, compiled: bool) -> dict:
    dev = torch.device("cuda")
    fn = lambda x, y: F.cross_entropy(x.float(), y)   # noqa: E731 - TorchTitan's eager loss
    if compiled:
        fn = torch.compile(fn)
    labels = torch.randint(0, vocab, (tokens,), device=dev)
    out = {}
    for attempt in range(2):                          # the first compiles
        logits = torch.randn(tokens, vocab, device=dev, dtype=torch.bfloat16, requires_grad=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()          # the bf16 logits themselves (2 B each)
        fn(logits, labels).backward()
        torch.cuda.synchronize()
        n = tokens * vocab
        # peak above the logits, + the logits' own 2 B: what the loss keeps alive at once per logit
        out = {"peak_bytes_per_logit": (torch.cuda.max_memory_allocated() - base) / n + 2,
               "grad_dtype": str(logits.grad.dtype)}
        del logits
    return out


def rms_norm_kernels() -> list[str]:
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    F.rms_norm(x, (4096,), w, 1e-5).sum().backward()   # warm
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        y = F.rms_norm(x, (4096,), w, 1e-5)
        torch.cuda.synchronize()
    fwd = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    g = torch.ones_like(y)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        y.backward(g)
        torch.cuda.synchronize()
    bwd = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    return {"forward": fwd, "backward": bwd}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=128256)
    args = ap.parse_args()
    out = {"torch": torch.__version__, "rms_norm_kernels": rms_norm_kernels()}
    for compiled in (False, True):
        out["compiled_loss" if compiled else "eager_loss"] = loss_bytes_per_logit(args.tokens, args.vocab, compiled)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
