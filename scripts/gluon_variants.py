"""Device experiment: variants of a Hopper (Gluon) attention module, each a file (``--dir``,
default scripts/_variants: fwd_*.py copies of kernels/jagged_attention_gluon.py, bwd_*.py of
kernels/jagged_attention_gluon_bwd.py), that part alone in GPU time on ANCHORS.md's workloads;
every variant's results are compared with the first's (bit for bit, and max |diff|).

    python scripts/gluon_variants.py --part fwd|bwd [--workloads dense95 heavytail] [--activations softmax silu]
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import pathlib
import time

import torch

from attn_experiment_harness import workload_inputs  # the module beside this script
from gemcore.bench.attention import GPU_TIME_SPACER_CYCLES
from gemcore.bench.timing import median_ms
from gemcore.kernels.jagged_attention_gluon import jagged_attention_fwd_hopper


def load(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(f"variant_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["fwd", "bwd"], required=True)
    ap.add_argument("--dir", default=str(pathlib.Path(__file__).parent / "_variants"))
    ap.add_argument("--workloads", nargs="+", default=["dense95", "heavytail"])
    ap.add_argument("--activations", nargs="+", default=["softmax", "silu"])
    ap.add_argument("--budget-s", type=float, default=200)
    args = ap.parse_args()
    deadline = time.time() + args.budget_s
    variants = {p.stem: load(p) for p in sorted(pathlib.Path(args.dir).glob(f"{args.part}_*.py"))}
    timing = dict(launch_hidden=True, spacer_cycles=GPU_TIME_SPACER_CYCLES)
    for workload in args.workloads:
        for act in args.activations:
            q, k, v, offsets, max_len, flops, kw = workload_inputs(workload, act)
            scale = kw.get("scale", 1 / math.sqrt(q.shape[2]))
            inv_norm = 1.0 / kw["norm"] if act != "softmax" else 1.0
            out, lse2 = jagged_attention_fwd_hopper(q, k, v, offsets, act, True, scale, inv_norm, max_len)
            do = torch.randn_like(out)
            first = None
            for name, module in variants.items():
                if time.time() > deadline:
                    print("deadline reached", flush=True)
                    return

                def run(module=module):
                    if args.part == "fwd":
                        return module.jagged_attention_fwd_hopper(q, k, v, offsets, act, True, scale, inv_norm,
                                                                  max_len)[:1]
                    return module.jagged_attention_bwd_hopper(do, q, k, v, out, lse2, offsets, act, True, scale,
                                                              inv_norm, max_len)
                try:
                    grads = run()
                    ms = median_ms(run, **timing)
                except Exception as exc:   # a variant that does not compile or fit here
                    print(f"{workload} {act} {name}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                first = first or grads
                same = all(torch.equal(a, b) for a, b in zip(grads, first))
                diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, first))
                work = flops if args.part == "fwd" else 2.5 * flops
                print(f"{workload} {act} {args.part} {name}: {work / ms / 1e9:.1f} TFLOP/s ({ms:.3f} ms), "
                      f"bit-identical to the first: {same}, max|diff| {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
