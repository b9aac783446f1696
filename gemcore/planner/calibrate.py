"""``gem plan --calibrate``: measure this machine's rates and plan with them instead of datasheets.

Everything is measured the way the run computes, in the run's dtype (bf16 on CUDA, fp32 on CPU):

* GEMM: a large square product (the peak) and, given a model, its own linear layers forward +
  backward at one micro-batch's token count (the rate the step's matmuls get);
* attention: :func:`gemcore.kernels.jagged_attention` with the run's backend, causal with the
  candidates as targets, forward + backward, on the run's sequence lengths (given, or drawn from the
  model's length law). The same count of length-1 sequences gives the per-sequence cost (a loop over
  sequences pays it), the rest the rate per counted FLOP (the planner's 3.5·H·(d_qk+d_v)·ΣL²);
* elementwise: ``a * b`` on one micro-batch's activation (T, hidden), bytes read + written per s;
* optimizer: gradient clipping + foreach AdamW on one flat float32 weight of the rank's share of
  the model's weights, in bytes the planner counts per weight per s (the optimizer state streams
  at its own size: on a CPU the activation-sized ``a * b`` ran from cache at 54-124 GB/s);
* host overhead: one- and three-block GemModel train steps (embeddings, head, loss, clipping,
  AdamW) on one tiny sequence (on CUDA one head of the run's head dim at the run's mean length,
  so the attention takes the run's kernels: :func:`_tiny_shape`): the slope per block (per layer)
  and the rest (per step) — the time that does not scale with size — and, from the host clock at
  the phase borders, the forward's share of the per-layer part and the per-step part after the
  backward (the planner plays host and GPU against each other phase by phase); under a process
  group the same model wrapped in FSDP2 the way the run is, for what sharding adds per layer and
  per step beyond the collectives' bytes and latencies;
* under a process group (``torchrun``): all-gather and reduce-scatter at the size FSDP2 moves per
  block (and at 1 KiB: the latency), and an all-reduce. Without one the link figures stay the
  GPU table's.

Timing (:func:`_timed`): on a CPU the mean time per call over a window in which every rank of the
process group runs the same measurement at once, as the run's ranks compute at once (sharing the
cores' caches and memory bandwidth, and the cores with any other process); on CUDA the median.
The rates (GEMM, attention, elementwise) are timed on CUDA in device time alone
(:func:`_gpu_timed`): timed by the host clock, a small model's shapes measure the launches, which
the host terms already count (on an H200 a hidden-512 model's GPU was busy 2.7 ms of a 17 ms
step while the host-clock rates predicted 15 ms of compute).

The measured square-GEMM rate becomes the peak (MFU is relative to it); the other rates become
efficiencies against it, the overheads :class:`~gemcore.planner.cluster.GpuKind` fields.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from gemcore.planner.cluster import Cluster


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _group_size() -> int:
    """Ranks of the initialized process group (1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


#: a CPU window lasts at least this many calls of the slowest rank's first (warm-up) call, so the
#: rank that overruns the window (by at most one call) computes alone for a small part of it
WINDOW_CALLS = 6


def _timed(fn, repeats: int = 5, budget_s: float = 0.3) -> float:
    """Seconds per call of ``fn()`` after one warm-up call.

    CUDA: the median of at least ``repeats`` calls, more (up to 100) while they fit in ``budget_s``
    (a device of its own per rank; the median drops host jitter, which asynchronous launches hide).

    CPU: the mean over a window. A CPU step is every op's time, the ones that lost their core to
    another thread included, so the rate that predicts it is total time / calls, not the median
    (which keeps the calls that ran undisturbed). Under a process group every rank starts the window
    together (a barrier) and the window has one agreed length, ``max(budget_s, WINDOW_CALLS x the
    slowest rank's warm-up call)``: the local ranks compute at once, as in the run, sharing the cores'
    caches and memory bandwidth (and the cores themselves with any other process). Each rank calls
    ``fn`` until the window has passed and it has made ``repeats`` calls.
    ``budget_s == 0``: exactly ``repeats`` calls on every rank (collectives: the same call count).
    """
    t0 = time.perf_counter()
    fn()
    _sync()
    first = time.perf_counter() - t0
    if torch.cuda.is_available():
        repeats = max(repeats, min(100, int(budget_s / max(first, 1e-6)))) if budget_s else repeats
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            _sync()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]
    window = max(budget_s, WINDOW_CALLS * first) if budget_s else 0.0
    if _group_size() > 1:
        import torch.distributed as dist

        agreed = torch.tensor([window], dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)     # also the barrier that starts the window
        window = float(agreed)
    calls = 0
    t0 = time.perf_counter()
    while calls < repeats or (window and time.perf_counter() - t0 < window):
        fn()
        calls += 1
    return (time.perf_counter() - t0) / calls


def _gpu_timed(fn) -> float:
    """Seconds of device time per call of ``fn()``: on CUDA, each timed call queued behind a spacer
    kernel that outlasts the host's work for it (twice a warm call's wall time at 2 GHz), so the
    events time the GPU alone; a rate timed by the host clock on a small shape would measure the
    launches, and the planner counts host time apart (its overhead terms). On a CPU: :func:`_timed`."""
    if not torch.cuda.is_available():
        return _timed(fn)
    from gemcore.bench.timing import SPACER_CYCLES, median_ms

    fn()                                          # compiles (Triton), allocates
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    cycles = max(SPACER_CYCLES, int(4e9 * warm))
    return median_ms(fn, warmup=1, rep_ms=100, launch_hidden=True, spacer_cycles=cycles) / 1e3


def _optimizer_rate(weights: int, device: str) -> float:
    """Bytes per second of the eager optimizer pass (gemcore's gradient clipping, then foreach
    AdamW: ``cost.OPTIMIZER_BYTES["eager"]`` per weight) on one flat float32 weight of ``weights``
    elements, the rank's shard: its state (16 B a weight) streams at the rate of its own size,
    which an activation-sized product can overstate from the caches. The per-tensor launches of a
    real model's many weights are the host terms' (``optimizer_host_s``, ``optimizer_layer_s``)."""
    from gemcore.parallel.apply import clip_grad_norm_
    from gemcore.planner.cost import OPTIMIZER_BYTES

    weight = torch.nn.Parameter(torch.randn(weights, device=device))
    weight.grad = torch.randn(weights, device=device)
    opt = torch.optim.AdamW([weight], lr=1e-6, foreach=True)

    def step():
        clip_grad_norm_([weight], 1.0)
        opt.step()

    return OPTIMIZER_BYTES["eager"] * weights / _gpu_timed(step)


def _device_dtype(dtype: torch.dtype | None) -> tuple[str, torch.dtype]:
    cuda = torch.cuda.is_available()
    return ("cuda" if cuda else "cpu"), dtype or (torch.bfloat16 if cuda else torch.float32)


def _gemm_rate_model(spec, tokens: int, device: str, dtype: torch.dtype) -> float:
    """FLOP/s of the model's own linear layers (one block + head), forward + backward, at ``tokens``."""
    h, f = spec.hidden, spec.ffn
    q_out = spec.num_heads * spec.qk_head_dim + spec.kv_dim
    shapes = [(h, q_out), (spec.num_heads * spec.value_head_dim, h), (h, 2 * f), (f, h)]
    x = {n: torch.randn(tokens, n, device=device, dtype=dtype, requires_grad=True) for n, _ in shapes}
    w = [(torch.randn(n, m, device=device, dtype=dtype) / n ** 0.5).requires_grad_() for n, m in shapes]

    def run():
        for (n, _), wi in zip(shapes, w):
            (x[n] @ wi).sum().backward()

    flops = sum(6.0 * n * m * tokens for n, m in shapes)
    return flops / _gpu_timed(run)


def _attention_times(lengths: list[int], targets: int, heads: int, head_dim: int, backend: str,
                     device: str, dtype: torch.dtype, gpu_time: bool = False) -> float:
    """Seconds of one causal jagged attention forward + backward over sequences of ``lengths``
    (``gpu_time``: the device's time alone, :func:`_gpu_timed`; else the wall clock's)."""
    from gemcore.kernels.jagged_attention import jagged_attention

    offsets = torch.tensor([0, *np.cumsum(lengths)], device=device, dtype=torch.int64)
    T = int(offsets[-1])
    q, k, v = (torch.randn(T, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    num_targets = torch.tensor([min(targets, n) for n in lengths], device=device, dtype=torch.int64)
    max_len = max(lengths)

    def run():
        out = jagged_attention(q, k, v, offsets, causal=True, num_targets=num_targets,
                               max_seqlen=max_len, backend=backend, validate=False)
        out.sum().backward()

    return _gpu_timed(run) if gpu_time else _timed(run)


#: rounds of the interleaved tiny steps (:func:`_tiny_steps_s`), one call of every model per round
TINY_ROUNDS = 41


def _tiny_steps_s(block_counts: tuple[int, ...], heads: int, backend: str, device: str,
                  dtype: torch.dtype, mesh=None, head_dim: int = 2, events: int = 1,
                  users: int = 1) -> list[tuple[float, float, float, float]]:
    """For each count in ``block_counts``: (seconds per step, forward's share, share after the
    backward, wall ÷ issued) of one train step (loss, backward, clipping, AdamW) of a
    ``blocks``-block GemModel of width heads·head_dim on ``users`` users with ``events`` history
    events and one candidate each. With ``mesh``: wrapped in FSDP2 the way the run is, gemcore's
    clipping, the loss all-reduced.

    The models' steps are interleaved, one call of each per round (:data:`TINY_ROUNDS` rounds or
    more), so a change in the machine's speed while they run (another tenant, a clock) touches every
    model alike: the caller's per-layer figure is their difference, which a slow spell during one
    model's calls alone moves. On an H200 (six calibrations in one process) the
    per-layer figure's standard deviation was 0.42 ms with the models one after the other and 0.23
    ms interleaved, the per-step figure's 0.94 and 0.32 ms.

    On CUDA the seconds are the host's issuing time (per phase the median over the calls), read at
    the phase borders with no wait for the GPU, as the run's host overhead is (the smoke's
    ``host_issued_s_measured``); the synced wall time per call would also hold any GPU tail, which
    the calibrated GPU rates already cost (on an H200 the two differed by 0-5 %). On a
    CPU (synchronous) it is the wall time (per phase the mean). Wall ÷ issued is the rounds'."""
    import torch.distributed as dist

    from gemcore.config import AttentionConfig, ModelConfig, TrainConfig
    from gemcore.data.dataset import JaggedBatch
    from gemcore.gc_schedule import ScheduledGC
    from gemcore.kernels.jagged_attention import make_attention
    from gemcore.model import GemModel
    from gemcore.parallel.apply import apply_fsdp, clip_grad_norm_

    z = torch.zeros(users * events, device=device, dtype=torch.int64)
    starts = torch.arange(users + 1, device=device)
    batch = JaggedBatch(item_ids=z, actions=z, time_buckets=z, offsets=starts * events,
                        cand_ids=torch.zeros(users, device=device, dtype=torch.int64), cand_offsets=starts,
                        labels=torch.zeros(users, device=device), max_len=events + 1,
                        sum_sq_len=users * (events + 1) ** 2)

    def train_step(blocks: int):
        """A ``blocks``-block model's step and the list its calls append (forward, backward, after) to."""
        torch.manual_seed(0)
        cfg = ModelConfig(num_items=16, hidden=head_dim * heads, num_blocks=blocks, num_heads=heads,
                          mlp_ratio=2)
        model = GemModel(cfg, make_attention(AttentionConfig(), backend=backend)).to(device=device, dtype=dtype)
        if mesh is not None:
            model = apply_fsdp(model, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        phases: list[tuple[float, float, float]] = []

        def step():
            t0 = time.perf_counter()
            loss = model.loss(batch)
            t1 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            t2 = time.perf_counter()
            clip_grad_norm_(model.parameters(), 1.0)   # the planned run's (PlannedParallelism's)
            opt.step()
            if mesh is not None:
                dist.all_reduce(loss.detach())
            t3 = time.perf_counter()
            phases.append((t1 - t0, t2 - t1, t3 - t2))
        return step, phases

    models = [train_step(n) for n in block_counts]

    def one_round():
        for step, _ in models:
            step()

    # automatic garbage collection off, as gem train's steps run it (train.gc_every)
    with ScheduledGC(TrainConfig().gc_every):
        if mesh is None:
            seconds = _timed(one_round, repeats=TINY_ROUNDS)
        else:
            dist.barrier()
            seconds = _timed(one_round, repeats=TINY_ROUNDS, budget_s=0.0)   # the same call count on every rank
    cuda = torch.cuda.is_available()
    summaries = [_phase_summary(phases, robust=cuda) for _, phases in models]
    wall_over_issued = seconds / max(sum(issued for issued, _, _ in summaries), 1e-12)
    return [(issued, forward, after, wall_over_issued) for issued, forward, after in summaries]


def _phase_summary(calls: list[tuple[float, float, float]], robust: bool) -> tuple[float, float, float]:
    """(host seconds issued per call, forward's share, after-backward's share) from each call's
    (forward, backward, after) seconds. The first call is left out: it is :func:`_timed`'s warm-up,
    which compiles kernels and allocates (it had made the forward's share anywhere from 0.18 to
    0.57 on an H200). ``robust`` (CUDA, where :func:`_timed` takes the median): each
    phase's median; else (a CPU's mean over the window) their means."""
    timed = calls[1:] or calls
    columns = list(zip(*timed))
    per_phase = [float(np.median(c)) if robust else sum(c) / len(c) for c in columns]
    total = sum(per_phase)
    if total <= 0:
        return 0.0, 0.0, 0.0
    return total, per_phase[0] / total, per_phase[2] / total


def _tiny_shape(spec, device: str, lengths: list[int] | None) -> dict[str, int]:
    """The tiny models' heads, head_dim and history events (:func:`_tiny_steps_s`). On a CPU: the
    spec's heads of width 2 on one event (all of a CPU step is host work; the rates cost the
    rest). On CUDA: one head of the run's head dim on one history of the run's mean length (at
    most 1024 events), so each layer's attention takes the kernels the run's takes (on an H200 a
    head-dim-128 layer on 300 events, the Gluon path, issued 1.9 ms of host work against the
    width-8 one-event layer's 1.3 ms, the Triton path) while the GPU work stays far below it."""
    if device != "cuda":
        return {"heads": spec.num_heads if spec is not None else 4, "head_dim": 2, "events": 1}
    mean = sum(lengths) / len(lengths) if lengths else 1
    return {"heads": 1, "head_dim": spec.qk_head_dim if spec is not None else 128,
            "events": max(1, min(1024, round(mean) - 1))}     # + the one candidate


def _host_overheads(backend: str, device: str, dtype: torch.dtype, shape: dict[str, int]) -> dict[str, float]:
    """Seconds of size-independent host work: per layer and per step (the slope and the rest of
    one- and three-block models' train steps of ``shape`` (:func:`_tiny_shape`,
    :func:`_tiny_steps_s`), the forward's share of the host time before the backward ends, and the
    part after the backward (clipping, optimizer) per layer (its growth with the block count) and
    per step (the one-block model's, less that growth). Measured
    inside whole steps, as the run pays them: a block timed alone would also pay the backward
    call's own start, which a step pays once."""
    (one, _, after1, _), (three, fwd3, after3, wall_over_issued) = _tiny_steps_s(
        (1, 3), backend=backend, device=device, dtype=dtype, **shape)
    layer_s = max(0.0, (three - one) / 2)
    step_s = max(0.0, one - layer_s)
    after_slope = min(layer_s, max(0.0, (three * after3 - one * after1) / 2))
    # the forward's share of the three-block step's host time before the backward ends: a ratio of
    # two whole phases, steadier than the ratio of per-layer slopes (a difference of noisy figures,
    # it had read 0.25-0.62 on identical H200 runs)
    share = min(1.0, max(0.0, fwd3 / (1.0 - after3))) if after3 < 1.0 else 0.5
    # (each layer includes one attention call on one sequence: the caller subtracts its per-sequence part)
    return {"layer_s": layer_s, "step_s": step_s, "forward_host_share": share,
            "optimizer_layer_s": after_slope, "tiny_wall_over_issued": wall_over_issued,
            "optimizer_host_s": min(step_s, max(0.0, one * after1 - after_slope))}


def _sharded_overheads(backend: str, device: str, dtype: torch.dtype, shape: dict[str, int],
                       layer_s: float, step_s: float, latency_s: float) -> tuple[float, float]:
    """(per FSDP layer, per step) seconds a data-parallel step adds beyond the collectives' bytes
    and latencies, measured under the process group on the same tiny models as
    :func:`_host_overheads`, wrapped the way the run is (FSDP2 per block and root, gemcore's
    clipping, the loss averaged over the ranks): one- and three-block models give the per-layer
    part (FSDP2's hooks, copy-in/copy-out, stream waits) and the rest per step (as in
    :func:`_host_overheads`: with one- and two-block models the split swung 0.3-4.3 ms per layer
    and 2.4-7.2 ms per step over four calibrations on the 2-core CPU, with one and three
    4.4-5.3 and 5.1-7.4). ``layer_s`` and
    ``step_s`` are the unwrapped figures; the 2 all-gathers + 1 reduce-scatter per layer and the
    root's are costed by the planner's collective terms (``latency_s`` each), so they are taken
    out here."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (dist.get_world_size(),))
    one, three = (seconds for seconds, *_ in _tiny_steps_s((1, 3), backend=backend, device=device,
                                                            dtype=dtype, mesh=mesh, **shape))
    per_layer = max(0.0, (three - one) / 2 - layer_s)
    per_step = max(0.0, one - (step_s + layer_s) - per_layer)
    # the planner costs each unit's 3 FSDP collectives (a block's, and the root's once per step);
    # the clipping and loss all-reduces stay in the per-step figure
    return max(0.0, per_layer - 3 * latency_s), max(0.0, per_step - 3 * latency_s)


def _collectives(layer_bytes: float, device: str) -> dict[str, float]:
    """All-gather and reduce-scatter timed apart, at FSDP2's per-block size and at 1 KiB (their
    latency), each into a fresh output as FSDP2 allocates one per call; an all-reduce; and the
    rate of FSDP2's copies.

    Apart because they differ: gloo on the 2-core CPU took 1.6-2.3x as long for a block's
    reduce-scatter as for its all-gather, longer than an all-reduce of the same buffer (in
    the run a block's reduce-scatter took 3.6-4.2 ms once both ranks were in it, where a timed
    pair split evenly had given 2.8). The fresh output costs its page faults on a CPU, as the
    run's do."""
    import torch.distributed as dist

    world = dist.get_world_size()
    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)     # torch >= 2.13
    reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

    def seconds(op: str, nbytes: float) -> tuple[float, int]:
        n = _float32_numel(nbytes, world)
        full = torch.ones(n, device=device)
        shard = torch.ones(n // world, device=device)
        if op == "all_gather":
            def run():
                all_gather(torch.empty_like(full), shard)
        else:
            def run():
                reduce_scatter(torch.empty_like(shard), full)
        dist.barrier()
        return _timed(run, repeats=7, budget_s=0.0), n * 4   # the same call count on every rank

    big_bytes = max(layer_bytes, 64 * 1024)
    ag_small, _ = seconds("all_gather", 1024)
    ag_big, big = seconds("all_gather", big_bytes)
    rs_small, _ = seconds("reduce_scatter", 1024)
    rs_big, _ = seconds("reduce_scatter", big_bytes)
    ag_bytes_s, rs_bytes_s = _bytes_seconds(ag_small, ag_big), _bytes_seconds(rs_small, rs_big)
    out = {"collective_latency_s": (ag_small + rs_small) / 2,
           "fsdp_busbw": big * (world - 1) / world / ag_bytes_s,
           "reduce_scatter_factor": rs_bytes_s / ag_bytes_s}
    buf = torch.ones(int(big_bytes // 4), device=device)
    t_allreduce = _timed(lambda: dist.all_reduce(buf), budget_s=0.0)
    out["allreduce_busbw"] = buf.numel() * 4 * 2 * (world - 1) / world / t_allreduce
    out["fsdp_copy_bytes_per_s"] = _copy_after_gather_rate(big_bytes, device, all_gather)
    return out


def _float32_numel(nbytes: float, world: int) -> int:
    """Float32 elements in ``nbytes``, a multiple of ``world`` (each rank's shard equal), at least one a rank."""
    return max(world, int(nbytes // 4) // world * world)


def _bytes_seconds(small_s: float, big_s: float) -> float:
    """The bytes' share of a big collective call: its time less the small call's (the latency).
    Where a layer is so small that its bytes drown in the latency's noise, at least 1 % of the call
    (a floor of 1e-9 s had read ``reduce_scatter_factor`` 62,760 at hidden 16)."""
    return max(big_s - small_s, 0.01 * big_s, 1e-9)


def _copy_after_gather_rate(nbytes: float, device: str, all_gather, calls: int = 12) -> float:
    """Bytes/s of FSDP2's copy-out: an all-gather's fresh output, just written by the collective,
    copied into a fresh buffer of the same size (``nbytes``: a layer's weights); the copy alone is
    timed, every rank making the same calls. On a 2-core CPU the run's FSDP2 copies went
    at 5-7 GB/s; a copy of a buffer the copying thread had written itself read 12-25, one right
    after gloo wrote it 8-10 (the activation-sized product of ``copy_bytes_per_s``: 89, from the
    caches)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    n = _float32_numel(nbytes, world)
    shard = torch.ones(n // world, device=device)
    copied = 0.0
    dist.barrier()
    for call in range(calls + 1):
        gathered = torch.empty(n, device=device)
        all_gather(gathered, shard)
        _sync()
        t0 = time.perf_counter()
        torch.empty_like(gathered).copy_(gathered)
        _sync()
        if call:                                   # the first is the warm-up
            copied += time.perf_counter() - t0
    return 2 * n * 4 * calls / max(copied, 1e-12)


def measure(spec=None, *, lengths: list[int] | None = None, sequences: int = 16,
            backend: str = "auto", dtype: torch.dtype | None = None, size: int | None = None,
            seq_len: int | None = None) -> dict[str, float]:
    """Rates of this device (see the module docstring). ``spec``: the planner's ModelSpec to
    measure at (its head count and dims, its linear layers, its length law); ``lengths``: one
    micro-batch's sequence lengths incl. candidates (else ``sequences`` draws of the law at
    ``seq_len``; on a CPU at most 8 sequences of at most 1024 tokens, so a large preset stays
    measurable: the reference attention holds an L×L score matrix per head). Returns gemm_flops (square), gemm_flops_model, attention_flops (per counted
    FLOP), sequence_overhead_s, copy_bytes_per_s, optimizer_bytes_per_s, layer_overhead_s, step_overhead_s,
    forward_host_share, optimizer_host_s, optimizer_layer_s, activation_bytes and, under a process group, collective_latency_s, fsdp_busbw
    (all-gather), reduce_scatter_factor, allreduce_busbw, fsdp_copy_bytes_per_s."""
    device, dtype = _device_dtype(dtype)
    if backend == "auto":
        backend = "triton" if device == "cuda" else "reference"
    n = size or (8192 if device == "cuda" else 512)
    lengths_given = lengths is not None
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    out = {"gemm_flops": 2 * n ** 3 / _gpu_timed(lambda: a @ b)}
    if lengths is None:
        if spec is not None and spec.length_law != "fixed":
            from gemcore.planner.models import history_lengths

            S = seq_len or spec.seq_len
            lengths = [int(x) + spec.num_candidates
                       for x in history_lengths(spec.length_law, sequences, S, torch.Generator().manual_seed(0))]
        else:
            lengths = [seq_len or (4096 if device == "cuda" else 512)] * (2 if device == "cpu" else 4)
    lengths = [max(1, int(x)) for x in lengths]
    if device == "cpu" and lengths_given is False:  # a CPU measures a model's law at most 8 × 1024 tokens
        lengths = [min(x, 1024) for x in lengths[:8]]
    heads = spec.num_heads if spec is not None else (16 if device == "cuda" else 4)
    head_dim = spec.qk_head_dim if spec is not None else (128 if device == "cuda" else 64)
    targets = spec.num_candidates if spec is not None else 0
    tokens = sum(lengths)
    cuda = device == "cuda"
    t_real = _attention_times(lengths, targets, heads, head_dim, backend, device, dtype, gpu_time=cuda)
    t_ones = _attention_times([1] * len(lengths), 0, heads, head_dim, backend, device, dtype)
    t_one = _attention_times([1], 0, heads, head_dim, backend, device, dtype)
    per_seq = max(0.0, (t_ones - t_one) / max(1, len(lengths) - 1))
    if cuda:                                      # the rate's per-call part, in device time too
        t_ones = _attention_times([1] * len(lengths), 0, heads, head_dim, backend, device, dtype, gpu_time=True)
    counted = 3.5 * heads * 2 * head_dim * sum(x * x for x in lengths)   # the planner's hardware count
    # the per-call part of t_ones is in the layer overhead (the block calls attention once); short
    # sequences leave t_real - t_ones at the timing noise, so the rate is capped at the measured
    # GEMM peak, which the counted FLOPs (tensor-core matmuls) cannot beat (seen on an H200: 6.6
    # PFLOP/s from 512-token sequences before the cap)
    out["attention_flops"] = min(counted / max(t_real - t_ones, 1e-3 * t_real), out["gemm_flops"])
    out["sequence_overhead_s"] = per_seq
    if spec is not None:
        gemm_tokens = tokens if (lengths_given or device == "cuda") else min(tokens, 256)
        out["gemm_flops_model"] = _gemm_rate_model(spec, gemm_tokens, device, dtype)
    width = spec.hidden if spec is not None else 1024
    numel = tokens * width if spec is not None else 64 * 2 ** 20 // 4
    x, y = (torch.randn(numel, device=device, dtype=dtype) for _ in range(2))
    z = torch.empty_like(x)
    out["copy_bytes_per_s"] = 3 * numel * x.element_size() / _gpu_timed(lambda: torch.mul(x, y, out=z))
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if spec is not None:   # the rank's share under FSDP: its blocks' and head's weights / ranks
        weights = (sum(spec.layer_params) + spec.head_params()) // world
    else:
        weights = 2 ** 25 // world
    # at most 2^25 weights (512 MiB of state, past any cache): a 405B preset stays measurable
    out["optimizer_bytes_per_s"] = _optimizer_rate(min(max(1, weights), 2 ** 25), device)
    shape = _tiny_shape(spec, device, lengths)
    host = _host_overheads(backend, device, dtype, shape)
    layer_s, step_s = host["layer_s"], host["step_s"]
    out["layer_overhead_s"] = max(0.0, layer_s - per_seq)
    out["step_overhead_s"] = step_s
    out["forward_host_share"] = host["forward_host_share"]
    out["optimizer_host_s"] = host["optimizer_host_s"]
    out["optimizer_layer_s"] = min(host["optimizer_layer_s"], out["layer_overhead_s"])
    out["tiny_wall_over_issued"] = host["tiny_wall_over_issued"]     # a diagnostic, for the record
    out["activation_bytes"] = float(torch.empty(0, dtype=dtype).element_size())
    if world > 1:
        layer_weights = (sum(spec.layer_params) / spec.num_layers) if spec is not None else 2 ** 22
        out.update(_collectives(layer_weights * out["activation_bytes"], device))
        fsdp_layer, dist_step = _sharded_overheads(backend, device, dtype, shape, layer_s, step_s,
                                                   out["collective_latency_s"])
        out["fsdp_layer_overhead_s"], out["data_parallel_step_overhead_s"] = fsdp_layer, dist_step
    return out


def calibrate_cluster(cluster: Cluster, rates: dict[str, float] | None = None, *,
                      spec=None) -> tuple[Cluster, dict]:
    """``cluster`` with its GPU figures replaced by measured ``rates`` (measured now if None).

    With ``gemm_flops_model`` (the model's own layers) the GEMM efficiency is set so the planner's
    rate at that model's thinnest GEMM side (its d/(d+64) shape factor) equals the measured one.
    """
    rates = rates or measure(spec)
    peak = rates["gemm_flops"]
    gemm_eff = 1.0
    if "gemm_flops_model" in rates and spec is not None:
        from gemcore.planner.cost import _gemm_shape_factor

        thinnest = min(spec.hidden, spec.num_heads * spec.qk_head_dim, spec.ffn)
        gemm_eff = rates["gemm_flops_model"] / peak / _gemm_shape_factor(thinnest)
    gpu = dataclasses.replace(
        cluster.gpu, name=cluster.gpu.name + "-calibrated",
        peak_bf16_tflops=peak / 1e12, gemm_efficiency=gemm_eff, power_limit_w=0.0,
        attention_efficiency=rates["attention_flops"] / peak,
        hbm_gbps=rates["copy_bytes_per_s"] / 1e9, memory_efficiency=1.0,
        optimizer_bytes_per_s=rates.get("optimizer_bytes_per_s", 0.0),
        fsdp_copy_bytes_per_s=rates.get("fsdp_copy_bytes_per_s", 0.0),
        activation_bytes=int(rates.get("activation_bytes", 2)),
        layer_overhead_s=rates.get("layer_overhead_s", 0.0),
        sequence_overhead_s=rates.get("sequence_overhead_s", 0.0),
        step_overhead_s=rates.get("step_overhead_s", 0.0),
        fsdp_layer_overhead_s=rates.get("fsdp_layer_overhead_s", 0.0),
        data_parallel_step_overhead_s=rates.get("data_parallel_step_overhead_s", 0.0),
        forward_host_share=rates.get("forward_host_share", 0.5),
        optimizer_host_s=rates.get("optimizer_host_s", 0.0),
        optimizer_layer_s=rates.get("optimizer_layer_s", 0.0),
        host_synchronous=not torch.cuda.is_available(),
        # FSDP2 on a CPU calls gloo with async_op=False (its all-gathers unless unshard_async_op
        # is set, its reduce-scatters always), so the rank blocks on each collective with cores to
        # spare or not (a 16-core host, two ranks: FSDP predicted hidden, 6 ms exposed;
        # its collectives took ~22 ms a step)
        comm_overlaps_compute=torch.cuda.is_available())
    bus = rates.get("fsdp_busbw", rates.get("allreduce_busbw"))
    if bus:
        gpu = dataclasses.replace(gpu, intra_node_gbps=bus / 1e9, inter_node_gbps=bus / 1e9,
                                  link_efficiency=1.0,
                                  link_latency_s=rates.get("collective_latency_s", 0.0),
                                  reduce_scatter_factor=rates.get("reduce_scatter_factor", 1.0))
    summary = {k: float(f"{v:.4g}") for k, v in rates.items()}
    return dataclasses.replace(cluster, gpu=gpu), summary


__all__ = ["measure", "calibrate_cluster"]
