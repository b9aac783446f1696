"""``gem train`` as a new user meets it: resume of a finished run, the LR schedule across a longer
resume, bad step counts, output before training starts and under a launcher, and own data."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import gem, tiny_set_args

from gemcore.trainer import LRSchedule, lr_factor

ROOT = Path(__file__).resolve().parents[1]


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_of_a_complete_run_says_so(tmp_path, monkeypatch):
    assert gem(["train", "--quiet", "--name", "r", "--max-steps", "4", *tiny_set_args()],
               tmp_path, monkeypatch).returncode == 0
    before = (tmp_path / "runs" / "r" / "metrics.jsonl").read_text()
    done = gem(["train", "--quiet", "--resume", "runs/r", "--max-steps", "3"], tmp_path, monkeypatch)
    assert done.returncode == 0
    assert "already complete" in done.stderr and "step 4 >= run.max_steps 3" in done.stderr
    assert "loss" not in done.stdout   # no summary of a run that did not train
    assert (tmp_path / "runs" / "r" / "metrics.jsonl").read_text() == before


def test_lr_schedule_rebased_on_a_longer_resume():
    s = LRSchedule(warmup=2, total=10, min_ratio=0.1)
    first = [s(i) for i in range(10)]
    assert first == [lr_factor(i, 2, 10, 0.1) for i in range(10)]
    s.extend_to(10, 20)
    assert s(10) == lr_factor(10, 2, 10, 0.1)       # continuous at the resume step
    later = [s(i) for i in range(10, 21)]
    assert all(a >= b for a, b in zip(later, later[1:])) and later[-1] == pytest.approx(0.1)
    assert [s(i) for i in range(10)] == first         # the steps before the resume keep their LRs
    # during the warm-up only the end of the one cosine moves
    w = LRSchedule(warmup=5, total=10, min_ratio=0.1)
    w.extend_to(3, 30)
    assert [w(i) for i in range(30)] == [lr_factor(i, 5, 30, 0.1) for i in range(30)]
    # the state round-trips, with a second extension from mid-decay
    s.extend_to(15, 40)
    t = LRSchedule(warmup=2, total=99, min_ratio=0.1)
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert [t(i) for i in range(41)] == [s(i) for i in range(41)]
    assert s(15) == pytest.approx(later[5])


def test_resume_with_more_steps_continues_the_lr(tmp_path, monkeypatch):
    """100-then-200 in miniature: 6 steps, then a resume to 12. The LR keeps decaying from where
    it was (a restarted cosine over 12 steps would jump from ~0.1x to ~0.6x of the peak)."""
    assert gem(["train", "--quiet", "--name", "r", "--max-steps", "6", *tiny_set_args()],
               tmp_path, monkeypatch).returncode == 0
    assert gem(["train", "--quiet", "--resume", "runs/r", "--max-steps", "12"], tmp_path, monkeypatch).returncode == 0
    lrs = [r["lr"] for r in read_rows(tmp_path / "runs" / "r") if "lr" in r]
    assert len(lrs) == 12
    peak = 3e-3
    step6_lr = peak * LRSchedule(2, 6, 0.1)(6)        # what the first run would have applied next
    assert lrs[6] == pytest.approx(step6_lr)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))   # non-increasing after the warm-up
    restarted = peak * lr_factor(6, 2, 12, 0.1)
    assert restarted > 3 * lrs[6]                     # the jump the re-base avoids


@pytest.mark.parametrize("value", ["0", "-5"])
def test_max_steps_below_one_is_exit_2(tmp_path, monkeypatch, value):
    result = gem(["train", "--quiet", f"--max-steps={value}"], tmp_path, monkeypatch)
    assert result.returncode == 2 and "--max-steps" in result.stderr and ">= 1" in result.stderr
    result = gem(["train", "--quiet", "--set", f"run.max_steps={value}"], tmp_path, monkeypatch)
    assert result.returncode == 2 and "run.max_steps must be >= 1" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_no_progress_bar_before_an_error(tmp_path):
    """A run that fails while starting prints the error line only (no bar reading "loss nan")."""
    env = {**os.environ, "FORCE_COLOR": "1", "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "gemcore.cli.main", "train", "--set", "data.source=jsonl",
                           "--set", "data.path=missing.jsonl", "--max-steps", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "gem train: error: data.path: no such file 'missing.jsonl'"]


def _train_output(tmp_path: Path, env_extra: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "TORCHELASTIC"))}
    env.update({"FORCE_COLOR": "1", "COLUMNS": "200", **env_extra})
    proc = subprocess.run([sys.executable, "-m", "gemcore.cli.main", "train", "--max-steps", "2",
                           *tiny_set_args()], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


def test_no_ansi_codes_under_a_launcher(tmp_path):
    """A rank's output is relayed by the launcher: plain text even where rich would colour
    (FORCE_COLOR makes it colour alone, so the check can fail)."""
    assert "\x1b[" in _train_output(tmp_path, {})
    out = _train_output(tmp_path, {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"})
    assert "\x1b[" not in out and "held-out AUC" in out


# ---------------------------------------------------------------------- own data
def _write(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _own(tmp_path, monkeypatch, path: Path, *extra: str):
    return gem(["train", "--quiet", "--max-steps", "1", *tiny_set_args(), "--set", "data.source=jsonl",
                "--set", f"data.path='{path}'", *extra], tmp_path, monkeypatch)


def test_item_id_beyond_num_items_names_line_id_and_setting(tmp_path, monkeypatch):
    good = {"items": [1, 2], "candidates": [3], "labels": [1]}
    path = _write(tmp_path / "u.jsonl", [good, good, {"items": [1, 64], "candidates": [3], "labels": [0]}])
    result = _own(tmp_path, monkeypatch, path)      # the tiny config has model.num_items = 64
    assert result.returncode == 2
    assert "line 3" in result.stderr and "item id 64" in result.stderr and "model.num_items" in result.stderr
    path = _write(tmp_path / "u.jsonl", [good, {"items": [1], "candidates": [-1], "labels": [0]}])
    result = _own(tmp_path, monkeypatch, path)
    assert result.returncode == 2 and "line 2" in result.stderr and "'candidates'" in result.stderr


def test_invalid_json_prints_one_position(tmp_path, monkeypatch):
    good = {"items": [1, 2], "candidates": [3], "labels": [1]}
    path = _write(tmp_path / "u.jsonl", [good, '{"items": [1, 2], "candidates": [3] "labels": [1]}'])
    result = _own(tmp_path, monkeypatch, path)
    assert result.returncode == 2
    line = result.stderr.strip()
    assert "line 2, column 37" in line and line.count("line") == 1 and "column" in line


def test_fewer_users_than_one_batch_warns(tmp_path, monkeypatch):
    rec = {"items": [1, 2], "candidates": [3], "labels": [1]}
    path = _write(tmp_path / "u.jsonl", [rec] * 9)     # 8 training users, 1 held out; batch 16
    with pytest.warns(UserWarning, match=r"8 training users .* fewer than one batch \(data.batch_size = 16\)"):
        result = _own(tmp_path, monkeypatch, path)
    assert result.returncode == 0, result.stderr


def _doc_section() -> str:
    text = (ROOT / "docs" / "training.md").read_text()
    start = text.index("## Train on your own data")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_the_documented_own_data_example_runs(tmp_path):
    """docs/training.md's example, as written: the JSONL file and the command."""
    section = _doc_section()
    records = re.search(r"```json\n(.*?)```", section, re.S).group(1)
    (tmp_path / "users.jsonl").write_text(records)
    command = re.search(r"```bash\n(gem train .*?)```", section, re.S).group(1).replace("\\\n", " ").split()
    assert command[:2] == ["gem", "train"] and "data.source=jsonl" in command
    proc = subprocess.run([sys.executable, "-m", "gemcore.cli.main", *command[1:]], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(next((tmp_path / "runs").glob("*/summary.json")).read_text())
    assert summary["steps"] > 0 and math.isfinite(summary["loss_last"])


@pytest.mark.parametrize("columns", [40, 80, 200])
def test_gem_plugins_cuts_nothing_at_any_width(tmp_path, columns):
    env = {**os.environ, "COLUMNS": str(columns)}
    proc = subprocess.run([sys.executable, "-m", "gemcore.cli.main", "plugins"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout and all(len(line) <= max(columns, 60) for line in proc.stdout.splitlines())
    listed = json.loads(subprocess.run([sys.executable, "-m", "gemcore.cli.main", "plugins", "--json"],
                                       cwd=tmp_path, capture_output=True, text=True, timeout=300).stdout)
    for entry in listed["hook_points"].values():
        assert entry["config_key"] in proc.stdout
        for impl in entry["implementations"]:
            assert impl["plugin"] in proc.stdout and impl["name"] in proc.stdout


@pytest.mark.parametrize("columns", [80, 120])
def test_progress_bar_cuts_no_column(columns):
    """Step count, elapsed time and the figures are whole at 80 characters too (a terminal of
    that width used to show '120/…' and '0:0…')."""
    import io

    from rich.console import Console

    from gemcore.cli.report import progress_bar

    buf = io.StringIO()
    console = Console(file=buf, width=columns, force_terminal=True, color_system=None)
    with progress_bar(console, 30000) as update:
        update(12000, 0.6931, 1221911.0, 0.123, 0.452)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue()).replace("\r", "\n")
    line = [row for row in text.splitlines() if row.strip()][-1]
    assert "…" not in line and len(line) <= columns
    for part in ("12000/30000", "0:00:0", "loss 0.6931", "1,221,911 tok/s", "MFU 12.3%"):
        assert part in line, (part, line)
    assert ("padding would waste 45.2%" in line) == (columns >= 110)


def test_default_run_computes_on_one_cpu_thread(tmp_path, monkeypatch):
    """run.threads = 1 by default (docs/training.md, "CPU threads"); 0 leaves torch's choice."""
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert gem(["train", "--quiet", "--max-steps", "1", *tiny_set_args()], tmp_path, monkeypatch).returncode == 0
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        assert gem(["train", "--quiet", "--max-steps", "1", "--set", "run.threads=0", *tiny_set_args()],
                   tmp_path, monkeypatch).returncode == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    bad = gem(["train", "--quiet", "--set", "run.threads=-1"], tmp_path, monkeypatch)
    assert bad.returncode == 2 and "run.threads must be >= 0" in bad.stderr
