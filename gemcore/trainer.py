"""``gem train``: build the run from the config through the plugin manager, train, evaluate, report.

Data flow: Config -> plugin manager resolves one implementation per hook point -> GemModel (with
the attention implementation) -> precision policy -> parallelism -> AdamW + warm-up/cosine ->
DataLoader over the selected batch sampler -> steps -> metrics.jsonl / checkpoints / summary.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gemcore import checkpoint
from gemcore.config import Config
from gemcore.data import JaggedDataset, load_user_data, make_synthetic
from gemcore.metrics import auc, peak_flops
from gemcore.model import GemModel
from gemcore.plugin_manager import GemPluginManager, PluginError


class TrainError(Exception):
    """A run that cannot start as configured (bad device, bad resume folder); exit code 2."""


@dataclass
class Components:
    """One resolved implementation per hook point."""

    attention: Any
    precision: Any
    parallelism: Any
    comm: Any
    sampler_factory: Any


def build_components(config: Config, manager: GemPluginManager) -> Components:
    """Resolve every hook point's configured implementation (PluginError names the bad one)."""
    attention = manager.resolve("attention", config.attention.impl).factory(config.attention)
    precision = manager.resolve("precision", config.precision.impl).factory(config.precision)
    comm = None
    if config.comms.backend != "none":
        comm = manager.resolve("communication", config.comms.backend).factory()
    parallelism = manager.resolve("parallelism", config.parallelism.impl).factory(config.parallelism, comm)
    sampler_factory = manager.resolve("data", config.data.sampler).factory
    return Components(attention, precision, parallelism, comm, sampler_factory)


def build_datasets(config: Config) -> tuple[JaggedDataset, JaggedDataset]:
    """(train, held-out) split of the configured source; the split is seeded, not positional."""
    d, m = config.data, config.model
    if d.source == "synthetic":
        data = make_synthetic(num_users=d.num_users, num_items=m.num_items, num_actions=m.num_actions,
                              max_len=d.max_len, num_candidates=d.num_candidates,
                              num_clusters=d.num_clusters, kind=d.kind, seed=config.run.seed)
    else:
        data = load_user_data(d.path, source=d.source, num_items=m.num_items,
                              num_actions=m.num_actions, time_buckets=m.time_buckets)
    perm = np.random.default_rng(config.run.seed + 1).permutation(len(data))
    n_heldout = max(1, int(len(data) * d.heldout_fraction))
    if len(data) - n_heldout < 1:
        raise TrainError(f"data: {len(data)} users are too few to hold {n_heldout} out")
    return data.subset(perm[n_heldout:]), data.subset(perm[:n_heldout])


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to ``min_ratio`` at ``total`` steps."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device cuda: no CUDA GPU is available on this machine")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    """Owns one run: model, optimizer, schedule, sampler, and the run folder."""

    def __init__(self, config: Config, manager: GemPluginManager, run_dir: Path):
        self.config, self.manager, self.run_dir = config, manager, run_dir
        self.device = resolve_device(config.run.device)
        if config.run.threads:
            torch.set_num_threads(config.run.threads)
        seed_everything(config.run.seed)
        self.parts = build_components(config, manager)
        self.train_data, self.heldout_data = build_datasets(config)
        model = GemModel(config.model, self.parts.attention)
        model = self.parts.precision.apply(model)
        self.model = self.parts.parallelism.apply(model, self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.train.lr,
                                           weight_decay=config.train.weight_decay)
        t = config.train
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, t.warmup_steps, config.run.max_steps, t.min_lr_ratio))
        par = self.parts.parallelism
        self.sampler = self.parts.sampler_factory(
            self.train_data.lengths, batch_size=config.data.batch_size, world_size=par.world_size,
            rank=par.rank, seed=config.run.seed, drop_last=False)
        self.step = 0
        self.tokens_total = 0
        self.flops_total = 0.0

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "sampler": self.sampler.state_dict(), "rng_torch": torch.get_rng_state(),
                "rng_numpy": np.random.get_state(), "rng_python": random.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(state["rng_torch"])
        np.random.set_state(state["rng_numpy"])
        random.setstate(state["rng_python"])

    def save(self) -> Path:
        return checkpoint.save_atomic(self.state_dict(), self.run_dir / "checkpoint.pt")

    # ------------------------------------------------------------------ training
    def train_step(self, batch) -> torch.Tensor:
        self.model.train()
        with self.parts.precision.autocast(self.device.type):
            loss = self.model.loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.config.train.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.train.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return loss.detach()

    @torch.no_grad()
    def evaluate(self, max_users: int) -> float:
        """Held-out AUC over up to ``max_users`` users."""
        self.model.eval()
        n = min(len(self.heldout_data), max_users)
        scores, labels = [], []
        for start in range(0, n, 256):
            batch = self.heldout_data.__getitems__(list(range(start, min(n, start + 256)))).to(self.device)
            with self.parts.precision.autocast(self.device.type):
                scores.append(self.model(batch).float().cpu())
            labels.append(batch.labels.cpu())
        return auc(torch.cat(scores), torch.cat(labels))

    def fit(self, progress=None) -> list[dict[str, float]]:
        """Train up to ``run.max_steps`` (or ``train.max_time_s``); returns the metric rows."""
        cfg = self.config
        loader = torch.utils.data.DataLoader(self.train_data, batch_sampler=self.sampler,
                                             collate_fn=lambda b: b,
                                             pin_memory=self.device.type == "cuda")
        model_flops = self.model.flops if hasattr(self.model, "flops") else None
        rows: list[dict[str, float]] = []
        pending: list[tuple[int, torch.Tensor, int, float]] = []
        t_start = t_last = time.perf_counter()
        tokens_since = flops_since = 0.0
        metrics_file = (self.run_dir / "metrics.jsonl").open("a")
        try:
            for batch in loader:
                if self.step >= cfg.run.max_steps:
                    break
                batch = batch.to(self.device)
                loss = self.train_step(batch)
                self.step += 1
                step_flops = model_flops(batch.num_tokens, batch.sum_sq_len) if model_flops else 0.0
                tokens_since += batch.num_tokens
                flops_since += step_flops
                self.tokens_total += batch.num_tokens
                self.flops_total += step_flops
                pending.append((self.step, loss, batch.num_tokens, self.scheduler.get_last_lr()[0]))
                last = self.step >= cfg.run.max_steps
                out_of_time = cfg.train.max_time_s and time.perf_counter() - t_start > cfg.train.max_time_s
                if len(pending) >= cfg.run.log_every or last or out_of_time:
                    rows += self._flush(pending, tokens_since, flops_since, t_last, metrics_file, progress)
                    pending, tokens_since, flops_since, t_last = [], 0.0, 0.0, time.perf_counter()
                if cfg.train.checkpoint_every and self.step % cfg.train.checkpoint_every == 0:
                    self.save()
                if out_of_time:
                    break
        finally:
            metrics_file.close()
        return rows

    def _flush(self, pending, tokens, flops, t_last, metrics_file, progress) -> list[dict[str, float]]:
        """One host sync per logging interval: losses to host, throughput over the interval."""
        losses = torch.stack([p[1] for p in pending]).float().cpu().tolist()
        elapsed = max(time.perf_counter() - t_last, 1e-9)
        tokens_per_s = tokens / elapsed
        rows = []
        for (step, _, num_tokens, lr), loss in zip(pending, losses):
            row = {"step": step, "loss": loss, "tokens": num_tokens, "tokens_per_s": tokens_per_s,
                   "flops_per_s": flops / elapsed, "lr": lr}
            rows.append(row)
            metrics_file.write(json.dumps(row) + "\n")
            self.manager.hook.gemcore_after_step(step=step, metrics=row)
        metrics_file.flush()
        if progress is not None:
            progress(self.step, losses[-1], tokens_per_s)
        return rows

    def summarize(self, rows: list[dict[str, float]], wall_s: float, auc_value: float) -> dict[str, Any]:
        tokens, flops = self.tokens_total, self.flops_total
        flops_per_s = flops / wall_s if wall_s > 0 else 0.0
        peak = peak_flops(self.device)
        return {
            "steps": self.step,
            "tokens": tokens,
            "train_time_s": wall_s,
            "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
            "model_flops_per_token": flops / tokens if tokens else None,
            "achieved_flops_per_s": flops_per_s,
            "peak_flops_per_s": peak,
            "mfu": flops_per_s / peak if peak else None,
            "loss_first": rows[0]["loss"] if rows else None,
            "loss_last": rows[-1]["loss"] if rows else None,
            "auc": auc_value,
            "device": str(self.device),
            "parallelism": self.parts.parallelism.describe(),
            "parameters": sum(p.numel() for p in self.model.parameters()),
        }


def prepare_run_dir(config: Config, resume: str | None) -> Path:
    if resume:
        run_dir = Path(resume)
        if not (run_dir / "checkpoint.pt").exists():
            raise TrainError(f"--resume {resume}: no checkpoint.pt in that folder")
        return run_dir
    name = config.run.name or time.strftime("run-%Y%m%d-%H%M%S")
    run_dir = Path(config.run.out_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    return run_dir


def run_training(config: Config, manager: GemPluginManager, *, resume: str | None = None,
                 progress=None) -> tuple[dict[str, Any], Path]:
    """The whole ``gem train`` job; returns (summary, run folder)."""
    run_dir = prepare_run_dir(config, resume)
    manager.hook.gemcore_configure.call_historic(kwargs={"config": config})
    trainer = Trainer(config, manager, run_dir)
    if resume:
        trainer.load_state_dict(checkpoint.load(run_dir / "checkpoint.pt"))
    (run_dir / "config.toml").write_text(config.to_toml())
    t0 = time.perf_counter()
    rows = trainer.fit(progress)
    wall_s = time.perf_counter() - t0
    trainer.save()
    auc_value = trainer.evaluate(config.run.eval_users)
    summary = trainer.summarize(rows, wall_s, auc_value)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    from gemcore.plots import plot_curves  # matplotlib is imported only when a run finishes

    plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    manager.hook.gemcore_end_run(summary=summary, run_dir=run_dir)
    return summary, run_dir


__all__ = ["Trainer", "TrainError", "run_training", "build_components", "PluginError"]
