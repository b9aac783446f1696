"""Device experiment: the Hopper (Gluon) backward's ring depths (dQ's K/V ring, dK/dV's Q/dO ring)
on ANCHORS.md's workloads, backward alone in GPU time; each variant's gradients are checked
against the Triton backward's in the same process (max |diff|).

    python scripts/gluon_bwd_sweep.py [--workloads dense95 heavytail] [--activations softmax silu]
"""
from __future__ import annotations

import argparse
import os
import time
from unittest import mock

import torch

from attn_experiment_harness import workload_inputs  # the module beside this script
from gemcore.bench.attention import GPU_TIME_SPACER_CYCLES
from gemcore.bench.timing import median_ms
from gemcore.kernels import jagged_attention
from gemcore.kernels import jagged_attention_gluon_bwd as gluon_bwd

#: (dQ ring slots, dK/dV ring slots)
CONFIGS = [(3, 2), (2, 2), (4, 2), (3, 3), (3, 4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", nargs="+", default=["dense95", "heavytail"])
    ap.add_argument("--activations", nargs="+", default=["softmax", "silu"])
    ap.add_argument("--budget-s", type=float, default=200)
    args = ap.parse_args()
    deadline = time.time() + args.budget_s
    timing = dict(launch_hidden=True, spacer_cycles=GPU_TIME_SPACER_CYCLES)
    for workload in args.workloads:
        for act in args.activations:
            q, k, v, offsets, max_len, flops, kw = workload_inputs(workload, act)
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            out = jagged_attention(q, k, v, offsets, validate=False, **kw)
            do = torch.randn_like(out)

            def backward():
                return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
            with mock.patch.dict(os.environ, {"GEMCORE_GLUON_ATTENTION_BWD": "0"}):
                ref = backward()
                ms = median_ms(backward, **timing)
            print(f"{workload} {act}: triton backward {2.5 * flops / ms / 1e9:.0f} TFLOP/s ({ms:.2f} ms)", flush=True)
            for dq_slots, dkdv_slots in CONFIGS:
                if time.time() > deadline:
                    print("deadline reached")
                    return
                with mock.patch.object(gluon_bwd, "DQ_TILE", (128, 64, dq_slots)), \
                        mock.patch.object(gluon_bwd, "DKDV_TILE", (128, 64, dkdv_slots)):
                    try:
                        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(backward(), ref))
                        ms = median_ms(backward, **timing)
                        print(f"  gluon dQ s{dq_slots} dK/dV s{dkdv_slots}: {2.5 * flops / ms / 1e9:.0f} TFLOP/s "
                              f"({ms:.2f} ms), max|diff| vs triton {err:.1e}", flush=True)
                    except Exception as exc:    # a variant that does not compile or fit here
                        print(f"  gluon dQ s{dq_slots} dK/dV s{dkdv_slots}: failed {type(exc).__name__}: "
                              f"{str(exc)[:200]}", flush=True)


if __name__ == "__main__":
    main()
