"""Published training runs and the planner's prediction for each (``gem plan --validate``).

Each run gives the planner only what its source publishes: model, GPU count and kind, sequence
length, global batch, the parallel degrees and the knobs the source states (micro-batch,
activation checkpointing, torch.compile). Everything else (virtual pipeline stages, FSDP
resharding, the selective-AC policy, the kernel stack) is searched by
:func:`gemcore.planner.search.complete`, as ``gem plan --degrees`` does. The published figures
are data from the sources named, not results of this repository.

Sources:

- Meta: "The Llama 3 Herd of Models", arXiv 2407.21783, Table 4 (BF16 model FLOPs per GPU at
  16 sequences per data-parallel group on 16,384 H100, 32 on 8,192).
- TorchTitan: pytorch/torchtitan, docs/performance.md (words per second per GPU; the A100 rows
  with the configs' then default eager mode, the H100 rows on Grand Teton hosts: 8 H100 SXM with
  96 GB HBM2e at 2.4 TB/s, 400 Gb/s RDMA per GPU, 500 W power limit).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from gemcore.planner.cluster import Cluster, make_cluster
from gemcore.planner.models import load_model
from gemcore.planner.plan import Plan
from gemcore.planner.search import complete

LLAMA3_PAPER = "Llama 3 paper (arXiv 2407.21783), Table 4"
TORCHTITAN = "pytorch/torchtitan docs/performance.md"
#: TorchTitan's Grand Teton H100 hosts (GpuKind overrides)
GRAND_TETON = {"hbm_gb": 96, "hbm_gbps": 2400, "inter_node_gbps": 50, "power_limit_w": 500}


@dataclass(frozen=True)
class PublishedRun:
    """One published measurement and the planner inputs its source states."""

    name: str
    source: str
    published: float            #: the figure, in ``unit``
    unit: str                   #: "TFLOP/s/GPU" (model FLOPs) or "tok/s/GPU"
    model: str
    gpu: str
    gpus: int
    seq_len: int
    global_batch: int
    degrees: str                #: ``--degrees`` text: only what the source publishes
    kernels: str | None = None  #: the kernel stack the source states (None: searched)
    gpu_overrides: dict = field(default_factory=dict)

    def cluster(self, **extra) -> Cluster:
        return make_cluster(self.gpu, self.gpus, 8, kernels=self.kernels or "fused",
                            **{**self.gpu_overrides, **extra})


RUNS: tuple[PublishedRun, ...] = (
    PublishedRun("Meta 405B, 8,192 H100", LLAMA3_PAPER, 430, "TFLOP/s/GPU", "llama3-405b", "h100", 8192,
                 8192, 2048, "tp=8,pp=16,dp_shard=64"),
    PublishedRun("Meta 405B, 16,384 H100", LLAMA3_PAPER, 400, "TFLOP/s/GPU", "llama3-405b", "h100", 16384,
                 8192, 2048, "tp=8,pp=16,dp_shard=128"),
    PublishedRun("Meta 405B, 16,384 H100, 128K", LLAMA3_PAPER, 380, "TFLOP/s/GPU", "llama3-405b", "h100",
                 16384, 131072, 128, "tp=8,cp=16,pp=16,dp_shard=8"),
    PublishedRun("TorchTitan 8B, 64 A100", TORCHTITAN, 2973, "tok/s/GPU", "llama3-8b", "a100", 64, 8192, 64,
                 "dp_shard=64,mbs=1,ac=selective,sac=every_other_mm", kernels="eager"),
    PublishedRun("TorchTitan 70B, 64 A100", TORCHTITAN, 331, "tok/s/GPU", "llama3-70b", "a100", 64, 8192, 64,
                 "dp_shard=64,mbs=1,ac=full", kernels="eager"),
    PublishedRun("TorchTitan 8B, 8 H100, FSDP", TORCHTITAN, 5762, "tok/s/GPU", "llama3-8b", "h100", 8, 8192, 16,
                 "dp_shard=8,mbs=2,ac=selective,sac=every_other_mm", kernels="eager",
                 gpu_overrides=GRAND_TETON),
    PublishedRun("TorchTitan 8B, 128 H100, FSDP", TORCHTITAN, 5605, "tok/s/GPU", "llama3-8b", "h100", 128, 8192,
                 256, "dp_shard=128,mbs=2,ac=selective,sac=every_other_mm", kernels="eager",
                 gpu_overrides=GRAND_TETON),
    PublishedRun("TorchTitan 8B, 8 H100, compile", TORCHTITAN, 6667, "tok/s/GPU", "llama3-8b", "h100", 8, 8192,
                 16, "dp_shard=8,mbs=2,ac=selective,sac=every_other_mm", kernels="compiled-blocks",
                 gpu_overrides=GRAND_TETON),
    PublishedRun("TorchTitan 8B, 128 H100, compile", TORCHTITAN, 6514, "tok/s/GPU", "llama3-8b", "h100", 128,
                 8192, 256, "dp_shard=128,mbs=2,ac=selective,sac=every_other_mm", kernels="compiled-blocks",
                 gpu_overrides=GRAND_TETON),
)


@dataclass
class Prediction:
    run: PublishedRun
    predicted: float | None     #: in ``run.unit``; None when no layout fits
    fits: bool                  #: some completion of the published degrees fits in memory
    layout: str                 #: the completed layout (the least memory-hungry one when none fits)
    memory_gb: float
    memory_limit_gb: float

    @property
    def error(self) -> float | None:
        return None if self.predicted is None else self.predicted / self.run.published - 1


def predict(run: PublishedRun, **gpu_extra) -> Prediction:
    """The planner's figure for ``run`` (``gpu_extra``: more GpuKind overrides, e.g. the clock law)."""
    model = load_model(run.model)
    cluster = run.cluster(**gpu_extra)
    plan, given = Plan.parse_given(run.degrees)
    problems = plan.violations(model, run.global_batch, cluster.gpus)
    if problems:
        raise ValueError(f"{run.name}: {'; '.join(problems)}")
    found = complete(model, cluster, plan, given, seq_len=run.seq_len, global_batch=run.global_batch,
                     kernels_given=run.kernels is not None)
    est = found.best or found.smallest
    value = None
    if found.best is not None:
        value = (est.mfu * cluster.peak_flops / 1e12 if run.unit == "TFLOP/s/GPU"
                 else est.tokens_per_s_per_gpu)
    return Prediction(run, value, found.best is not None, layout_text(est.plan, found.kernels),
                      est.memory_total / 1e9, est.memory_limit / 1e9)


def layout_text(plan: Plan, kernels: str) -> str:
    """``tp=8,pp=16,...`` with every knob, as ``--degrees`` reads it, plus the kernel stack."""
    degrees = [f"{k}={v}" for k, v in plan.degrees().items() if v > 1]
    knobs = [f"mbs={plan.mbs}", f"ac={plan.ac}"]
    if plan.ac == "selective":
        knobs.append(f"sac={plan.sac}")
    if plan.virtual_stages > 1:
        knobs.append(f"v={plan.virtual_stages}")
    if plan.dp_shard * plan.cp > 1:
        knobs.append(f"reshard={str(plan.reshard_after_forward).lower()}")
    return ",".join(degrees + knobs) + f" ({kernels})"


def table(runs=RUNS) -> list[str]:
    """Lines of the validation table: published against predicted, each run's completed layout;
    power-capped runs also at the clock law's upper bound (α = 1)."""
    lines = [f"{'run':34s} {'published':>18s} {'predicted (α=1/3)':>18s} {'α=1':>14s}  layout searched to"]
    for run in runs:
        got = predict(run)
        row = f"{run.name:34s} {run.published:>6,.0f} {run.unit:>11s} "
        if got.fits:
            row += f"{got.predicted:>10,.0f} ({got.error:+4.0%})"
        else:
            row += f"{'does not fit':>18s}"
        if run.gpu_overrides.get("power_limit_w"):
            one = predict(run, power_clock_exponent=1.0)
            row += f" {one.predicted:>7,.0f} ({one.error:+4.0%})" if one.fits else f" {'does not fit':>14s}"
        else:
            row += " " * 15
        row += f"  {got.layout}"
        if not got.fits:
            row += f" needs {got.memory_gb:.1f} GB of {got.memory_limit_gb:.1f} GB allowed"
        lines.append(row)
    return lines


__all__ = ["PublishedRun", "RUNS", "Prediction", "predict", "table", "layout_text"]
