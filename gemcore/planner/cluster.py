"""Cluster descriptions: GPU kinds, nodes and network tiers, and the bandwidth a group gets.

Bandwidths are per GPU and per direction, in GB/s (1e9 bytes). ``*_efficiency`` is the share of the
datasheet figure a collective reaches as bus bandwidth (nccl-tests' busbw): 8xH100 NVLink
all-gather reaches ~370 GB/s of 450 (nccl-tests' ``all_gather_perf`` on a DGX H100), so 0.8. A cluster TOML overrides any field and adds
network tiers above the node::

    [cluster]
    gpu = "h100"
    gpus = 16384
    gpus_per_node = 8
    inter_node_gbps = 50          # one 400 Gb/s NIC per GPU
    power_limit_w = 500           # GPUs capped below their TDP (optional)
    kernels = "eager"             # unfused PyTorch (optional: a KERNEL_STACKS name)
    [[cluster.tiers]]             # a group inside one pod gets the full NIC rate
    name = "pod"
    gpus = 3072
    oversubscription = 1.0
    [[cluster.tiers]]             # a group spanning pods gets the NIC rate / 7
    name = "spine"
    gpus = 24576
    oversubscription = 7.0

A group uses the smallest tier that holds all its ranks.
"""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class GpuKind:
    """Datasheet figures of one accelerator (dense bf16, no sparsity)."""

    name: str
    hbm_gb: float                #: memory per GPU, GB (1e9 bytes)
    peak_bf16_tflops: float      #: dense bf16 tensor-core peak, TFLOP/s
    hbm_gbps: float              #: memory bandwidth, GB/s
    intra_node_gbps: float       #: NVLink per GPU per direction, GB/s
    inter_node_gbps: float       #: NIC per GPU per direction, GB/s
    gpus_per_node: int = 8
    gemm_efficiency: float = 0.71     #: large bf16 GEMM / peak (705 of 989 TFLOP/s, 8192^3 on an H200: gem bench mx)
    attention_efficiency: float = 0.39  #: causal flash attention fwd+bwd / peak (381 of 989: SDPA on dense95, gem bench attention)
    memory_efficiency: float = 0.8      #: elementwise kernels' share of HBM bandwidth
    link_efficiency: float = 0.8        #: collective bus bandwidth / link rate
    tdp_w: float = 0.0                  #: board power the peak is quoted at, W (0: unknown)
    power_limit_w: float = 0.0          #: power cap the GPUs run under, W (0: the TDP)
    power_clock_exponent: float = 1 / 3  #: f ∝ (P_limit / P_tdp)^this: 1/3 (P ∝ f³) .. 1 (voltage floor)
    activation_bytes: int = 2           #: bytes per element the run computes in (2: bf16; 4: fp32 on CPU)
    #: per-collective latency as ``--calibrate`` measures it (0: NCCL's ring model for collectives,
    #: :meth:`Cluster.ring_collective_s`; LATENCY_INTRA_S / LATENCY_INTER_S for sends and all-to-alls)
    link_latency_s: float = 0.0
    #: a reduce-scatter's bytes term over an all-gather's of the same size and group (1: nccl-tests
    #: count both at one bus bandwidth; ``--calibrate`` under a process group measures it: gloo on
    #: the 2-core CPU read 0.9-2.8, median about 1.5, its reduce-scatter of a buffer outlasting an
    #: all-reduce of it)
    reduce_scatter_factor: float = 1.0
    #: the optimizer pass's streaming rate, bytes/s (``--calibrate`` measures it at the rank's share of
    #: the weights; 0: the HBM rate, as on the datasheet kinds)
    optimizer_bytes_per_s: float = 0.0
    #: FSDP2's copies' rate (copy-out after each all-gather, copy-in before each reduce-scatter),
    #: bytes/s: ``--calibrate`` under a process group times the copy of an all-gather's fresh output
    #: (one layer's weights) into a fresh buffer (0: the HBM rate). On the 2-core CPU the run's copies
    #: went at 5-7 GB/s where the activation-sized product the HBM rate comes from read 89 from the
    #: caches
    fsdp_copy_bytes_per_s: float = 0.0
    #: host time that does not scale with size, per fwd+bwd (``--calibrate`` measures them; 0 on the
    #: datasheet kinds): per layer and micro-batch, per sequence and layer (attention that loops over
    #: sequences), and per step (embeddings, head, loss, optimizer)
    layer_overhead_s: float = 0.0
    sequence_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    #: what data parallelism adds beyond its collectives' bytes and latencies (``--calibrate`` under a
    #: process group): per FSDP-sharded layer and micro-batch (hooks, copy-in/out), and per step
    fsdp_layer_overhead_s: float = 0.0
    data_parallel_step_overhead_s: float = 0.0
    #: how that host time falls in the step (``--calibrate`` measures it): the forward's share of the
    #: time issued before the backward ends (the rest: the backward); the part of the per-step time
    #: spent after the backward (clipping, optimizer), and of the per-layer time (the same work on
    #: each layer's parameters, once per step however many micro-batches)
    forward_host_share: float = 0.5
    optimizer_host_s: float = 0.0
    optimizer_layer_s: float = 0.0
    #: the device runs each op before the host issues the next (CPU): host overhead adds to compute;
    #: otherwise (GPU, asynchronous launches) only the part above the compute time shows
    host_synchronous: bool = False
    #: collectives progress beside the compute (GPU: copy engines / NCCL's own SMs). False on CPU
    #: ranks (``--calibrate`` there): FSDP2 calls gloo synchronously, so the rank waits out each
    #: collective and every collective adds to the step
    comm_overlaps_compute: bool = True

    @property
    def clock_factor(self) -> float:
        """Share of the datasheet tensor-core clock sustained under ``power_limit_w``.

        Dynamic power goes as f·V² and, in the DVFS range, V rises with f, so P ∝ f³ and
        f ∝ (P_limit / P_tdp)^(1/3) (the default ``power_clock_exponent``). That is an upper bound on
        the clock: static power and the voltage floor make a capped GPU lose more, down to P ∝ f
        (exponent 1) once the voltage cannot drop further. Memory-bound kernels are not scaled
        (HBM keeps its clock).
        """
        if not self.power_limit_w or not self.tdp_w or self.power_limit_w >= self.tdp_w:
            return 1.0
        return (self.power_limit_w / self.tdp_w) ** self.power_clock_exponent


GPUS: dict[str, GpuKind] = {
    # NVIDIA datasheets: H100 SXM5 80 GB HBM3 3.35 TB/s, NVLink 4 900 GB/s (450 per direction);
    # H200 141 GB 4.8 TB/s; B200 180 GB (DGX B200) 8 TB/s, NVLink 5 1.8 TB/s, 2.25 PFLOP/s bf16;
    # A100 SXM 80 GB 2.04 TB/s, NVLink 3 600 GB/s, 312 TFLOP/s. One 400 Gb/s NIC per GPU
    # (200 Gb/s on A100 systems). Max board power (TDP): H100/H200 SXM 700 W, B200 1000 W,
    # A100 SXM 400 W.
    "h100": GpuKind("h100", hbm_gb=80, peak_bf16_tflops=989, hbm_gbps=3350, intra_node_gbps=450,
                    inter_node_gbps=50, tdp_w=700),
    "h200": GpuKind("h200", hbm_gb=141, peak_bf16_tflops=989, hbm_gbps=4800, intra_node_gbps=450,
                    inter_node_gbps=50, tdp_w=700),
    "b200": GpuKind("b200", hbm_gb=180, peak_bf16_tflops=2250, hbm_gbps=8000, intra_node_gbps=900,
                    inter_node_gbps=50, tdp_w=1000),
    "a100": GpuKind("a100", hbm_gb=80, peak_bf16_tflops=312, hbm_gbps=2039, intra_node_gbps=300,
                    inter_node_gbps=25, tdp_w=400),
}

#: per-operation launch + synchronisation latency of point-to-point sends and all-to-alls, seconds
LATENCY_INTRA_S = 15e-6
LATENCY_INTER_S = 40e-6


@dataclass(frozen=True)
class RingProtocol:
    """One of NCCL's ring protocols in NCCL's own cost model (``src/graph/tuning.cc``, the tables
    of the 2.8 era): a base latency, one per ring step over NVLink and over the network (seconds),
    and the share of the bus bandwidth it reaches inside a node and across nodes (or in an
    all-reduce)."""

    name: str
    base_s: float
    nvlink_step_s: float
    network_step_s: float
    bandwidth_share: float
    bandwidth_share_across: float


#: LL (8-byte flag+data stores: low latency, 1/3 of the bandwidth, 1/4 across nodes) and Simple.
#: LL128 is left out: NCCL's model enables it by default on some architectures only.
RING_PROTOCOLS = (RingProtocol("LL", 3.6e-6, 0.47e-6, 2.7e-6, 1 / 3, 1 / 4),
                  RingProtocol("Simple", 8.4e-6, 3.4e-6, 9.6e-6, 1.0, 1.0))


@dataclass(frozen=True)
class Tier:
    """A network domain above the node: ``gpus`` per domain; crossing it divides the NIC rate."""

    name: str
    gpus: int
    oversubscription: float = 1.0


@dataclass(frozen=True)
class KernelStack:
    """How each part of the step's non-matmul work runs: ``"fused"`` (torch.compile or fused
    kernels) or ``"eager"`` (one PyTorch kernel per op); the cost model counts each one's memory
    traffic (docs/planner.md)."""

    blocks: Literal["fused", "eager"]     #: the transformer blocks: norms, RoPE, SiLU·mul, residual adds, routing
    loss: Literal["fused", "eager"]       #: the cross-entropy over the vocabulary
    optimizer: Literal["fused", "eager"]  #: AdamW and the gradient-norm clipping
    #: eager blocks' RMSNorm: ``"upcast"`` written in PyTorch ops with an fp32 upcast (TorchTitan's
    #: eager Llama) or ``"one-kernel"``: ``torch.nn.functional.rms_norm``, one kernel on CUDA
    #: (``aten::_fused_rms_norm``; on a CPU it decomposes into the upcast ops, so use ``eager`` there)
    norm: Literal["upcast", "one-kernel"] = "upcast"


#: ``fused``: everything fused (fused norms/RoPE/SwiGLU, fused cross-entropy and optimizer);
#: ``eager``: unfused PyTorch everywhere (fp32 norm upcasts, fp32 cross-entropy, foreach AdamW);
#: ``compiled-blocks``: torch.compile on the transformer blocks only, as TorchTitan compiles — the
#: loss and the optimizer stay eager; ``eager-torch-rmsnorm``: eager, but each RMSNorm is torch's
#: ``F.rms_norm`` (GemModel on CUDA)
KERNEL_STACKS: dict[str, KernelStack] = {
    "fused": KernelStack(blocks="fused", loss="fused", optimizer="fused"),
    "eager": KernelStack(blocks="eager", loss="eager", optimizer="eager"),
    "compiled-blocks": KernelStack(blocks="fused", loss="eager", optimizer="eager"),
    "eager-torch-rmsnorm": KernelStack(blocks="eager", loss="eager", optimizer="eager", norm="one-kernel"),
}


@dataclass(frozen=True)
class Cluster:
    gpu: GpuKind
    gpus: int
    gpus_per_node: int
    tiers: tuple[Tier, ...] = field(default_factory=tuple)
    kernels: str = "fused"       #: a name in KERNEL_STACKS

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"--gpus must be positive, got {self.gpus}")
        if self.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be positive, got {self.gpus_per_node}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"--gpus ({self.gpus}) must be a multiple of --gpus-per-node "
                             f"({self.gpus_per_node}) when it spans several nodes")
        if self.kernels not in KERNEL_STACKS:
            raise ValueError(f"--kernels must be one of {', '.join(KERNEL_STACKS)}, got {self.kernels!r}")
        for tier in self.tiers:
            if tier.gpus % self.gpus_per_node or tier.oversubscription < 1:
                raise ValueError(f"cluster tier {tier.name!r}: gpus ({tier.gpus}) must be a multiple of "
                                 f"gpus_per_node and oversubscription ({tier.oversubscription}) >= 1")

    @property
    def kernel_stack(self) -> KernelStack:
        return KERNEL_STACKS[self.kernels]

    @property
    def hbm_bytes(self) -> float:
        return self.gpu.hbm_gb * 1e9

    @property
    def peak_flops(self) -> float:
        """Datasheet dense bf16 peak (what MFU is quoted against), FLOP/s."""
        return self.gpu.peak_bf16_tflops * 1e12

    @property
    def sustained_peak_flops(self) -> float:
        """The peak at the clock the power limit allows (:attr:`GpuKind.clock_factor`), FLOP/s."""
        return self.peak_flops * self.gpu.clock_factor

    def group_bandwidth(self, size: int, stride: int) -> tuple[float, float, bool]:
        """(bus bandwidth B/s, latency s, inside one node) of a collective group.

        The group is ``size`` ranks ``stride`` apart in rank order (nodes hold consecutive ranks).
        Inside a node: NVLink bus bandwidth. Across nodes: each node has ``k = G / stride`` members
        (at least 1) whose NICs carry its traffic (rings/trees put one flow per NIC), so the group
        gets min(NVLink, k x NIC / oversubscription of the largest tier the group spans).
        """
        g = self.gpu
        intra = g.intra_node_gbps * g.link_efficiency * 1e9
        span = size * stride
        if size <= 1:
            return intra, 0.0, True
        if span <= self.gpus_per_node:
            return intra, g.link_latency_s or LATENCY_INTRA_S, True
        members_per_node = max(1, self.gpus_per_node // stride)
        inter = g.inter_node_gbps * g.link_efficiency * 1e9 / self.oversubscription(span)
        return min(intra, members_per_node * inter), g.link_latency_s or LATENCY_INTER_S, False

    def ring_collective_s(self, size: int, stride: int, bytes_s: float, *, all_reduce: bool = False) -> float:
        """Seconds of a ring all-gather / reduce-scatter (``all_reduce``: all-reduce) over ``size``
        ranks ``stride`` apart whose bytes take ``bytes_s`` at the group's bus bandwidth.

        With a measured ``link_latency_s`` (``--calibrate``): ``bytes_s`` + that latency. Else
        NCCL's ring model: n−1 steps (2(n−1) for all-reduce), of which those between the k nodes
        the group spans, k−1 (2(k−1)), cross the network; each protocol of :data:`RING_PROTOCOLS`
        costs base + steps' latencies + ``bytes_s`` / its bandwidth share, and NCCL takes the
        fastest. A small message over many ranks is latency-bound: 1 KiB over 1,024 ranks on 128
        nodes costs ~0.77 ms (LL), where one flat latency would say 40 µs."""
        g = self.gpu
        if g.link_latency_s:
            return bytes_s + g.link_latency_s
        members_per_node = min(size, max(1, self.gpus_per_node // stride))
        nodes = -(-size // members_per_node)
        steps, network_steps = size - 1, nodes - 1
        if all_reduce:
            steps, network_steps = 2 * steps, 2 * network_steps
        best = float("inf")
        for p in RING_PROTOCOLS:
            share = p.bandwidth_share_across if (nodes > 1 or all_reduce) else p.bandwidth_share
            latency = p.base_s + (steps - network_steps) * p.nvlink_step_s + network_steps * p.network_step_s
            best = min(best, latency + bytes_s / share)
        return best

    def nic_bandwidth(self, span: int) -> float:
        """One GPU's own inter-node bandwidth (all-to-all cannot pool NICs), B/s."""
        g = self.gpu
        return g.inter_node_gbps * g.link_efficiency * 1e9 / self.oversubscription(span)

    def oversubscription(self, span: int) -> float:
        """Oversubscription a group of ``span`` consecutive ranks sees: that of the smallest
        tier holding it (the largest tier's beyond all tiers; 1 inside a node or with no tiers)."""
        if span <= self.gpus_per_node or not self.tiers:
            return 1.0
        ordered = sorted(self.tiers, key=lambda t: t.gpus)
        for tier in ordered:
            if span <= tier.gpus:
                return tier.oversubscription
        return ordered[-1].oversubscription


def make_cluster(gpu: str, gpus: int, gpus_per_node: int | None = None, *, kernels: str = "fused",
                 **overrides) -> Cluster:
    """A cluster of ``gpus`` GPUs of kind ``gpu``; ``overrides`` replace GpuKind fields."""
    if gpu not in GPUS:
        raise ValueError(f"--gpu: unknown GPU kind {gpu!r}; known: {', '.join(GPUS)}")
    kind = GPUS[gpu]
    unknown = set(overrides) - {f.name for f in dataclasses.fields(GpuKind)}
    if unknown:
        raise ValueError(f"cluster: unknown GPU fields {sorted(unknown)}")
    if overrides:
        kind = dataclasses.replace(kind, **overrides)
    return Cluster(kind, gpus, gpus_per_node or kind.gpus_per_node, kernels=kernels)


def load_cluster(path: str | Path, *, gpus: int | None = None, gpus_per_node: int | None = None,
                 gpu: str | None = None, kernels: str | None = None) -> Cluster:
    """A cluster TOML (module docstring); command-line values, when given, win over the file."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"--cluster: no such file {str(path)!r}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--cluster {path}: invalid TOML: {exc}") from None
    table = dict(data.get("cluster", data))
    tiers = tuple(Tier(**t) for t in table.pop("tiers", []))
    kind = gpu or table.pop("gpu", "h100")
    table.pop("gpu", None)
    n = gpus or table.pop("gpus", None)
    table.pop("gpus", None)
    per_node = gpus_per_node or table.pop("gpus_per_node", None)
    table.pop("gpus_per_node", None)
    stack = kernels or table.pop("kernels", "fused")
    table.pop("kernels", None)
    if n is None:
        raise ValueError(f"--cluster {path}: give gpus in the file or --gpus")
    cluster = make_cluster(kind, int(n), per_node, kernels=stack, **table)
    return dataclasses.replace(cluster, tiers=tiers)


__all__ = ["GpuKind", "GPUS", "KERNEL_STACKS", "KernelStack", "Tier", "Cluster", "make_cluster", "load_cluster"]
