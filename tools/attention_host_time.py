"""Host time per call of gemcore's jagged attention and of PyTorch's ``varlen_attn``: the figure
"host time per call" of docs/benchmarks.md and the known gap of docs/kernels.md.

By default on a tiny input (one sequence of 16 tokens, H=4, D=128, bf16): the GPU work is
microseconds, so back-to-back calls run at the host's pace. ``--batch B --max-len L`` uses B
sequences of random length in [L/2, L] instead (a small model's attention: the Gluon path where it
applies); ``--workload model`` the sequences and heads of ``gem bench attention --workload model``
(the heavytail model's batch: 48 users, 16,487 tokens, 8 heads); ``--profile`` adds cProfile's
top functions of 100 forward+backward calls. Prints which kernels run, then microseconds per
forward and per forward+backward call (medians of 5 rounds of 100 calls): the host's time to issue
them back to back, and the wall time until the GPU is done (the larger when the GPU is the limit).
Needs a CUDA GPU:

    python tools/attention_host_time.py --batch 16 --max-len 512
    python tools/attention_host_time.py --workload model
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from gemcore.kernels.jagged_attention import jagged_attention


def per_call_us(fn, n=100, rounds=5) -> tuple[float, float]:
    """(host µs per call: issuing ``n`` calls back to back; wall µs per call: until the GPU is
    done), each the median of ``rounds`` rounds. ``n`` is small enough that the GPU's launch queue
    never fills (a full queue makes the host wait for the GPU, and the host time would be the
    GPU's)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((t1 - t0) / n * 1e6)
        wall.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(host), statistics.median(wall)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-len", type=int, default=16)
    ap.add_argument("--workload", choices=["model"], default=None,
                    help="the attention benchmark's model workload instead of --batch / --max-len")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    if args.batch < 1:
        ap.error(f"--batch must be >= 1, got {args.batch}")
    if args.max_len < 1:
        ap.error(f"--max-len must be >= 1, got {args.max_len}")
    if not torch.cuda.is_available():
        raise SystemExit("attention_host_time: needs a CUDA GPU")
    from torch.nn.attention.varlen import varlen_attn

    gen = torch.Generator().manual_seed(0)
    heads = 4
    if args.workload == "model":
        from gemcore.data.workloads import MODEL_SHAPE, workload_lengths

        lens, heads = workload_lengths("model")[0], MODEL_SHAPE["heads"]
    elif args.batch == 1:
        lens = torch.tensor([args.max_len])
    else:
        lens = torch.randint(args.max_len // 2, args.max_len + 1, (args.batch,), generator=gen)
    off = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    off[1:] = lens.cumsum(0)
    off = off.cuda()
    T, L = int(lens.sum()), int(lens.max())
    q, k, v = (torch.randn(T, heads, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    off32 = off.to(torch.int32)
    grad = torch.randn(T, heads, 128, device="cuda", dtype=torch.bfloat16)
    from gemcore.kernels.jagged_attention_triton import backward_kernel, forward_kernel
    print(f"T={T} B={lens.numel()} H={heads} max_len={L}: forward {forward_kernel(q, k, v, off)}, "
          f"backward {backward_kernel(q, k, v, off)}", flush=True)
    calls = {
        "gemcore softmax": lambda: jagged_attention(q, k, v, off, causal=True, max_seqlen=L,
                                                    backend="triton", validate=False),
        "gemcore silu": lambda: jagged_attention(q, k, v, off, causal=True, max_seqlen=L,
                                                 activation="silu", backend="triton", validate=False),
        "varlen_attn": lambda: varlen_attn(q, k, v, off32, off32, L, L, window_size=(-1, 0)),
    }
    for name, f in calls.items():
        with torch.no_grad():
            fwd, fwd_wall = per_call_us(f)
        fb, fb_wall = per_call_us(lambda f=f: torch.autograd.grad(f(), (q, k, v), grad))
        print(f"{name:16s} host per call: fwd {fwd:6.1f} us, fwd+bwd {fb:6.1f} us; wall per call: "
              f"fwd {fwd_wall:6.1f} us, fwd+bwd {fb_wall:6.1f} us", flush=True)
    if args.profile:
        f = calls["gemcore softmax"]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            torch.autograd.grad(f(), (q, k, v), grad)
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:6000])


if __name__ == "__main__":
    main()
