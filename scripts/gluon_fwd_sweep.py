"""Device experiment: the Hopper (Gluon) forward's key tile and ring depth on ANCHORS.md's
workloads, GPU time, beside gemcore's Triton forward in the same process; each variant's output
is checked against the Triton forward's (max |diff|).

    python scripts/gluon_fwd_sweep.py [--workloads dense95 heavytail] [--activations softmax silu]
"""
from __future__ import annotations

import argparse
import math
import time


from attn_experiment_harness import workload_inputs  # the module beside this script
from gemcore.bench.attention import GPU_TIME_SPACER_CYCLES
from gemcore.bench.timing import median_ms
from gemcore.kernels import jagged_attention
from gemcore.kernels.jagged_attention_gluon import jagged_attention_fwd_hopper

CONFIGS = [(64, 2), (64, 3), (64, 4), (128, 2), (128, 3)]   # (key rows per tile, ring slots)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", nargs="+", default=["dense95", "heavytail"])
    ap.add_argument("--activations", nargs="+", default=["softmax", "silu"])
    ap.add_argument("--budget-s", type=float, default=240)
    args = ap.parse_args()
    deadline = time.time() + args.budget_s
    timing = dict(launch_hidden=True, spacer_cycles=GPU_TIME_SPACER_CYCLES)
    for workload in args.workloads:
        for act in args.activations:
            q, k, v, offsets, max_len, flops, kw = workload_inputs(workload, act)
            scale = kw.get("scale", 1 / math.sqrt(q.shape[2]))
            inv_norm = 1.0 / kw["norm"] if act != "softmax" else 1.0
            ref = jagged_attention(q, k, v, offsets, validate=False, **kw)
            ms = median_ms(lambda: jagged_attention(q, k, v, offsets, validate=False, **kw), **timing)
            print(f"{workload} {act}: gemcore as dispatched {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
            for block_n, stages in CONFIGS:
                if time.time() > deadline:
                    print("deadline reached")
                    return

                def fn(block_n=block_n, stages=stages):
                    return jagged_attention_fwd_hopper(q, k, v, offsets, act, True, scale, inv_norm,
                                                       max_len, block_n=block_n, stages=stages)[0]
                try:
                    err = (fn().float() - ref.float()).abs().max().item()
                    ms = median_ms(fn, **timing)
                    print(f"  gluon n{block_n} s{stages}: {flops / ms / 1e9:.0f} TFLOP/s, "
                          f"max|diff| vs triton {err:.1e}", flush=True)
                except Exception as exc:    # a variant that does not compile or fit here
                    print(f"  gluon n{block_n} s{stages}: failed {type(exc).__name__}: {str(exc)[:200]}",
                          flush=True)


if __name__ == "__main__":
    main()
