"""Device A/B: the softmax forward with lazy rescaling (RESCALE_TAU = 8) against rescaling at
every key tile (RESCALE_TAU = 0), over forward tiles, with varlen_attn timed in the same process.

Prints one line per (workload, tile, tau): useful forward TFLOP/s and max |diff| against the
tau = 0 output of the same tile. Run on the GPU: ``python3 scripts/attn_lazy_rescale_ab.py [SECONDS]``.
"""
from __future__ import annotations

import sys
import time

import torch

from gemcore.bench.attention import useful_fwd_flops, workload_lengths
from gemcore.bench.timing import median_ms
from gemcore.kernels import jagged_attention
from gemcore.kernels import jagged_attention_triton as jt

TILES = [(128, 32, 4, 4), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2),
         (128, 64, 8, 4)]


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


if __name__ == "__main__":
    main()
