"""Driver for an Nsight Compute look at the attention kernels: dense95 (ANCHORS.md), bf16, H=4,
D=128; softmax forward+backward twice (the first compiles), then silu forward+backward once.
Run under ncu on the GPU (scripts/device_s14_ncu.sh)."""
from __future__ import annotations

import torch

from gemcore.bench.attention import workload_lengths
from gemcore.kernels import jagged_attention


def main() -> None:
    lengths, _ = workload_lengths("dense95")
    torch.manual_seed(0)
    H, D = 4, 128
    T = int(lengths.sum())
    q, k, v = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64, device="cuda")
    offsets[1:] = lengths.cumsum(0).cuda()
    max_len = int(lengths.max())
    grad = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    for act, reps in (("softmax", 2), ("silu", 1)):
        kw = dict(activation=act, causal=True, max_seqlen=max_len, backend="triton", validate=False)
        if act != "softmax":
            kw.update(scale=1.0 / D, norm=max_len)
        for _ in range(reps):
            out = jagged_attention(q, k, v, offsets, **kw)
            torch.autograd.grad(out, (q, k, v), grad)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
