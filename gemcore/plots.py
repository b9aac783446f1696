"""curves.png: loss, throughput and MFU against step, from a run's metrics.jsonl."""
from __future__ import annotations

import json
from pathlib import Path


def plot_curves(metrics_path: Path, out_path: Path) -> Path:
    """Three panels: training loss (with held-out AUC rows, if any, on a second axis), real
    tokens/s, and MFU (achieved model TFLOP/s where the device's peak is unknown)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_auc" in r]
    steps = [r["step"] for r in train]
    fig, (ax_loss, ax_tps, ax_mfu) = plt.subplots(1, 3, figsize=(14, 3.6))
    ax_loss.plot(steps, [r["loss"] for r in train], lw=1)
    ax_loss.set(xlabel="step", ylabel="BCE loss", title="training loss")
    if evals:
        ax_auc = ax_loss.twinx()
        ax_auc.plot([r["step"] for r in evals], [r["eval_auc"] for r in evals], "o-", color="tab:red", ms=3)
        ax_auc.set_ylabel("held-out AUC", color="tab:red")
    ax_tps.plot(steps, [r["tokens_per_s"] for r in train], lw=1, color="tab:green")
    ax_tps.set(xlabel="step", ylabel="tokens/s", title="throughput (real tokens)")
    if train and all(r.get("mfu") is not None for r in train):
        ax_mfu.plot(steps, [100 * r["mfu"] for r in train], lw=1, color="tab:purple")
        ax_mfu.set(xlabel="step", ylabel="MFU (%)", title="model FLOPs utilisation")
    else:
        ax_mfu.plot(steps, [r.get("flops_per_s", 0.0) / 1e12 for r in train], lw=1, color="tab:purple")
        ax_mfu.set(xlabel="step", ylabel="model TFLOP/s", title="achieved model TFLOP/s (peak unknown: no MFU)")
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
