"""Device experiment: the Hopper (Gluon) kernels persistent (one CTA per SM looping over work
items, the default) against one CTA per work item, forward and backward alone, GPU time, on
ANCHORS.md's workloads. Both schedules must give bit-identical results (same arithmetic per
item); each is also compared with gemcore's Triton kernels in the same process (max |diff|).

    python scripts/gluon_persistent_check.py [--workloads dense95 heavytail] [--activations softmax silu]
"""
from __future__ import annotations

import argparse
import math
import os
import time
from unittest import mock

import torch

from attn_experiment_harness import workload_inputs  # the module beside this script
from gemcore.bench.attention import GPU_TIME_SPACER_CYCLES
from gemcore.bench.timing import median_ms
from gemcore.kernels import jagged_attention
from gemcore.kernels import jagged_attention_gluon_bwd as gluon_bwd
from gemcore.kernels.jagged_attention_gluon import jagged_attention_fwd_hopper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", nargs="+", default=["dense95", "heavytail"])
    ap.add_argument("--activations", nargs="+", default=["softmax", "silu"])
    ap.add_argument("--dkdv-stages", nargs="+", type=int, default=[2, 3])
    ap.add_argument("--budget-s", type=float, default=240)
    args = ap.parse_args()
    deadline = time.time() + args.budget_s
    timing = dict(launch_hidden=True, spacer_cycles=GPU_TIME_SPACER_CYCLES)
    for workload in args.workloads:
        for act in args.activations:
            if time.time() > deadline:
                print("deadline reached", flush=True)
                return
            q, k, v, offsets, max_len, flops, kw = workload_inputs(workload, act)
            scale = kw.get("scale", 1 / math.sqrt(q.shape[2]))
            inv_norm = 1.0 / kw["norm"] if act != "softmax" else 1.0
            with mock.patch.dict(os.environ, {"GEMCORE_GLUON_ATTENTION": "0"}):
                ref = jagged_attention(q, k, v, offsets, validate=False, **kw)
                ms = median_ms(lambda: jagged_attention(q, k, v, offsets, validate=False, **kw), **timing)
            print(f"{workload} {act}: triton fwd {flops / ms / 1e9:.1f} TFLOP/s", flush=True)
            outs = {}
            for persistent in (True, False):
                def fwd(persistent=persistent):
                    return jagged_attention_fwd_hopper(q, k, v, offsets, act, True, scale, inv_norm, max_len,
                                                       persistent=persistent)
                outs[persistent] = fwd()
                ms = median_ms(fwd, **timing)
                err = (outs[persistent][0].float() - ref.float()).abs().max().item()
                print(f"  gluon fwd persistent={persistent}: {flops / ms / 1e9:.1f} TFLOP/s ({ms:.3f} ms), "
                      f"max|diff| vs triton {err:.1e}", flush=True)
            same = all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))
            print(f"  fwd persistent == per-item: {same}", flush=True)
            out, lse2 = outs[True]
            do = torch.randn_like(out)
            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
            with mock.patch.dict(os.environ, {"GEMCORE_GLUON_ATTENTION": "0"}):
                o_t = jagged_attention(qg, kg, vg, offsets, validate=False, **kw)
                ref_grads = torch.autograd.grad(o_t, (qg, kg, vg), do, retain_graph=True)
                ms = median_ms(lambda: torch.autograd.grad(o_t, (qg, kg, vg), do, retain_graph=True), **timing)
            print(f"  triton bwd {2.5 * flops / ms / 1e9:.1f} TFLOP/s ({ms:.3f} ms)", flush=True)
            grads = {}
            for persistent, stages in [(True, s) for s in args.dkdv_stages] + [(False, 2)]:
                def bwd(persistent=persistent):
                    return gluon_bwd.jagged_attention_bwd_hopper(do, q, k, v, out, lse2, offsets, act, True, scale,
                                                                 inv_norm, max_len, persistent=persistent)
                with mock.patch.object(gluon_bwd, "DKDV_TILE", (128, 64, stages)):
                    try:
                        grads[(persistent, stages)] = bwd()
                        ms = median_ms(bwd, **timing)
                    except Exception as exc:   # a variant that does not compile or fit here
                        print(f"  gluon bwd persistent={persistent} dkdv s{stages}: failed "
                              f"{type(exc).__name__}: {str(exc)[:200]}", flush=True)
                        continue
                err = max((a.float() - b.float()).abs().max().item()
                          for a, b in zip(grads[(persistent, stages)], ref_grads))
                print(f"  gluon bwd persistent={persistent} dkdv s{stages}: {2.5 * flops / ms / 1e9:.1f} TFLOP/s "
                      f"({ms:.3f} ms), max|diff| vs triton {err:.1e}", flush=True)
            if (True, 2) in grads and (False, 2) in grads:
                same = all(torch.equal(a, b) for a, b in zip(grads[(True, 2)], grads[(False, 2)]))
                print(f"  bwd persistent == per-item: {same}", flush=True)


if __name__ == "__main__":
    main()
