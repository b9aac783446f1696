"""curves.png: a run's loss, held-out AUC, throughput and MFU against step, from metrics.jsonl."""
from __future__ import annotations

import json
from pathlib import Path


def smoothed(values: list[float], span: int) -> list[float]:
    """Exponential moving average with weight ``2 / (span + 1)`` per new value, bias-corrected
    (the first values are not pulled towards 0)."""
    alpha = 2.0 / (span + 1)
    out, avg, weight = [], 0.0, 0.0
    for v in values:
        avg = (1 - alpha) * avg + alpha * v
        weight = (1 - alpha) * weight + alpha
        out.append(avg / weight)
    return out


def draw_curves(rows: list[dict], final_auc: float | None = None):
    """A 2 x 2 matplotlib figure: training loss (faint raw steps, a smoothed curve over them),
    held-out AUC as points on a fixed 0.5 (chance) to 1 axis (``final_auc``: the end-of-run
    evaluation, at the last step), real tokens/s, and MFU (achieved model TFLOP/s when the device's
    peak is unknown)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_auc" in r]
    steps = [r["step"] for r in train]
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.4))
    ax_loss, ax_auc, ax_tps, ax_mfu = axes.flat

    losses = [r["loss"] for r in train]
    span = max(10, len(losses) // 15)
    ax_loss.plot(steps, losses, lw=0.8, color="tab:blue", alpha=0.25, label="per step")
    ax_loss.plot(steps, smoothed(losses, span), lw=2, color="tab:blue", label=f"smoothed ({span}-step EMA)")
    ax_loss.set(xlabel="step", ylabel="BCE loss", title="training loss")
    if train:
        ax_loss.legend(loc="upper right", fontsize=8)

    ax_auc.axhline(0.5, color="grey", lw=1, ls="--", label="chance")
    if evals:
        ax_auc.plot([r["step"] for r in evals], [r["eval_auc"] for r in evals], "o", color="tab:red",
                    ms=5, label="during the run")
    if final_auc is not None and steps:
        ax_auc.plot([steps[-1]], [final_auc], "D", color="tab:red", ms=7, label=f"end: {final_auc:.3f}")
        evals = evals + [{"eval_auc": final_auc}]
    if evals:
        ax_auc.legend(loc="upper left", fontsize=8)
    else:
        ax_auc.text(0.5, 0.5, "no evaluations during the run\n(gem train --eval-every K)",
                    transform=ax_auc.transAxes, ha="center", va="center", color="grey")
    low = min([0.5] + [r["eval_auc"] for r in evals])
    ax_auc.set_ylim(max(0.0, low - 0.02), 1.0)
    ax_auc.set_xlim(0, 1.05 * max(steps[-1] if steps else 1, 1))  # room for the end-of-run point
    ax_auc.set(xlabel="step", ylabel="AUC", title="held-out AUC")

    ax_tps.plot(steps, [r["tokens_per_s"] for r in train], lw=1, color="tab:green")
    ax_tps.set_ylim(bottom=0)
    ax_tps.set(xlabel="step", ylabel="tokens/s", title="throughput (real tokens)")

    if train and all(r.get("mfu") is not None for r in train):
        ax_mfu.plot(steps, [100 * r["mfu"] for r in train], lw=1, color="tab:purple")
        ax_mfu.set(xlabel="step", ylabel="MFU (%)", title="model FLOPs utilisation")
    else:
        ax_mfu.plot(steps, [r.get("flops_per_s", 0.0) / 1e12 for r in train], lw=1, color="tab:purple")
        ax_mfu.set(xlabel="step", ylabel="model TFLOP/s", title="model TFLOP/s (peak unknown)")
    ax_mfu.set_ylim(bottom=0)
    fig.tight_layout()
    return fig


def plot_curves(metrics_path: Path, out_path: Path, final_auc: float | None = None) -> Path:
    """Draw :func:`draw_curves` from ``metrics_path`` (metrics.jsonl) into ``out_path``."""
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    fig = draw_curves(rows, final_auc)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
