"""Jagged attention: gemcore's useful TFLOP/s (fwd, fwd+bwd) and peak memory beside stock PyTorch.

Workloads (docs/benchmarks.md, "Workloads") and the FLOP count: H=4, D=128, bf16; useful forward FLOPs =
4·Σ(Lq·Lk)·H·D (halved for causal self-attention), forward+backward = 3.5 × forward. The anchors
(padded SDPA, ``torch.nn.attention.varlen.varlen_attn``, FlexAttention with a document mask,
nested-tensor SDPA) are measured in the same run, on the same inputs. Workload ``model`` is the
attention of ``gem bench train``'s model: heavytail histories of 48 users (max 4096) plus 16
candidates each (``num_targets``), H=8 heads of D=128; there the anchors run plain causal attention
(varlen_attn cannot take the target mask), and with ``flex`` a second FlexAttention row runs the
exact target mask; FLOPs are counted as causal. gemcore is timed the way
the model calls it (``max_seqlen`` given, ``validate=False``: no host sync, as ``varlen_attn``
takes its maxima from the caller); ``--validated`` adds the checked call (one host sync). The
Gluon kernels' work lists are built once per offsets tensor, as a model's layers share one batch's
offsets, so the repeated calls reuse them; one build's time is printed apart (work_list_build_us).
Each call is timed from an idle GPU (host launch work included) unless ``--gpu-time``, which times
every row, gemcore and anchors alike, on the GPU alone (``timing.median_ms``'s spacer).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
from dataclasses import asdict, dataclass
from functools import partial
from typing import Callable
from unittest import mock

import torch

from gemcore.bench.timing import median_ms
from gemcore.data.workloads import ATTENTION_WORKLOADS as WORKLOADS
from gemcore.data.workloads import MODEL_SHAPE, workload_lengths

ANCHORS = ("sdpa", "varlen", "flex", "nested")


@dataclass
class Row:
    name: str
    fwd_ms: float | None
    fwdbwd_ms: float | None
    fwd_tflops: float | None
    fwdbwd_tflops: float | None
    peak_gb: float | None
    note: str = ""


def useful_fwd_flops(q_lens: torch.Tensor, kv_lens: torch.Tensor | None, H: int, D: int,
                     causal: bool) -> float:
    kv = q_lens if kv_lens is None else kv_lens
    flops = 4.0 * float((q_lens.double() * kv.double()).sum()) * H * D
    return flops / 2 if causal else flops


#: spacer of ``--gpu-time`` timing, GPU cycles (~1 ms on an H200): longer than the host's work for
#: one forward+backward call of any row (Python, autograd, launches)
GPU_TIME_SPACER_CYCLES = 2_000_000


def measure(name: str, forward: Callable[[], torch.Tensor], inputs, flops: float,
            iters: int, gpu_time: bool = False) -> Row:
    """Time forward and forward+backward of ``forward()`` w.r.t. ``inputs``; peak memory of fwd+bwd.

    ``gpu_time``: each timed call waits behind a spacer kernel, so the time is the GPU's alone
    (the host's launch work, hidden in a running model, is not counted); otherwise each call is
    timed from an idle GPU and includes the host's work before its first kernel starts."""
    timing = dict(launch_hidden=gpu_time, spacer_cycles=GPU_TIME_SPACER_CYCLES)
    try:
        out = forward()
        grad = torch.randn_like(out)

        def fwdbwd():
            torch.autograd.grad(forward(), inputs, grad)

        with torch.no_grad():
            fwd_ms = median_ms(forward, iters, **timing)
        fwdbwd_ms = median_ms(fwdbwd, iters, **timing)
        del out
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwdbwd()
        torch.cuda.synchronize()
        peak_gb = (torch.cuda.max_memory_allocated() - base) / 1e9
    except Exception as exc:  # an anchor missing from this torch build is reported, not fatal
        return Row(name, None, None, None, None, None, f"{type(exc).__name__}: {str(exc)[:80]}")
    return Row(name, fwd_ms, fwdbwd_ms, flops / fwd_ms / 1e9, 3.5 * flops / fwdbwd_ms / 1e9, peak_gb)


def _padded(x: torch.Tensor, offsets: torch.Tensor, lmax: int) -> torch.Tensor:
    """(T, H, D) jagged -> (B, H, lmax, D) zero-padded (differentiable)."""
    B = offsets.numel() - 1
    lengths = offsets.diff()
    rows = torch.repeat_interleave(torch.arange(B, device=x.device), lengths)
    cols = torch.arange(x.shape[0], device=x.device) - offsets[:-1].repeat_interleave(lengths)
    out = x.new_zeros(B, lmax, x.shape[1], x.shape[2]).index_put((rows, cols), x)
    return out.transpose(1, 2)


def anchor_rows(which, q, k, v, q_off, kv_off, q_max, kv_max, causal, flops, iters,
                gpu_time: bool = False) -> list[Row]:
    import torch.nn.functional as F

    rows = []
    if "sdpa" in which:
        def sdpa():
            qp, kp, vp = _padded(q, q_off, q_max), _padded(k, kv_off, kv_max), _padded(v, kv_off, kv_max)
            return F.scaled_dot_product_attention(qp, kp, vp, is_causal=causal)
        rows.append(measure("padded SDPA (pad inside the timing)", sdpa, (q, k, v), flops, iters, gpu_time))
        qp, kp, vp = (t.detach().requires_grad_() for t in (
            _padded(q, q_off, q_max), _padded(k, kv_off, kv_max), _padded(v, kv_off, kv_max)))
        rows.append(measure("padded SDPA (pre-padded)", lambda: F.scaled_dot_product_attention(
            qp, kp, vp, is_causal=causal), (qp, kp, vp), flops, iters, gpu_time))
        del qp, kp, vp
    if "varlen" in which:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError as exc:
            rows.append(Row("varlen_attn", None, None, None, None, None, f"absent: {exc}"))
        else:
            cq, ck = q_off.to(torch.int32), kv_off.to(torch.int32)
            window = (-1, 0) if causal else (-1, -1)
            rows.append(measure("varlen_attn", lambda: varlen_attn(
                q, k, v, cq, ck, q_max, kv_max, window_size=window), (q, k, v), flops, iters, gpu_time))
    if "nested" in which:
        def nested():
            nq, nk, nv = (torch.nested.nested_tensor_from_jagged(t, off).transpose(1, 2)
                          for t, off in ((q, q_off), (k, kv_off), (v, kv_off)))
            return F.scaled_dot_product_attention(nq, nk, nv, is_causal=causal).transpose(1, 2).values()
        rows.append(measure("nested jagged SDPA", nested, (q, k, v), flops, iters, gpu_time))
    if "flex" in which:
        rows.append(_flex_row(q, k, v, q_off, kv_off, causal, flops, iters, gpu_time))
    return rows


def _flex_row(q, k, v, q_off, kv_off, causal, flops, iters, gpu_time: bool = False) -> Row:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as exc:
        return Row("FlexAttention", None, None, None, None, None, f"absent: {exc}")
    dev = q.device
    doc_q = torch.repeat_interleave(torch.arange(q_off.numel() - 1, device=dev), q_off.diff())
    doc_k = torch.repeat_interleave(torch.arange(kv_off.numel() - 1, device=dev), kv_off.diff())
    pos_q = torch.arange(q.shape[0], device=dev) - q_off[doc_q]
    pos_k = torch.arange(k.shape[0], device=dev) - kv_off[doc_k]

    def mask_mod(b, h, i, j):
        same = doc_q[i] == doc_k[j]
        return (same & (pos_k[j] <= pos_q[i])) if causal else same

    try:
        mask = create_block_mask(mask_mod, None, None, q.shape[0], k.shape[0], device=dev, _compile=True)
        flex = torch.compile(flex_attention)
    except Exception as exc:
        return Row("FlexAttention", None, None, None, None, None, f"{type(exc).__name__}: {str(exc)[:80]}")
    packed = [t.detach().transpose(0, 1).unsqueeze(0).requires_grad_() for t in (q, k, v)]
    return measure("FlexAttention (document mask)", lambda: flex(*packed, block_mask=mask),
                   packed, flops, iters, gpu_time)


TUNE_CANDIDATES = {
    "fwd": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 4),
            (128, 128, 8, 2), (64, 128, 4, 3)],
    "dkdv": [(64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 128, 8, 3),
             (128, 128, 8, 2)],
    "dq": [(128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 8, 2), (128, 128, 8, 2),
           (128, 64, 8, 3)],
}


#: a block in which the Triton backend runs its Triton kernels only (the Gluon forward and
#: backward off), restored after
_TRITON_ONLY = partial(mock.patch.dict, os.environ, {"GEMCORE_GLUON_ATTENTION": "0"})
#: a block in which the Triton backend runs its Triton backward (the Gluon backward off)
_TRITON_BACKWARD = partial(mock.patch.dict, os.environ, {"GEMCORE_GLUON_ATTENTION_BWD": "0"})


def tune(forward: Callable[[], torch.Tensor], inputs, head_dim: int, flops: float,
         activation: str = "softmax", gpu_time: bool = False) -> None:
    """Sweep each kernel's candidate tiles (the others at their current best) and install the
    fastest for this head dim in ``jagged_attention_triton.CONFIGS`` (softmax) or
    ``POINTWISE_CONFIGS`` (the other activations); prints every timing. ``gpu_time`` as in
    :func:`measure`, so the tune's figures compare with the rows after it. The Triton kernels'
    tiles are swept with the Gluon (Hopper) kernels off: where those run, the Triton tiles only
    serve the inputs outside their scope."""
    from gemcore.kernels import jagged_attention_triton as jt

    bucket = jt.head_dim_bucket(head_dim)
    table = jt.CONFIGS if activation == "softmax" else jt.POINTWISE_CONFIGS
    timing = dict(launch_hidden=gpu_time, spacer_cycles=GPU_TIME_SPACER_CYCLES)
    grad = torch.randn_like(forward())
    for kernel, candidates in TUNE_CANDIDATES.items():
        timings = {}
        for cand in candidates:
            cfg = jt.TileConfig(*cand)
            with jt.pinned_configs(**{kernel: cfg}), _TRITON_ONLY():
                try:
                    if kernel == "fwd":
                        with torch.no_grad():
                            ms = median_ms(forward, 5, warmup=1, **timing)
                        tflops = flops / ms / 1e9
                    else:
                        ms = median_ms(lambda: torch.autograd.grad(forward(), inputs, grad), 5, warmup=1,
                                       **timing)
                        tflops = 3.5 * flops / ms / 1e9
                except Exception as exc:  # a tile that does not fit this GPU
                    print(f"tune {kernel} {cand}: {type(exc).__name__}")
                    continue
            timings[cand] = ms
            print(f"tune {kernel} {cand}: {ms:.3f} ms ({'fwd' if kernel == 'fwd' else 'fwd+bwd'} {tflops:.1f} TFLOP/s)")
        if timings:
            best = min(timings, key=timings.get)
            table[(kernel, bucket)] = jt.TileConfig(*best)
            print(f"tune {kernel}: best {best}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=WORKLOADS, default="dense95")
    p.add_argument("--activation", default=None,
                   help="gemcore's activation (default: softmax and silu for self-attention, gelu_tanh for cross)")
    p.add_argument("--anchors", default="sdpa,varlen",
                   help=f"comma-separated anchors from {ANCHORS}, 'all' or 'none'")
    p.add_argument("--pma", type=int, default=0, help="also time pooled attention with this many queries")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--validated", action="store_true",
                   help="also time gemcore with its offset checks on (one host sync per call)")
    p.add_argument("--tune", action="store_true",
                   help="first sweep the tile configs of each kernel on this workload and use the fastest")
    p.add_argument("--gpu-time", action="store_true",
                   help="time every row (gemcore and anchors) on the GPU alone: each call waits behind a "
                        "spacer kernel, so the host's launch work, hidden in a running model, is not counted")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    from gemcore.kernels.jagged_attention import jagged_attention
    from gemcore.kernels.jagged_attention_triton import backward_kernel, forward_kernel

    if not torch.cuda.is_available():
        print("gem bench attention needs a CUDA GPU")
        return 2
    dev, dtype, D = torch.device("cuda"), torch.bfloat16, 128
    H = MODEL_SHAPE["heads"] if args.workload == "model" else 4
    q_lens, kv_lens = workload_lengths(args.workload)
    num_targets = (torch.full_like(q_lens, MODEL_SHAPE["candidates"]).to(dev)
                   if args.workload == "model" else None)
    cross = kv_lens is not None
    causal = not cross
    activations = [args.activation] if args.activation else (["gelu_tanh"] if cross else ["softmax", "silu"])
    q_off = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).to(dev)
    kv_off = q_off if not cross else torch.nn.functional.pad(kv_lens.cumsum(0), (1, 0)).to(dev)
    gen = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(int(q_off[-1]), H, D, device=dev, dtype=dtype, generator=gen).requires_grad_()
    k = torch.randn(int(kv_off[-1]), H, D, device=dev, dtype=dtype, generator=gen).requires_grad_()
    v = torch.randn(int(kv_off[-1]), H, D, device=dev, dtype=dtype, generator=gen).requires_grad_()
    q_max = int(q_lens.max())
    kv_max = int(kv_lens.max()) if cross else q_max
    flops = useful_fwd_flops(q_lens, kv_lens, H, D, causal)
    rows = []
    if args.tune:
        kw = dict(kv_offsets=kv_off if cross else None, activation=activations[0], causal=causal,
                  max_seqlen=max(q_max, kv_max), backend="triton", num_targets=num_targets)
        tune(lambda: jagged_attention(q, k, v, q_off, validate=False, **kw), (q, k, v), D, flops,
             activations[0], args.gpu_time)
    for act in activations:
        kw = dict(kv_offsets=kv_off if cross else None, activation=act, causal=causal,
                  max_seqlen=max(q_max, kv_max), backend="triton", num_targets=num_targets)
        # as the model calls it: offsets valid by construction, no host sync (varlen_attn's terms)
        fwd = forward_kernel(q, k, v, q_off, kw["kv_offsets"], num_targets, causal=causal, activation=act)
        bwd = backward_kernel(q, k, v, q_off, kw["kv_offsets"], num_targets, causal=causal)
        variants = [(f"{fwd} fwd, {bwd} bwd", contextlib.nullcontext)]
        # the Triton kernels beside the Gluon ones, same run: the backward alone, then both
        if bwd != "triton" and fwd != "triton":
            variants.append((f"{fwd} fwd, triton bwd", _TRITON_BACKWARD))
        if (fwd, bwd) != ("triton", "triton"):
            variants.append(("triton fwd, triton bwd", _TRITON_ONLY))
        for label, context in variants:
            with context():
                rows.append(measure(f"gemcore {act} ({label})", lambda kw=kw: jagged_attention(
                    q, k, v, q_off, validate=False, **kw), (q, k, v), flops, args.iters, args.gpu_time))
        if args.validated:
            rows.append(measure(f"gemcore {act}, offsets checked (1 sync)", lambda kw=kw: jagged_attention(
                q, k, v, q_off, **kw), (q, k, v), flops, args.iters, args.gpu_time))
    which = ANCHORS if args.anchors == "all" else () if args.anchors == "none" else tuple(args.anchors.split(","))
    rows += anchor_rows(which, q, k, v, q_off, kv_off, q_max, kv_max, causal, flops, args.iters,
                        args.gpu_time)
    if num_targets is not None and "flex" in which:
        from gemcore.kernels.torch_attention import flex_attention_jagged

        rows.append(measure("FlexAttention (target mask)", lambda: flex_attention_jagged(
            q, k, v, q_off, num_targets=num_targets), (q, k, v), flops, args.iters, args.gpu_time))
    if args.pma:
        pq = torch.randn(args.pma, H, D, device=dev, dtype=dtype, generator=gen).requires_grad_()
        pma_flops = useful_fwd_flops(torch.full_like(kv_lens if cross else q_lens, args.pma),
                                     kv_lens if cross else q_lens, H, D, False)
        for act in activations:
            rows.append(measure(f"gemcore PMA {act} (Nq={args.pma})", lambda act=act: jagged_attention(
                pq, k, v, None, kv_offsets=kv_off, activation=act, backend="triton", max_seqlen=kv_max,
                validate=False), (pq, k, v), pma_flops, args.iters, args.gpu_time))
    meta = dict(workload=args.workload, device=torch.cuda.get_device_name(), torch=torch.__version__,
                tokens_q=int(q_off[-1]), tokens_kv=int(kv_off[-1]), batch=int(q_lens.numel()),
                padding_ratio=round(q_lens.numel() * q_max / int(q_off[-1]), 2), H=H, D=D,
                dtype="bf16", causal=causal, useful_fwd_tflop=flops / 1e12,
                candidates=MODEL_SHAPE["candidates"] if num_targets is not None else 0,
                timing="gpu (spacer)" if args.gpu_time else "per call from an idle GPU")
    # the Gluon kernels' work lists are built once per offsets tensor (a model's layers share one
    # batch's), so the rows' repeated calls reuse them: what one build costs, for the record
    from gemcore.kernels.jagged_work_list import work_list

    meta["work_list_build_us"] = round(1e3 * median_ms(
        lambda: work_list(q_off, q_max, False, n_rows=meta["tokens_q"]), args.iters,
        launch_hidden=args.gpu_time), 1)
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    if args.json:
        print(json.dumps(dict(meta, rows=[asdict(r) for r in rows])))
        return 0
    print(" ".join(f"{k}={v}" for k, v in meta.items()))
    print(f"{'implementation':58s} {'fwd ms':>8s} {'f+b ms':>8s} {'fwd TF/s':>9s} {'f+b TF/s':>9s} {'peak GB':>8s}")
    for r in rows:
        def fmt(x, w, p=2):
            return f"{x:{w}.{p}f}" if x is not None else f"{'-':>{w}s}"
        print(f"{r.name:58s} {fmt(r.fwd_ms, 8)} {fmt(r.fwdbwd_ms, 8)} {fmt(r.fwd_tflops, 9, 1)} "
              f"{fmt(r.fwdbwd_tflops, 9, 1)} {fmt(r.peak_gb, 8)} {r.note}")
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(_parser)
    raise SystemExit(run(_parser.parse_args()))
