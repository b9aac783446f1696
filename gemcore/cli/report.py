"""Console output for ``gem train``: the progress bar and the end-of-run summary."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


@contextlib.contextmanager
def progress_bar(console, total_steps: int, disabled: bool = False):
    """Yields ``update(step, loss, tokens_per_s, mfu=None, padded_waste=None)``; the bar appears
    at the first update (an error before training prints no bar)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if disabled:
        yield lambda *a, **k: None
        return
    # narrower terminals: a shorter bar and no padding column (the summary has it), so that no
    # column is cut short at 80 characters
    wide = console.width >= 110
    columns = [TextColumn("train"), BarColumn(bar_width=40 if wide else 10), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("loss {task.fields[loss]:.4f}"),
               TextColumn("{task.fields[tps]:,.0f} tok/s"), TextColumn("MFU {task.fields[mfu]}")]
    if wide:
        columns.append(TextColumn("padding would waste {task.fields[waste]}"))
    progress = Progress(*columns, console=console, transient=False)
    task = None

    def update(step: int, loss: float, tokens_per_s: float, mfu: float | None = None,
               padded_waste: float | None = None) -> None:
        nonlocal task
        if task is None:  # drawn from the first logged step on: nothing shows before training runs
            progress.start()
            task = progress.add_task("train", total=total_steps, completed=step, loss=loss,
                                     tps=tokens_per_s, mfu=_pct(mfu), waste=_pct(padded_waste))
        progress.update(task, completed=step, loss=loss, tps=tokens_per_s, mfu=_pct(mfu),
                        waste=_pct(padded_waste))

    try:
        yield update
    finally:
        if task is not None:
            progress.stop()


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_summary(console, summary: dict[str, Any], run_dir: Path) -> None:
    from rich.table import Table

    table = Table(title=f"gem train: {run_dir}", show_header=False)
    mfu = summary["mfu"]
    steps = str(summary["steps"])
    if summary.get("resumed_from_step") is not None:
        steps += f" (resumed at {summary['resumed_from_step']})"
    if summary.get("stopped") and summary["stopped"] != "max_steps":
        steps += f", stopped by {summary['stopped']}"
    rows = [
        ("steps", steps),
        ("tokens/s (real tokens)", _fmt(summary["tokens_per_s"], ",.0f")),
        ("model FLOPs per token", _fmt(summary["model_flops_per_token"], ",.0f")),
        ("achieved FLOP/s", _fmt(summary["achieved_flops_per_s"], ".3e")),
        ("MFU", "n/a (peak unknown for this device; --peak-tflops sets it)" if mfu is None else f"{100 * mfu:.1f}%"),
        ("work padding would waste", _pct(summary.get("padded_waste"))),
        ("loss first -> last", f"{_fmt(summary['loss_first'], '.4f')} -> {_fmt(summary['loss_last'], '.4f')}"),
        ("held-out AUC", f"{_fmt(summary['auc'], '.4f')} (chance: 0.5)"),
        ("parameters", f"{summary['parameters']:,}"),
        ("parallelism", summary["parallelism"]),
    ]
    carriers = summary.get("mesh_carriers") or {}
    if carriers:
        rows.append(("collectives carried by", ", ".join(f"{dim}: {name}" for dim, name in carriers.items())))
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
