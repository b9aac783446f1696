"""Device A/B of two attention kernel options, with varlen_attn timed in the same process:

1. the softmax forward with lazy rescaling (RESCALE_TAU = 8) against rescaling at every key tile
   (RESCALE_TAU = 0), over forward tiles: useful forward TFLOP/s, max |diff| against tau = 0;
2. the fused backward with atomic dQ (ATOMIC_DQ = True) against separate dQ and dK/dV kernels,
   softmax and silu, over dK/dV tiles: useful forward+backward TFLOP/s, max |diff| of dq, dk.

Run on the GPU: ``python3 scripts/attn_lazy_rescale_ab.py [SECONDS]``.
"""
from __future__ import annotations

import sys
import time

import torch

from gemcore.bench.attention import useful_fwd_flops, workload_lengths
from gemcore.bench.timing import median_ms
from gemcore.kernels import jagged_attention
from gemcore.kernels import jagged_attention_triton as jt

TILES = [(128, 32, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3)]
DKDV_TILES = [(64, 128, 8, 2), (32, 128, 4, 3), (128, 128, 8, 2)]


def varlen_ms(q, k, v, offsets, max_len):
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    off = offsets.to(torch.int32)
    return median_ms(lambda: varlen_attn(q, k, v, off, off, max_len, max_len, window_size=(-1, 0)))


def main() -> None:
    deadline = time.time() + float(sys.argv[1] if len(sys.argv) > 1 else 300)
    for workload in ("dense95", "heavytail"):
        lengths, _ = workload_lengths(workload)
        torch.manual_seed(0)
        H, D = 4, 128
        T = int(lengths.sum())
        q, k, v = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64, device="cuda")
        offsets[1:] = lengths.cumsum(0).cuda()
        max_len = int(lengths.max())
        flops = useful_fwd_flops(lengths, None, H, D, causal=True)

        def fwd():
            return jagged_attention(q, k, v, offsets, causal=True, max_seqlen=max_len,
                                    backend="triton", validate=False)

        with torch.no_grad():
            ms = varlen_ms(q, k, v, offsets, max_len)
            if ms is not None:
                print(f"{workload} varlen_attn fwd: {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
            for tile in TILES:
                if time.time() > deadline:
                    print("deadline reached", flush=True)
                    return
                with jt.pinned_configs(fwd=jt.TileConfig(*tile)):
                    outs = {}
                    for tau in (0.0, 8.0, 0.0, 8.0):  # twice each, interleaved, for drift
                        jt.RESCALE_TAU = tau
                        try:
                            out = fwd()
                            torch.cuda.synchronize()
                            ms = median_ms(fwd)
                        except Exception as exc:  # a tile that does not compile or fit
                            print(f"  {tile} tau={tau:g}: failed {type(exc).__name__}: {str(exc)[:120]}",
                                  flush=True)
                            break
                        outs.setdefault(tau, out)
                        err = (out.float() - outs[0.0].float()).abs().max().item()
                        print(f"  {workload} {tile} tau={tau:g}: {flops / ms / 1e9:.0f} TFLOP/s "
                              f"max|diff vs tau=0| {err:.2e}", flush=True)
        jt.RESCALE_TAU = 8.0
        grad = torch.randn_like(q)
        for act in ("softmax", "silu"):
            kw = dict(activation=act, causal=True, max_seqlen=max_len, backend="triton",
                      validate=False)
            if act != "softmax":
                kw.update(scale=1.0 / D, norm=max_len)
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]

            def fwdbwd():
                out = jagged_attention(*leaves, offsets, **kw)
                return torch.autograd.grad(out, leaves, grad)

            for tile in DKDV_TILES:
                with jt.pinned_configs(dkdv=jt.TileConfig(*tile)):
                    grads = {}
                    for atomic in (False, True, False, True):
                        if time.time() > deadline:
                            print("deadline reached", flush=True)
                            return
                        jt.ATOMIC_DQ = atomic
                        try:
                            g = fwdbwd()
                            torch.cuda.synchronize()
                            ms = median_ms(fwdbwd)
                        except Exception as exc:
                            print(f"  bwd {tile} atomic={atomic}: failed {type(exc).__name__}: "
                                  f"{str(exc)[:120]}", flush=True)
                            break
                        grads.setdefault(atomic, g)
                        err = max((a.float() - b.float()).abs().max().item()
                                  for a, b in zip(g, grads[False]))
                        print(f"  {workload} {act} dkdv {tile} atomic={atomic}: fwd+bwd "
                              f"{3.5 * flops / ms / 1e9:.0f} TFLOP/s max|diff| {err:.2e}", flush=True)
            jt.ATOMIC_DQ = False


if __name__ == "__main__":
    main()
