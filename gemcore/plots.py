"""curves.png: loss and throughput against step, from a run's metrics.jsonl."""
from __future__ import annotations

import json
from pathlib import Path


def plot_curves(metrics_path: Path, out_path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_loss.plot(steps, [r["loss"] for r in rows], lw=1)
    ax_loss.set(xlabel="step", ylabel="BCE loss", title="training loss")
    ax_tps.plot(steps, [r["tokens_per_s"] for r in rows], lw=1, color="tab:green")
    ax_tps.set(xlabel="step", ylabel="tokens/s", title="throughput (real tokens)")
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
