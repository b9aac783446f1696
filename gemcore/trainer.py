"""``gem train``: build the run from the config through the plugin manager, train, evaluate, report.

Data flow: Config -> plugin manager resolves one implementation per hook point -> GemModel (with
the attention implementation) -> precision policy -> parallelism -> AdamW + warm-up/cosine ->
the selected batch sampler (each rank reads only its own samples) -> steps -> metrics.jsonl /
checkpoint.pt / summary.json / curves.png in the run folder (written by rank 0 only). A pipelined
model (pp > 1: it has ``forward_backward``) trains through that method, its checkpoint is merged
from the stages (gemcore/parallel/pipeline.py) and global rank 0 writes.

The trainer drives the epochs as torch's samplers expect: it iterates the sampler over one epoch
(``len(sampler)`` steps), then calls ``set_epoch(epoch + 1)`` and iterates again, until
``run.max_steps``.

Resume is exact: the checkpoint holds the model, optimizer, LR schedule, gradient scaler, sampler
(epoch and step within it) and RNG states, the epoch and the step, and the loop consumes exactly
one sampler step per optimizer step, so on CPU a 2N-step run stopped after N steps and resumed
gives the same losses, bit for bit, as 2N steps in one go. A resume with another
``run.max_steps`` re-bases the LR decay (:class:`LRSchedule`).
"""
from __future__ import annotations

import inspect
import json
import math
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from gemcore import checkpoint
from gemcore.config import Config
from gemcore.cuda_graphs import GraphedForwardBackward
from gemcore.data import JaggedDataset, load_user_data, make_synthetic
from gemcore.determinism import deterministic_algorithms
from gemcore.gc_schedule import ScheduledGC
from gemcore.metrics import auc, peak_flops
from gemcore.model import GemModel, click_loss
from gemcore.plugin_manager import GemPluginManager, PluginError
from gemcore.precision import flush_denormals

CHECKPOINT_NAME = "checkpoint.pt"


class TrainError(Exception):
    """A run that cannot start as configured (bad device, bad resume folder); exit code 2."""


class RunComplete(Exception):
    """A resumed run whose checkpoint already reached ``run.max_steps``: nothing to train."""

    def __init__(self, run_dir: Path, step: int, max_steps: int):
        super().__init__(f"{run_dir} is already complete: its checkpoint is at step {step} >= "
                         f"run.max_steps {max_steps}; nothing to train (a larger --max-steps continues it)")
        self.run_dir, self.step, self.max_steps = run_dir, step, max_steps


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
        from gemcore import comms  # "auto" and plugin names resolve here; installs the abort hook

        try:
            comm = comms.init(config.comms.backend, manager=manager, timeout_s=config.comms.timeout_s,
                              check=config.comms.check)
        except RuntimeError as exc:  # a backend that cannot run here says why in one line
            raise TrainError(f"comms.backend = {config.comms.backend!r}: {exc}") from None
    make_parallelism = manager.resolve("parallelism", config.parallelism.impl).factory
    parallelism = make_parallelism(config.parallelism,
                                   **_accepted(make_parallelism, {"comm": comm, "run_config": config}))
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
        try:
            data = load_user_data(d.path, source=d.source, num_items=m.num_items,
                                  num_actions=m.num_actions, time_buckets=m.time_buckets)
        except ValueError as exc:  # name the file even where the loader's message names only the row
            raise ValueError(str(exc) if str(d.path) in str(exc) else f"{d.path}: {exc}") from None
    perm = np.random.default_rng(config.run.seed + 1).permutation(len(data))
    n_heldout = max(1, int(len(data) * d.heldout_fraction))
    if len(data) - n_heldout < 1:
        raise TrainError(f"data: {len(data)} users are too few to hold {n_heldout} out")
    n_train = len(data) - n_heldout
    if n_train < d.batch_size:
        warnings.warn(f"data: {n_train} training users ({len(data)} in the data, {n_heldout} held out) are "
                      f"fewer than one batch (data.batch_size = {d.batch_size}): every step trains on all "
                      f"of them; lower data.batch_size or add users", stacklevel=2)
    return data.subset(perm[n_heldout:]), data.subset(perm[:n_heldout])


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to ``min_ratio`` at ``total`` steps."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class LRSchedule:
    """The LR multiplier of step ``s``: warm-up, then cosine to ``min_ratio`` at ``total``
    (:func:`lr_factor`). A resume that changes ``run.max_steps`` re-bases the decay at the resume
    step (:meth:`extend_to`): from the multiplier reached there, a cosine to ``min_ratio`` at the
    new last step, so the LR does not jump. The re-bases travel in the checkpoint."""

    def __init__(self, warmup: int, total: int, min_ratio: float):
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio
        #: (first step, multiplier there, last step) of each re-based decay, oldest first
        self.rebased: list[tuple[int, float, int]] = []

    def __call__(self, step: int) -> float:
        for start, f0, end in reversed(self.rebased):
            if step >= start:
                progress = min(1.0, (step - start) / max(1, end - start))
                return self.min_ratio + (f0 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return lr_factor(step, self.warmup, self.total, self.min_ratio)

    @property
    def last_step(self) -> int:
        return self.rebased[-1][2] if self.rebased else self.total

    def extend_to(self, step: int, last_step: int) -> None:
        """From ``step`` on, decay to ``min_ratio`` at ``last_step``; during the warm-up (and
        before any re-base) only the end of the one cosine moves."""
        if last_step == self.last_step:
            return
        if step < self.warmup and not self.rebased:
            self.total = last_step
        else:
            self.rebased.append((step, self(step), last_step))

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total, "rebased": [list(x) for x in self.rebased]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total = int(state["total"])
        self.rebased = [(int(a), float(f), int(b)) for a, f, b in state["rebased"]]


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device cuda: no CUDA GPU is available on this machine")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GemModel inside a DDP/compile wrapper."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def sample_cost_fn(model: GemModel, cand_lengths: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """Per-sample training FLOPs from the model's counter, history plus candidates:
    ``lengths (N,) -> a·S + b·S²`` with ``S = lengths + cand_lengths``."""
    a, b = float(model.flops(1, 0)), float(model.flops(0, 1))

    def cost(lengths: torch.Tensor) -> torch.Tensor:
        if lengths.shape != cand_lengths.shape:
            raise ValueError(f"cost: expected the dataset's {cand_lengths.numel()} lengths, got {tuple(lengths.shape)}")
        seq = (lengths + cand_lengths).to(torch.float64)
        return a * seq + b * seq * seq

    return cost


def _accepted(factory: Callable, options: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``options`` that ``factory`` takes (older plugins' factories and precision
    policies need not take them)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return options
    return {k: v for k, v in options.items() if k in params}


class Trainer:
    """Owns one run: model, optimizer, schedule, sampler, and the run folder."""

    def __init__(self, config: Config, manager: GemPluginManager, run_dir: Path,
                 peak_flops_per_s: float | None = None):
        self.config, self.manager, self.run_dir = config, manager, run_dir
        self.device = resolve_device(config.run.device)
        if config.run.threads:
            torch.set_num_threads(config.run.threads)
        seed_everything(config.run.seed)
        self.parts = build_components(config, manager)
        self.train_data, self.heldout_data = build_datasets(config)
        model = GemModel(config.model, self.parts.attention)
        # the whole model's (a pipeline stage or a shard holds part of it after parallelism)
        self.num_parameters = sum(p.numel() for p in model.parameters())
        self.flop_counter = model.flops
        sample_cost = sample_cost_fn(model, self.train_data.cand_lengths)
        # the precision policy learns whether FSDP2 will shard the weights (to gather them in its format)
        fsdp_size = getattr(self.parts.parallelism, "fsdp_size", self.parts.parallelism.world_size)
        model = self.parts.precision.apply(model, **_accepted(self.parts.precision.apply,
                                                              {"fsdp_size": fsdp_size}))
        if config.train.compile:  # in place (state-dict names unchanged), before parallelism wraps the blocks
            for block in model.blocks:
                block.compile(dynamic=True)
        self.model = self.parts.parallelism.apply(model, self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.train.lr,
                                           weight_decay=config.train.weight_decay)
        t = config.train
        self.lr_schedule = LRSchedule(t.warmup_steps, config.run.max_steps, t.min_lr_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_schedule)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.parts.precision.compute_dtype == torch.float16)
        par = self.parts.parallelism
        # a pipeline (pp > 1) steps through forward_backward and holds one stage's parameters per
        # rank; its checkpoint is merged on the first stage's rank
        self.pipelined = callable(getattr(self.model, "forward_backward", None))
        self.graphed = self._graphed_forward_backward() if config.train.cuda_graphs else None
        # global rank 0 writes (data-parallel rank 0 is also held by its tp/cp/pp peers)
        self.is_main = par.rank == 0 and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0)
        # devices that share one data-parallel rank's batch (tp x cp x pp): per-device rates divide by it
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.model_parallel = max(1, world // max(1, par.world_size))
        options = {"cost": sample_cost,
                   "sub_batch": getattr(config.data, "sub_batch", 128)}
        self.sampler = self.parts.sampler_factory(
            self.train_data.lengths, batch_size=config.data.batch_size, world_size=par.world_size,
            rank=par.rank, seed=config.run.seed, drop_last=False,
            **_accepted(self.parts.sampler_factory, options))
        self.epoch = 0
        self.sampler.set_epoch(self.epoch)
        self.peak = peak_flops_per_s if peak_flops_per_s else peak_flops(self.device)
        self.step = 0
        self.resumed_from: int | None = None
        # whole-run counters (carried through checkpoints)
        self.tokens_total = 0
        self.flops_total = 0.0
        self.padded_flops_total = 0.0
        self.train_time_total_s = 0.0
        self.eval_history: list[dict[str, float]] = []

    def _graphed_forward_backward(self) -> GraphedForwardBackward:
        """train.cuda_graphs: the forward and backward replayed as CUDA graphs (gemcore.cuda_graphs)."""
        why = ("it needs a CUDA device" if self.device.type != "cuda" else
               "it runs on one GPU without parallelism" if (self.pipelined or self.parts.parallelism.world_size > 1
                                                            or torch.distributed.is_initialized()) else
               "float16 loss scaling is not captured; use bf16" if self.scaler.is_enabled() else "")
        if why:
            raise ValueError(f"train.cuda_graphs: {why}")
        return GraphedForwardBackward(self._loss, self.model.parameters())

    def _loss(self, batch) -> torch.Tensor:
        """The batch's click loss under the precision's autocast, through the (possibly wrapped)
        model's forward, so DDP/FSDP hooks see it."""
        with self.parts.precision.autocast(self.device.type):
            return click_loss(self.model(batch), batch.labels, batch.label_weights)

    # ------------------------------------------------------------------ checkpoints
    def _distributed(self) -> bool:
        """More than one process holds the model (data-parallel ranks, or pipeline stages)."""
        return (self.parts.parallelism.world_size > 1 or self.pipelined) and torch.distributed.is_initialized()

    def state_dict(self) -> dict[str, Any]:
        """The whole training state; under torch.distributed a collective (every rank calls it),
        gathering sharded (FSDP2) or wrapped (DDP) model and optimizer states into full ones."""
        if self._distributed():   # stages, shards, experts and TP layout: gemcore/parallel/state_dict.py
            from gemcore.parallel.state_dict import full_state_dict

            model_state, optim_state = full_state_dict(unwrap(self.model), self.optimizer)
        else:
            model_state, optim_state = self.model.state_dict(), self.optimizer.state_dict()
        return {"format_version": checkpoint.FORMAT_VERSION, "step": self.step, "epoch": self.epoch,
                "config": self.config.to_dict(), "model": model_state,
                "optimizer": optim_state, "scheduler": self.scheduler.state_dict(),
                "lr_schedule": self.lr_schedule.state_dict(),
                "scaler": self.scaler.state_dict(), "sampler": self.sampler.state_dict(),
                "rng_torch": torch.get_rng_state(),
                "rng_cuda": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None,
                "rng_numpy": np.random.get_state(), "rng_python": random.getstate(),
                "counters": {"tokens": self.tokens_total, "flops": self.flops_total,
                             "padded_flops": self.padded_flops_total, "train_time_s": self.train_time_total_s},
                "eval_history": self.eval_history}

    def load_state_dict(self, state: dict[str, Any], path: Path | str = CHECKPOINT_NAME) -> None:
        """Restore a checkpoint; errors (another config, wrong shapes) name the file."""
        checkpoint.check_config(state["config"], self.config.to_dict(), path)
        try:
            if self._distributed():
                from gemcore.parallel.state_dict import load_full_state_dict

                load_full_state_dict(unwrap(self.model), self.optimizer, state["model"], state["optimizer"])
            else:
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, KeyError, ValueError) as exc:
            raise checkpoint.CheckpointError(f"checkpoint {path}: model/optimizer state does not fit "
                                             f"this model: {exc}") from None
        self.scheduler.load_state_dict(state["scheduler"])
        # the schedule the checkpoint ran on (older checkpoints: one cosine over their max_steps),
        # re-based here when this call's run.max_steps differs
        self.lr_schedule.load_state_dict(state.get("lr_schedule") or
                                         {"total": state["config"]["run"]["max_steps"], "rebased": []})
        self.lr_schedule.extend_to(int(state["step"]), self.config.run.max_steps)
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * self.lr_schedule(int(state["step"]))
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.sampler.load_state_dict(state["sampler"])
        self.epoch = int(state.get("epoch", 0))
        torch.set_rng_state(state["rng_torch"])
        if state.get("rng_cuda") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state_all(state["rng_cuda"])
        np.random.set_state(state["rng_numpy"])
        random.setstate(state["rng_python"])
        self.step = self.resumed_from = int(state["step"])
        counters = state.get("counters", {})
        self.tokens_total = int(counters.get("tokens", 0))
        self.flops_total = float(counters.get("flops", 0.0))
        self.padded_flops_total = float(counters.get("padded_flops", 0.0))
        self.train_time_total_s = float(counters.get("train_time_s", 0.0))
        self.eval_history = list(state.get("eval_history", []))

    def save(self) -> Path | None:
        """Write the checkpoint atomically. Every rank calls it (gathering may be a collective);
        rank 0 writes: sampler and schedule states are the same on every rank."""
        state = self.state_dict()
        if not self.is_main:
            return None
        return checkpoint.save_atomic(state, self.run_dir / CHECKPOINT_NAME)

    # ------------------------------------------------------------------ training
    def train_step(self, batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One optimizer step; returns (loss, gradient norm before clipping or None), on device."""
        self.model.train()
        if self.pipelined:  # the schedule interleaves micro-batches' forwards and backwards
            self.optimizer.zero_grad(set_to_none=True)
            with self.parts.precision.autocast(self.device.type):
                loss = self.model.forward_backward(batch, scale=self.scaler.scale)
        elif self.graphed is not None:  # forward and backward replayed; each p.grad set
            loss = self.graphed(batch)
        else:
            loss = self._loss(batch)
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
        grad_norm = None
        if self.config.train.grad_clip:
            self.scaler.unscale_(self.optimizer)
            # a parallelism may clip itself (mixed DTensor/tensor parameters under TP and EP)
            clip = getattr(self.parts.parallelism, "clip_grad_norm_", torch.nn.utils.clip_grad_norm_)
            grad_norm = clip(self.model.parameters(), self.config.train.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        if grad_norm is not None and hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2/TP
            grad_norm = grad_norm.full_tensor()
        return loss.detach(), None if grad_norm is None else grad_norm.detach()

    def close(self) -> None:
        """End of the run: the parallelism's process groups, then the communicator, released."""
        close = getattr(self.parts.parallelism, "close", None)  # third-party ones may lack it
        if close is not None:
            close()
        if self.parts.comm is not None:
            from gemcore import comms

            comms.finalize()

    @torch.no_grad()
    def evaluate(self, max_users: int) -> float:
        """Held-out AUC over up to ``max_users`` users."""
        self.model.eval()
        n = min(len(self.heldout_data), max_users)
        scores, labels = [], []
        for start in range(0, n, 256):
            batch = self.heldout_data.__getitems__(list(range(start, min(n, start + 256)))).to(self.device)
            with self.parts.precision.autocast(self.device.type):
                scores.append(unwrap(self.model)(batch).float().cpu())
            labels.append(batch.labels.cpu())
        return auc(torch.cat(scores), torch.cat(labels))

    def step_flops(self, batch) -> tuple[float, float]:
        """(model FLOPs on real tokens, FLOPs a padded implementation would spend) of one step."""
        real = self.flop_counter(batch.num_tokens, batch.sum_sq_len)
        padded_len = batch.batch_size * batch.max_len
        padded = self.flop_counter(padded_len, padded_len * batch.max_len)
        return float(real), float(padded)

    def fit(self, progress=None, stop_after: int | None = None) -> tuple[list[dict[str, Any]], str]:
        """Train until ``run.max_steps``, ``train.max_time_s`` or ``stop_after`` steps of this call.

        Returns (metric rows of this call, why it stopped: "max_steps", "max_time" or "stop_after").
        """
        cfg = self.config
        eval_every = int(getattr(cfg.train, "eval_every", 0) or 0)
        log_every = max(1, cfg.run.log_every)
        rows: list[dict[str, Any]] = []
        pending: list[dict[str, Any]] = []
        batches = self._batches()
        metrics_file = (self.run_dir / "metrics.jsonl").open("a") if self.is_main else None
        t_start = t_last = time.perf_counter()
        steps_done, stopped = 0, "max_steps"
        # collections on a schedule, not inside random steps (gemcore.gc_schedule)
        gc_schedule = ScheduledGC(cfg.train.gc_every).start()
        try:
            while self.step < cfg.run.max_steps:
                if stop_after is not None and steps_done >= stop_after:
                    stopped = "stop_after"
                    break
                batch = next(batches).to(self.device)
                lr = self.optimizer.param_groups[0]["lr"]  # the rate this step applies
                loss, grad_norm = self.train_step(batch)
                self.step += 1
                steps_done += 1
                gc_schedule.step(steps_done)
                real, padded = self.step_flops(batch)
                self.tokens_total += batch.num_tokens
                self.flops_total += real
                self.padded_flops_total += padded
                pending.append({"step": self.step, "loss": loss, "grad_norm": grad_norm,
                                "tokens": batch.num_tokens, "flops": real, "padded_flops": padded,
                                "lr": lr})
                out_of_time = self._out_of_time(time.perf_counter() - t_start)
                finished = self.step >= cfg.run.max_steps or out_of_time or (
                    stop_after is not None and steps_done >= stop_after)
                ckpt_now = bool(cfg.train.checkpoint_every) and self.step % cfg.train.checkpoint_every == 0
                eval_now = bool(eval_every) and self.step % eval_every == 0
                if len(pending) >= log_every or finished or ckpt_now or eval_now:
                    now = time.perf_counter()
                    self.train_time_total_s += now - t_last
                    rows += self._flush(pending, now - t_last, now - t_start, metrics_file, progress)
                    pending = []
                    if eval_now:
                        self._evaluate_and_log(metrics_file)
                    if ckpt_now and not finished:
                        self.save()
                    t_last = time.perf_counter()  # evaluation and saving are not training time
                if out_of_time:
                    stopped = "max_time"
                    break
        finally:
            gc_schedule.stop()
            if metrics_file is not None:
                metrics_file.close()
        return rows, stopped

    def _batches(self):
        """Training batches, epoch after epoch: the rest of the sampler's current epoch (all of it
        unless resumed mid-epoch), then ``set_epoch(epoch + 1)`` and the next one.

        :raises ValueError: a whole epoch holds no step (fewer samples than one batch with
            ``drop_last``).
        """
        # num_workers=0: the loader asks the sampler for exactly one index list per step, so the
        # sampler's state in a checkpoint is the data position (exact resume)
        loader = torch.utils.data.DataLoader(self.train_data, batch_sampler=self.sampler, collate_fn=_collated,
                                             pin_memory=self.device.type == "cuda")
        fresh_epoch = False  # a resumed epoch may have no step left; a fresh one must have one
        while True:
            steps = 0
            for batch in loader:
                steps += 1
                yield batch
            if steps == 0 and fresh_epoch:
                raise ValueError(f"the {self.config.data.sampler!r} sampler yields no step in epoch "
                                 f"{self.epoch} ({len(self.train_data)} training samples, data.batch_size = "
                                 f"{self.config.data.batch_size})")
            self.epoch += 1
            self.sampler.set_epoch(self.epoch)
            fresh_epoch = True

    def _out_of_time(self, elapsed_s: float) -> bool:
        """Past ``train.max_time_s``? With several ranks, any rank's clock stops all of them (one
        tiny all-reduce per step, only when a time limit is set), so no rank waits in a collective."""
        limit = self.config.train.max_time_s
        if not limit:
            return False
        late = elapsed_s > limit
        if self.parts.parallelism.world_size > 1 or self.pipelined:
            flag = torch.tensor([1.0 if late else 0.0], device=self.device)
            late = float(self.parts.parallelism.all_reduce_mean(flag).item()) > 0.0
        return late

    def _evaluate_and_log(self, metrics_file) -> None:
        value = self.evaluate(self.config.run.eval_users)
        row = {"step": self.step, "eval_auc": value}
        self.eval_history.append(row)
        if metrics_file is not None:
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()

    def _flush(self, pending, elapsed_s, since_start_s, metrics_file, progress) -> list[dict[str, Any]]:
        """One host sync per logging interval: losses (averaged over ranks) to host, throughput
        and MFU over the interval (every row of an interval carries the interval's rates)."""
        losses = self.parts.parallelism.all_reduce_mean(torch.stack([p["loss"] for p in pending]).float())
        losses = losses.cpu().tolist()
        norms = [None] * len(pending)
        if pending[0]["grad_norm"] is not None:  # clipping on: every step has a norm
            norms = torch.stack([p["grad_norm"] for p in pending]).float().cpu().tolist()
        elapsed_s = max(elapsed_s, 1e-9)
        tokens_per_s = sum(p["tokens"] for p in pending) / elapsed_s / self.model_parallel
        flops_per_s = sum(p["flops"] for p in pending) / elapsed_s / self.model_parallel
        mfu = flops_per_s / self.peak if self.peak else None
        rows = []
        for p, loss, norm in zip(pending, losses, norms):
            row = {"step": p["step"], "loss": loss, "lr": p["lr"], "grad_norm": norm, "tokens": p["tokens"],
                   "tokens_per_s": tokens_per_s, "flops_per_s": flops_per_s, "mfu": mfu,
                   "padded_waste": 1.0 - p["flops"] / p["padded_flops"] if p["padded_flops"] else 0.0,
                   "time_s": since_start_s}
            rows.append(row)
            if metrics_file is not None:
                metrics_file.write(json.dumps(row) + "\n")
            self.manager.hook.gemcore_after_step(step=p["step"], metrics=row)
        if metrics_file is not None:
            metrics_file.flush()
        if progress is not None and self.is_main:
            progress(self.step, losses[-1], tokens_per_s, mfu=mfu, padded_waste=rows[-1]["padded_waste"])
        return rows

    def summarize(self, rows: list[dict[str, Any]], wall_s: float, auc_value: float, stopped: str) -> dict[str, Any]:
        """Whole-run totals (across resumes) plus this call's losses. ``tokens`` and the FLOP
        totals are this data-parallel rank's batches; the rates (tokens/s, FLOP/s, MFU) are per
        device: divided by the model-parallel degree (tp x cp x pp devices share a batch). Losses
        are averaged over ranks."""
        tokens, flops, train_s = self.tokens_total, self.flops_total, self.train_time_total_s
        flops_per_s = flops / train_s / self.model_parallel if train_s > 0 else 0.0
        return {
            "steps": self.step,
            "steps_this_run": len(rows),
            "resumed_from_step": self.resumed_from,
            "stopped": stopped,
            "tokens": tokens,
            "train_time_s": train_s,
            "wall_time_s": wall_s,
            "tokens_per_s": tokens / train_s / self.model_parallel if train_s > 0 else 0.0,
            "model_flops_per_token": flops / tokens if tokens else None,
            "achieved_flops_per_s": flops_per_s,
            "peak_flops_per_s": self.peak,
            "mfu": flops_per_s / self.peak if self.peak else None,
            "padded_waste": 1.0 - flops / self.padded_flops_total if self.padded_flops_total else None,
            "loss_first": rows[0]["loss"] if rows else None,
            "loss_last": rows[-1]["loss"] if rows else None,
            "auc": auc_value,
            "eval_auc": self.eval_history,
            "device": str(self.device),
            "parallelism": self.parts.parallelism.describe(),
            "comms_backend": self.parts.comm.backend if self.parts.comm is not None else "none",
            "mesh_carriers": getattr(self.parts.parallelism, "carriers", dict)(),
            "world_size": self.parts.parallelism.world_size,
            "model_parallel": self.model_parallel,
            "rank": self.parts.parallelism.rank,
            "sampler": self.config.data.sampler,
            "parameters": self.num_parameters,
            "cuda_graphs": None if self.graphed is None else {
                "graphs": len(self.graphed.graphs), "replays": self.graphed.replays,
                "eager_steps": self.graphed.eager_steps, "padding": self.graphed.padding_fraction},
        }


def _collated(batch):
    """JaggedDataset.__getitems__ already returns a collated JaggedBatch."""
    return batch


def run_dir_for(config: Config, resume: str | None) -> Path:
    """The run folder: ``resume`` (which must hold a checkpoint) or ``<out_dir>/<name>``."""
    if resume:
        run_dir = Path(resume)
        if not (run_dir / CHECKPOINT_NAME).exists():
            raise TrainError(f"--resume {resume}: no {CHECKPOINT_NAME} in that folder")
        return run_dir
    return Path(config.run.out_dir) / (config.run.name or time.strftime("run-%Y%m%d-%H%M%S"))


def start_fresh(run_dir: Path) -> None:
    """Create the folder of a new run and clear what an earlier run of that name left."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", CHECKPOINT_NAME, "summary.json"):
        (run_dir / name).unlink(missing_ok=True)


def truncate_metrics(path: Path, step: int) -> None:
    """Drop rows logged after ``step`` (a run killed after its last checkpoint logged them)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in kept))


def run_training(config: Config, manager: GemPluginManager, *, resume: str | None = None,
                 progress=None, stop_after: int | None = None,
                 peak_flops_per_s: float | None = None) -> tuple[dict[str, Any], Path]:
    """The whole ``gem train`` job; returns (summary, run folder).

    ``resume``: a run folder to continue from its checkpoint. ``stop_after``: stop (and save)
    after this many steps of this call; the LR schedule still spans ``run.max_steps``.
    ``peak_flops_per_s``: the device's peak for MFU when the built-in table does not know it.
    """
    if stop_after is not None and stop_after < 0:
        raise ValueError(f"stop_after must be >= 0, got {stop_after}")
    manager.hook.gemcore_configure.call_historic(kwargs={"config": config})
    run_dir = run_dir_for(config, resume)
    ckpt_path = run_dir / CHECKPOINT_NAME
    state = None
    if resume:  # fail fast, before building anything
        state = checkpoint.load(ckpt_path)
        checkpoint.check_config(state["config"], config.to_dict(), ckpt_path)
        if int(state["step"]) >= config.run.max_steps:
            raise RunComplete(run_dir, int(state["step"]), config.run.max_steps)
    trainer = Trainer(config, manager, run_dir, peak_flops_per_s)
    if trainer.is_main:
        if state is None:
            start_fresh(run_dir)
        else:
            checkpoint.remove_stale_temporaries(ckpt_path)
            truncate_metrics(run_dir / "metrics.jsonl", int(state["step"]))
    if state is not None:
        trainer.load_state_dict(state, ckpt_path)
    if trainer.is_main:
        (run_dir / "config.toml").write_text(config.to_toml())
    with flush_denormals(config.run.flush_denormals), deterministic_algorithms(config.run.deterministic):
        t0 = time.perf_counter()
        rows, stopped = trainer.fit(progress, stop_after)
        wall_s = time.perf_counter() - t0
        trainer.save()
        auc_value = trainer.evaluate(config.run.eval_users)
    summary = trainer.summarize(rows, wall_s, auc_value, stopped)
    if trainer.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        from gemcore.plots import plot_curves  # matplotlib is imported only when a run finishes

        plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png", final_auc=auc_value)
    manager.hook.gemcore_end_run(summary=summary, run_dir=run_dir)
    trainer.close()
    return summary, run_dir


__all__ = ["Trainer", "TrainError", "RunComplete", "LRSchedule", "run_training", "build_components", "PluginError"]
