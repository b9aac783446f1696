"""curves.png reads at a glance: smoothed loss over the faint raw one, held-out AUC as points on a
0.5-to-1 axis, titles inside their panels."""
from __future__ import annotations

import json
import math

import pytest

from gemcore.plots import draw_curves, plot_curves, smoothed


def _rows(steps: int = 200, evals: bool = True, mfu: bool = False) -> list[dict]:
    rows = []
    for s in range(1, steps + 1):
        rows.append({"step": s, "loss": 0.69 - 0.05 * math.log1p(s) + 0.03 * math.sin(7 * s),
                     "tokens_per_s": 20000 + 500 * math.sin(s), "flops_per_s": 1e9,
                     "mfu": 0.1 if mfu else None})
        if evals and s % 50 == 0:
            rows.append({"step": s, "eval_auc": 0.6 + 0.0004 * s})
    return rows


def test_smoothed_is_an_unbiased_ema():
    assert smoothed([2.0, 2.0, 2.0], span=9) == pytest.approx([2.0, 2.0, 2.0])
    out = smoothed([0.0, 1.0] * 50, span=19)
    assert max(out[20:]) - min(out[20:]) < 0.2 and out[-1] == pytest.approx(0.5, abs=0.06)


@pytest.mark.parametrize("evals, mfu", [(True, False), (False, True)])
def test_panels(evals, mfu):
    fig = draw_curves(_rows(evals=evals, mfu=mfu), final_auc=0.7 if evals else None)
    ax_loss, ax_auc, _, _ = fig.axes
    raw, smooth = ax_loss.get_lines()
    assert raw.get_alpha() < 0.5 and (smooth.get_alpha() or 1.0) == 1.0
    assert smooth.get_linewidth() > raw.get_linewidth()
    def jitter(y):
        return max(abs(a - b) for a, b in zip(y[21:], y[20:-1]))
    assert jitter(smooth.get_ydata()) < 0.5 * jitter(raw.get_ydata())   # the wiggle is gone
    assert ax_auc.get_ylim() == pytest.approx((0.48, 1.0))    # chance to perfect, not zoomed
    points = [ln for ln in ax_auc.get_lines() if ln.get_linestyle() == "None"]
    assert len(points) == 2 * int(evals) and (not evals or len(points[0].get_xdata()) == 4)
    assert not evals or (points[1].get_xdata()[0], points[1].get_ydata()[0]) == (200, 0.7)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        title, box = ax.title.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert ax.get_title() and box.x0 - 1 <= title.x0 and title.x1 <= box.x1 + 1, ax.get_title()


def test_plot_curves_writes_a_png(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in _rows(30)))
    out = plot_curves(metrics, tmp_path / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
