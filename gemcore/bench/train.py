"""End-to-end training step: gemcore (jagged, jfa, bbs, bf16/mxfp8/fp8) against PyTorch peers.

``gem bench train --device cuda --workload heavytail|dense95 [--steps N] [--configs ...] [--json]``

Peers: ``padded`` (SDPA on zero-padded batches), ``varlen`` (torch's ``varlen_attn``, plain causal:
candidates also see earlier candidates) and ``flex`` (compiled FlexAttention with the exact
target-aware mask), each in the same model through the attention hook. All configurations run
softmax attention; ``+compile`` compiles, in any of them, each transformer block whole
(``--compile-scope block``, the default: the attention is an opaque custom op inside the graph) or
only its dense parts (``--compile-scope dense``: MLP and norms). ``+graphs`` (after ``+compile`` if
both) replays each step's forward and backward as a CUDA graph per padded batch shape
(:mod:`gemcore.cuda_graphs`); ``x bf16`` of ``bf16+compile+graphs`` is over ``bf16+compile``, and
the ``x peer`` column's peers are the torch-native configurations without ``+graphs``.

Every configuration trains the same GEM-style model (same initial weights) on the same synthetic
data for the same number of steps. Reported per configuration: tokens/s (real tokens), samples/s,
MFU (model FLOPs on real tokens / time / peak), peak memory, held-out loss after the N steps on a
fixed set of users, and host synchronisations per step (torch.profiler); ``x bf16`` is tokens/s over
the bf16 configuration of the same kind (``fp8+compile`` over ``bf16+compile``). For the best gemcore
configuration, GEM's "local MFU" table: each layer type timed alone, forward + backward.
``--repeats N`` times the same steps N times per configuration and reports the median with the
passes' spread, marking a ratio whose configurations' passes overlap (inside the noise);
``--profile`` adds each configuration's GPU kernel time per step by kind
(:mod:`gemcore.bench.step_profile`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import torch

from gemcore.bench.timing import queued_gpu_ms
from gemcore.cuda_graphs import GraphedForwardBackward
from gemcore.config import AttentionConfig, ModelConfig, PrecisionConfig
from gemcore.data import make_synthetic
from gemcore.data.workloads import WORKLOAD_MAX_LEN
from gemcore.kernels.fp8_block import MATMUL_BACKENDS
from gemcore.metrics import peak_flops
from gemcore.model import GemModel
from gemcore.plugin_manager import create_plugin_manager

WORKLOADS = {name: WORKLOAD_MAX_LEN[name] for name in ("heavytail", "dense95")}  #: workload -> longest history
CONFIGS = ("padded", "bf16", "mxfp8", "fp8", "bf16+compile", "mxfp8+compile", "fp8+compile",
           "varlen", "varlen+compile", "flex", "flex+compile")
#: precision policy of each configuration's name before "+" (bf16 for the rest)
PRECISIONS = {"mxfp8": "mxfp8", "fp8": "fp8_block"}
#: configurations whose attention is a torch-native peer (attention impl = the name before "+")
PEERS = ("varlen", "flex")
#: what ``+compile`` compiles: each block whole (attention inside the graph) or its MLP and norms
COMPILE_SCOPES = ("block", "dense")


def config_parts(config: str) -> tuple[str, tuple[str, ...]]:
    """(kind, suffixes) of a configuration name: ``"fp8+compile+graphs"`` -> ``("fp8", ("compile", "graphs"))``.

    Valid: a name of :data:`CONFIGS`, or one of them but ``padded`` with ``+graphs`` appended."""
    base = config.removesuffix("+graphs")
    if base not in CONFIGS or (base == "padded" and base != config):
        raise ValueError(f"--configs: unknown {config}; choose from {', '.join(CONFIGS)}, each but padded "
                         f"optionally with +graphs")
    kind, *suffixes = config.split("+")
    return kind, tuple(suffixes)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="heavytail")
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed passes over the same steps per configuration: tokens/s is their median, "
                        "and the spread of the passes says which ratios are inside the run-to-run noise")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--users", type=int, default=64, help="users (samples) per step")
    p.add_argument("--max-len", type=int, default=0, help="override the workload's max history length")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--items", type=int, default=200_000, help="item-id vocabulary")
    p.add_argument("--candidates", type=int, default=16, help="candidates per user")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma list of {', '.join(CONFIGS)}; any but padded may end in +graphs (CUDA only)")
    p.add_argument("--fp8-matmul", default="auto", choices=MATMUL_BACKENDS,
                   help="the fp8 configurations' GEMM backend (precision.fp8_matmul)")
    p.add_argument("--fp8-fused-mlp", action="store_true",
                   help="the fp8 configurations' SwiGLU MLPs fused with their FP8 casts (precision.fp8_fused_mlp)")
    p.add_argument("--fp8-keep", default="router,head",
                   help="the fp8 configurations' module-name parts kept in bf16, comma list (precision.fp8_keep)")
    p.add_argument("--compile-scope", default="block", choices=COMPILE_SCOPES,
                   help="what +compile compiles: each block whole, or its MLP and norms only")
    p.add_argument("--profile", action="store_true",
                   help="also profile the timed steps once more per configuration: GPU kernel time by kind "
                        "(CUDA only)")
    p.add_argument("--profile-top", type=int, default=0, metavar="N",
                   help="with --profile: also list each configuration's N costliest kernels")
    p.add_argument("--no-local-mfu", action="store_true")
    p.add_argument("--json", action="store_true")


@dataclass
class Result:
    config: str
    tokens_per_s: float = 0.0
    samples_per_s: float = 0.0
    mfu: float | None = None
    peak_mem_gb: float = 0.0
    heldout_loss: float = float("nan")
    syncs_per_step: float | None = None
    step_ms: float = 0.0
    gpu_ms_by_kind: dict | None = None
    top_kernels: list | None = None  # --profile-top
    kernels_per_step: float | None = None  # --profile
    tokens_per_s_runs: list | None = None  # one per timed pass (--repeats)
    graphs: int | None = None  # +graphs: CUDA graphs captured
    padding: float | None = None  # +graphs: share of the tokens trained on that were padding
    error: str = ""


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batches(data, users: int, steps: int, order: str, seed: int, manager):
    """Per-step lists of user indices: random sharding or the bbs sampler (one rank)."""
    name = "bbs" if order == "bbs" and "bbs" in manager.implementations("data") else "random"
    sampler = manager.resolve("data", name).factory(data.lengths, batch_size=users, world_size=1, rank=0,
                                                    seed=seed, drop_last=True)
    it = iter(sampler)
    return [next(it) for _ in range(steps)], name


def build(config: str, model_cfg: ModelConfig, manager, device, seed: int, fp8: dict | None = None,
          compile_scope: str = "block"):
    """(model-like object with .loss(batch) and .parameters(), the GemModel inside, description).

    ``fp8``: the ``fp8`` configurations' :class:`PrecisionConfig` fields (``fp8_matmul``,
    ``fp8_fused_mlp``, ``fp8_keep``; defaults where absent); ``compile_scope`` what ``+compile``
    compiles (:data:`COMPILE_SCOPES`)."""
    if compile_scope not in COMPILE_SCOPES:
        raise ValueError(f"compile_scope must be one of {COMPILE_SCOPES}, got {compile_scope!r}")
    torch.manual_seed(seed)
    peer, suffixes = config_parts(config)
    if peer in PEERS:
        attention_name = peer
    else:
        attention_name = "jfa" if "jfa" in manager.implementations("attention") else "reference"
    attention = manager.resolve("attention", attention_name).factory(
        AttentionConfig(impl=attention_name, activation="softmax"))
    model = GemModel(model_cfg, attention)
    precision_name = PRECISIONS.get(peer, "bf16")
    policy = manager.resolve("precision", precision_name).factory(
        PrecisionConfig(impl=precision_name, **(fp8 or {})))
    if config == "padded":
        from gemcore.bench.padded import PaddedGemModel

        return PaddedGemModel(model.to(device)), model, policy, "padded SDPA + bf16 autocast + random"
    model = policy.apply(model).to(device)
    if "compile" in suffixes and compile_scope == "block":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, dynamic=True)
    elif "compile" in suffixes:
        for block in model.blocks:  # the dense parts; the attention runs eagerly between them
            block.mlp = torch.compile(block.mlp, dynamic=True)
            block.attn_norm = torch.compile(block.attn_norm, dynamic=True)
            block.mlp_norm = torch.compile(block.mlp_norm, dynamic=True)
    return model, model, policy, f"jagged {attention_name} + {precision_name}"


def train_config(config, model_cfg, data, heldout, steps_idx, warmup, device, manager, seed,
                 fp8: dict | None = None, compile_scope: str = "block", profile: bool = False,
                 repeats: int = 1, profile_top: int = 0) -> Result:
    graphs = "graphs" in config_parts(config)[1]
    if graphs and device.type != "cuda":
        raise ValueError(f"{config}: +graphs replays CUDA graphs; it needs --device cuda")
    runner, gem, policy, _ = build(config, model_cfg, manager, device, seed, fp8, compile_scope)
    opt = torch.optim.AdamW(runner.parameters(), lr=1e-3, fused=device.type == "cuda")
    batches = [data.__getitems__(idx).to(device) for idx in steps_idx]
    peak = peak_flops(device)

    def loss_of(batch):
        with policy.autocast(device.type):
            return runner.loss(batch)

    graphed = GraphedForwardBackward(loss_of, runner.parameters()) if graphs else None

    def step(batch):
        if graphed is not None:  # forward + backward replayed; p.grad set
            loss = graphed(batch)
        else:
            loss = loss_of(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        opt.step()
        return loss

    for batch in batches[:warmup]:
        step(batch)
    if graphs:  # steady state: every timed batch's shape captured (no training happens here)
        for batch in batches[warmup:]:
            graphed.prepare(batch)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timed = batches[warmup:]
    passes = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for batch in timed:
            step(batch)
        _sync(device)
        passes.append(time.perf_counter() - t0)
    tokens = sum(b.num_tokens for b in timed)
    rates = [tokens / t for t in passes]  # tokens/s of each pass; the result is their median
    elapsed = tokens / statistics.median(rates) if tokens else statistics.median(passes)
    flops = sum(gem.flops(b.num_tokens, b.sum_sq_len) for b in timed)
    result = Result(config, tokens_per_s=tokens / elapsed,
                    samples_per_s=sum(b.batch_size for b in timed) / elapsed,
                    mfu=flops / elapsed / peak if peak else None,
                    peak_mem_gb=torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0,
                    step_ms=1e3 * elapsed / max(1, len(timed)),
                    tokens_per_s_runs=rates)
    if graphs:
        result.graphs = len(graphed.graphs)
        result.padding = graphed.padding_fraction
    result.syncs_per_step = count_syncs(step, timed[:2], device)
    with torch.no_grad(), policy.autocast(device.type):
        result.heldout_loss = float(runner.loss(heldout.to(device)))
    if profile and device.type == "cuda":
        from gemcore.bench.step_profile import profile_steps

        result.gpu_ms_by_kind, result.top_kernels, result.kernels_per_step = profile_steps(
            lambda: [step(b) for b in timed], len(timed), profile_top)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _sync_calls(run) -> int:
    """cudaStreamSynchronize / cudaDeviceSynchronize / cudaEventSynchronize calls seen by
    torch.profiler while ``run()`` and one final ``torch.cuda.synchronize()`` execute."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    names = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
    return sum(e.count for e in prof.key_averages() if e.key in names)


def count_syncs(step, batches, device) -> float | None:
    """Host synchronisations per step (cudaStreamSynchronize, cudaDeviceSynchronize, blocking D2H):
    those of a profiled run of ``batches`` minus those of a profiled empty run (the final
    synchronize and whatever the profiler itself issues)."""
    if device.type != "cuda" or not batches:
        return None
    baseline = _sync_calls(lambda: None)
    count = _sync_calls(lambda: [step(b) for b in batches])
    return max(0, count - baseline) / len(batches)


def local_mfu(gem: GemModel, policy, batch, device, reps: int = 5) -> list[dict]:
    """GEM's local MFU: each layer type alone, forward + backward, on this batch's shapes; timed
    back to back (host launch work included: what a layer costs when the host is the limit) and,
    on CUDA, on the GPU alone (:func:`timing.queued_gpu_ms`)."""
    with torch.no_grad():
        x, seq_offsets, _, _ = gem.embed(batch)
    x = x.requires_grad_(True)
    T, hidden = x.shape
    block = gem.blocks[0]
    H = block.num_heads
    nt = batch.cand_offsets.diff()
    # q, k and v as three tensors: the kernel's work alone (in the model they are views of the
    # qkv projection, whose gradient assembly belongs to the projection's backward)
    q, k, v = (torch.randn(T, H, hidden // H, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    ratio = gem.cfg.mlp_ratio
    parts = {
        "attention (jagged kernel)": (lambda: block.attention(q, k, v, seq_offsets, causal=True,
                                                              num_targets=nt, max_seqlen=batch.max_len),
                                      3 * 2.0 * batch.sum_sq_len * hidden),
        "qkv + out projections": (lambda: block.out(block.qkv(x)[:, :hidden]), 6.0 * T * 4 * hidden * hidden),
        "MLP": (lambda: block.mlp(x), 6.0 * T * 3 * ratio * hidden * hidden),
        "RMSNorm x2": (lambda: block.mlp_norm(block.attn_norm(x)), None),
    }
    rows = []
    peak = peak_flops(device)
    for name, (fn, flops) in parts.items():
        grads = {}

        def run_once():
            for t in (x, q, k, v, *block.parameters()):
                t.grad = None
            with policy.autocast(device.type):
                out = fn()
            if out.shape not in grads:
                grads[out.shape] = torch.ones_like(out)
            out.backward(grads[out.shape])
        for _ in range(2):
            run_once()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            run_once()
        _sync(device)
        ms = 1e3 * (time.perf_counter() - t0) / reps
        gpu_ms = queued_gpu_ms(run_once, reps, ms) if device.type == "cuda" else None
        rows.append({"layer": name, "ms_per_block": ms,
                     "ms_per_step": ms * len(gem.blocks),
                     "tflops": flops / ms / 1e9 if flops else None,
                     "local_mfu": (flops / (ms / 1e3) / peak) if (flops and peak) else None,
                     "gpu_ms_per_block": gpu_ms,
                     "gpu_tflops": flops / gpu_ms / 1e9 if (flops and gpu_ms) else None})
    return rows


def spread(values: list[float] | None) -> float | None:
    """(max - min) / median of ``values`` (tokens/s of the timed passes); None without two."""
    if not values or len(values) < 2:
        return None
    return (max(values) - min(values)) / statistics.median(values)


def ranges_overlap(a: list[float] | None, b: list[float] | None) -> bool | None:
    """Whether the [min, max] ranges of two configurations' passes overlap (their ratio is then
    inside the run-to-run noise); None unless both have two passes or more."""
    if not a or not b or len(a) < 2 or len(b) < 2:
        return None
    return min(a) <= max(b) and min(b) <= max(a)


def _is_torch_native(kind: str, suffixes: tuple[str, ...]) -> bool:
    """Whether a configuration is a torch-native peer: ``varlen``, ``flex`` or ``padded``, without
    gemcore's CUDA-graph step (``+graphs``)."""
    return kind in PEERS + ("padded",) and "graphs" not in suffixes


def _bf16_twin(config: str) -> str:
    """The bf16 configuration a configuration is compared with: ``fp8+compile`` -> ``bf16+compile``,
    ``bf16+compile+graphs`` -> ``bf16+compile`` (what the graphs add), ``fp8+compile+graphs`` ->
    ``bf16+compile+graphs``."""
    kind, suffixes = config_parts(config)
    if kind == "bf16" and suffixes[-1:] == ("graphs",):
        suffixes = suffixes[:-1]
    return "+".join(("bf16", *suffixes))


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is available")
    if args.profile and device.type != "cuda":
        raise ValueError("--profile profiles CUDA kernels: it needs --device cuda")
    if args.profile_top < 0 or (args.profile_top and not args.profile):
        raise ValueError(f"--profile-top must be a count >= 0 given with --profile, got {args.profile_top}"
                         + ("" if args.profile else " without --profile"))
    for name in ("steps", "users", "hidden", "heads", "blocks", "items", "candidates", "repeats"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name} must be positive, got {getattr(args, name)}")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for config in configs:
        config_parts(config)
    fp8 = {"fp8_matmul": args.fp8_matmul, "fp8_fused_mlp": args.fp8_fused_mlp,
           "fp8_keep": [part.strip() for part in args.fp8_keep.split(",") if part.strip()]}
    manager = create_plugin_manager()
    max_len = args.max_len or WORKLOADS[args.workload]
    model_cfg = ModelConfig(num_items=args.items, hidden=args.hidden, num_heads=args.heads,
                            num_blocks=args.blocks, mlp_ratio=4)
    total_steps = args.steps + args.warmup
    data = make_synthetic(num_users=args.users * (total_steps + 2), num_items=args.items, num_actions=4,
                          max_len=max_len, num_candidates=args.candidates, num_clusters=64,
                          kind=args.workload, seed=0)
    heldout = data.__getitems__(list(range(args.users)))  # fixed users for the loss comparison
    results, order_used = [], {}
    for config in configs:
        order = "random" if config == "padded" else "bbs"
        steps_idx, order_used[config] = _batches(data, args.users, total_steps, order, 0, manager)
        try:
            results.append(train_config(config, model_cfg, data, heldout, steps_idx, args.warmup, device,
                                        manager, seed=0, fp8=fp8, profile=args.profile, repeats=args.repeats,
                                        profile_top=args.profile_top,
                                        compile_scope=args.compile_scope))
        except Exception as exc:  # noqa: BLE001 - one failing configuration is reported, not fatal
            results.append(Result(config, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    local = []
    if not args.no_local_mfu:
        _, gem, policy, _ = build("bf16", model_cfg, manager, device, 0)
        local = local_mfu(gem, policy, data.__getitems__(list(range(args.users))).to(device), device)
        bf16 = next((r for r in results if r.config == "bf16" and not r.error), None)
        for row in local:
            row["share_of_step"] = row["ms_per_step"] / bf16.step_ms if bf16 else None
    dense = GemModel(ModelConfig(**{**model_cfg.__dict__, 'num_items': 2}), lambda *a, **k: None).dense_parameters()
    report = {"workload": args.workload, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "model": {"hidden": args.hidden, "heads": args.heads, "head_dim": args.hidden // args.heads,
                        "blocks": args.blocks, "mlp_ratio": 4, "items": args.items,
                        "dense_params": dense, "embedding_params": (args.items + 5 + 32) * args.hidden},
              "users_per_step": args.users, "max_len": max_len, "steps": args.steps, "fp8": fp8,
              "sampler": order_used, "results": [r.__dict__ for r in results], "local_mfu": local}
    base = next((r for r in results if r.config == "padded" and not r.error), None)
    by_config = {r.config: r for r in results if not r.error}
    peers = [r.tokens_per_s for r in results if not r.error
             and _is_torch_native(*config_parts(r.config))]
    for r in report["results"]:
        r["speedup_vs_best_peer"] = (r["tokens_per_s"] / max(peers)) if peers and not r["error"] else None
        r["speedup_vs_padded"] = (r["tokens_per_s"] / base.tokens_per_s) if base and not r["error"] else None
        r["loss_vs_padded"] = ((r["heldout_loss"] / base.heldout_loss - 1) if base and not r["error"] else None)
        bf16 = by_config.get(_bf16_twin(r["config"]))
        r["speedup_vs_bf16"] = (r["tokens_per_s"] / bf16.tokens_per_s) if bf16 and not r["error"] else None
        r["spread"] = spread(r["tokens_per_s_runs"]) if not r["error"] else None
        r["vs_bf16_inside_noise"] = (ranges_overlap(r["tokens_per_s_runs"], bf16.tokens_per_s_runs)
                                     if bf16 and not r["error"] and r["config"] != bf16.config else None)
        r["loss_vs_bf16"] = (r["heldout_loss"] / bf16.heldout_loss - 1) if bf16 and not r["error"] else None
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"gem bench train: {report['device']}, workload {args.workload} (max_len {max_len}), "
          f"{args.users} users/step, {args.steps} timed steps; model: {args.blocks} blocks, hidden "
          f"{args.hidden}, {args.heads} heads x {args.hidden // args.heads}, {dense / 1e6:.0f}M dense params")
    print(f"{'config':20s} {'tok/s':>11s} {'spread':>7s} {'samples/s':>10s} {'MFU':>7s} {'step ms':>8s} {'mem GB':>7s} "
          f"{'loss':>8s} {'dloss':>7s} {'x pad':>6s} {'x peer':>6s} {'x bf16':>7s} {'syncs':>6s}")
    for r in report["results"]:
        if r["error"]:
            print(f"{r['config']:20s} FAILED {r['error']}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        dl = f"{100 * r['loss_vs_padded']:+.2f}%" if r["loss_vs_padded"] is not None else "-"
        sp = f"{r['speedup_vs_padded']:.2f}" if r["speedup_vs_padded"] else "-"
        bp = f"{r['speedup_vs_best_peer']:.2f}" if r["speedup_vs_best_peer"] else "-"
        sy = f"{r['syncs_per_step']:.1f}" if r["syncs_per_step"] is not None else "-"
        xb = f"{r['speedup_vs_bf16']:.2f}" if r["speedup_vs_bf16"] else "-"
        if r["vs_bf16_inside_noise"]:
            xb += "~"
        sd = f"{100 * r['spread']:.1f}%" if r["spread"] is not None and args.repeats > 1 else "-"
        print(f"{r['config']:20s} {r['tokens_per_s']:11,.0f} {sd:>7s} {r['samples_per_s']:10,.1f} {mfu:>7s} "
              f"{r['step_ms']:8.1f} {r['peak_mem_gb']:7.1f} {r['heldout_loss']:8.4f} {dl:>7s} {sp:>6s} {bp:>6s} "
              f"{xb:>7s} {sy:>6s}")
    for r in report["results"]:
        if not r["error"] and r["graphs"] is not None:
            print(f"{r['config']}: {r['graphs']} CUDA graphs captured; padding {100 * r['padding']:.1f}% of the tokens "
                  f"trained on (tok/s and MFU count real tokens only)")
    if args.repeats > 1:
        print(f"tok/s: median of {args.repeats} timed passes; spread: (max - min) / median of the passes; "
              f"~: the passes of the two configurations overlap (inside the run-to-run noise)")
    profiled = [r for r in report["results"] if not r["error"] and r["gpu_ms_by_kind"]]
    if profiled:
        from gemcore.bench.step_profile import format_breakdown, format_top

        print("GPU kernel time per step by kind, ms (torch.profiler, the timed steps once more; beside the timed step):")
        for r in profiled:
            print(f"  {r['config']:20s} {format_breakdown(r['gpu_ms_by_kind'], r['step_ms'], r['kernels_per_step'])}")
        for r in profiled:
            if r["top_kernels"]:
                print(f"  {r['config']}: the {len(r['top_kernels'])} costliest kernels (per step)")
                for line in format_top(r["top_kernels"]):
                    print(f"    {line}")
    if local:
        print("local MFU (bf16, one block's layer alone, fwd+bwd; calls back to back, and on the GPU alone):")
        for row in local:
            tf = f"{row['tflops']:.0f} TFLOP/s" if row["tflops"] else ""
            lm = f"{100 * row['local_mfu']:.1f}%" if row["local_mfu"] else ""
            share = f"{100 * row['share_of_step']:.0f}% of step" if row.get("share_of_step") else ""
            gpu = (f"GPU alone {row['gpu_ms_per_block']:.3f} ms" + (f" = {row['gpu_tflops']:.0f} TFLOP/s"
                   if row["gpu_tflops"] else "")) if row.get("gpu_ms_per_block") else ""
            print(f"  {row['layer']:28s} {row['ms_per_step']:8.2f} ms/step {tf:>14s} {lm:>7s} {share:>13s}  {gpu}")
    return 0
