"""Whole training steps (forward, backward, optimizer) replayed as CUDA graphs.

A jagged batch changes shape every step and a CUDA graph replays fixed shapes, so
:class:`GraphedTrainStep` pads each batch up to its bucket (:func:`gemcore.data.padding.pad_batch`:
extra users only, padding candidates weigh 0) and replays that bucket's graph. The host then
issues one graph launch a step instead of thousands of kernel launches, which is what bounds a
compiled jagged step when the GPU outruns Python (`CUDA Graphs`_ in the PyTorch docs, "whole
network capture").

Usage (one GPU; the optimizer built with ``capturable=True``)::

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    step = GraphedTrainStep(lambda batch: model.loss(batch), opt)
    for batch in loader:
        loss = step(batch.to("cuda"))   # (,) float32 on the GPU, no host sync

Every step trains on the padded batch. The first call trains eagerly (it creates the optimizer's
state outside any graph), as do batches whose shape finds no graph once max_graphs are kept. A bucket's first
batch runs a forward + backward outside the graph (compiling and autotuning at those shapes; no
optimizer step, so no training happens there), then the graph is captured and replayed: every
batch trains exactly once, through its graph. ``prepare(batch)`` captures a batch's bucket ahead
of time without training. Gradients stay in place between steps (zeroed inside the graph, never
set to None), so ``p.grad`` holds the last step's gradients as after an eager step.

.. _CUDA Graphs: https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from gemcore.data.dataset import JaggedBatch
from gemcore.data.padding import pad_batch, padding_user_length

#: rows per attention tile: the padded max_len bound is a power of two of at least this
_MIN_MAX_LEN = 128


@dataclass(frozen=True)
class Buckets:
    """How batches are rounded up to a graph's shapes.

    events / candidates: history events and candidates rounded up to a multiple of these;
    padding_users: at least this many padding users share the padding (users are rounded up to
    a multiple of 8 beyond the batch's own); max_len rounds up to a power of two (>= 128).
    """

    events: int = 1024
    candidates: int = 256
    padding_users: int = 16

    def __post_init__(self):
        for name in ("events", "candidates", "padding_users"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Buckets.{name} must be a positive int, got {value!r}")

    def shape_of(self, batch: JaggedBatch) -> tuple[int, int, int, int]:
        """(events, candidates, users, max_len) of the graph that replays ``batch``."""
        events = -(-batch.item_ids.numel() // self.events) * self.events
        candidates = -(-batch.cand_ids.numel() // self.candidates) * self.candidates
        users = -(-(batch.batch_size + self.padding_users) // 8) * 8
        pad_users = users - batch.batch_size
        longest = max(batch.max_len, _MIN_MAX_LEN, padding_user_length(
            events - batch.item_ids.numel(), candidates - batch.cand_ids.numel(), pad_users))
        return events, candidates, users, 1 << (longest - 1).bit_length()


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: JaggedBatch  # the static inputs the graph reads
    loss: torch.Tensor  # (,) the graph's output


class GraphedTrainStep:
    """One training step a call, replayed as a CUDA graph per :class:`Buckets` shape.

    loss_fn(batch) -> (,) loss: the forward, autocast included, on a padded :class:`JaggedBatch`
    (it must honour ``batch.label_weights``, as ``GemModel.loss`` does); optimizer: over the
    parameters loss_fn trains, built with ``capturable=True`` where it has the option. The step
    must not synchronise with the host (``.item()``, data-dependent shapes): capture refuses it.
    max_graphs bounds the graphs kept (each holds its static batch; activations share one pool).
    """

    def __init__(self, loss_fn: Callable[[JaggedBatch], torch.Tensor], optimizer: torch.optim.Optimizer,
                 buckets: Buckets = Buckets(), max_graphs: int = 64):
        for i, group in enumerate(optimizer.param_groups):
            if group.get("capturable") is False:
                raise ValueError(f"optimizer: param group {i} has capturable=False; build the optimizer "
                                 f"with capturable=True to replay its step in a CUDA graph")
        if not isinstance(max_graphs, int) or max_graphs <= 0:
            raise ValueError(f"max_graphs must be a positive int, got {max_graphs!r}")
        if not torch.cuda.is_available():
            raise RuntimeError("GraphedTrainStep replays CUDA graphs: no CUDA GPU is available")
        self.loss_fn, self.optimizer, self.buckets, self.max_graphs = loss_fn, optimizer, buckets, max_graphs
        self.graphs: dict[tuple[int, int, int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.eager_steps = 0
        self.replays = 0
        self.real_tokens = 0  # history events + candidates, summed over steps
        self.padded_tokens = 0

    @property
    def padding_fraction(self) -> float:
        """Share of the tokens trained on so far that were padding."""
        return 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0

    def __call__(self, batch: JaggedBatch) -> torch.Tensor:
        """Train on ``batch`` (on the GPU), padded to its bucket; returns its loss, (,) on the GPU."""
        self._check(batch)
        shape, padded = self._padded(batch)
        self.real_tokens += batch.num_tokens
        self.padded_tokens += padded.num_tokens
        # eager: the first step (the optimizer's state must exist before any capture), and shapes
        # beyond max_graphs
        if not self.optimizer.state or (shape not in self.graphs and len(self.graphs) >= self.max_graphs):
            self.eager_steps += 1
            return self._eager_step(padded)
        if shape not in self.graphs:
            self.graphs[shape] = self._capture(padded)
        graph = self.graphs[shape]
        for name in ("item_ids", "actions", "time_buckets", "offsets", "cand_ids", "cand_offsets", "labels",
                     "label_weights"):
            getattr(graph.batch, name).copy_(getattr(padded, name), non_blocking=True)
        graph.graph.replay()
        self.replays += 1
        return graph.loss.clone()

    def prepare(self, batch: JaggedBatch) -> None:
        """Capture the graph of ``batch``'s bucket now (no training); needs one step taken before."""
        self._check(batch)
        if not self.optimizer.state:
            raise RuntimeError("prepare: take one step first (the optimizer's state is created eagerly)")
        shape, padded = self._padded(batch)
        if shape not in self.graphs and len(self.graphs) < self.max_graphs:
            self.graphs[shape] = self._capture(padded)

    def _check(self, batch: JaggedBatch) -> None:
        if not isinstance(batch, JaggedBatch):
            raise TypeError(f"batch must be a JaggedBatch, got {type(batch).__name__}")
        if batch.offsets.device.type != "cuda":
            raise ValueError(f"batch must be on a CUDA device, got {batch.offsets.device}")

    def _eager_step(self, batch: JaggedBatch) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=False)
        loss = self.loss_fn(batch)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _padded(self, batch: JaggedBatch) -> tuple[tuple[int, int, int, int], JaggedBatch]:
        events, candidates, users, max_len = shape = self.buckets.shape_of(batch)
        padded = pad_batch(batch, num_events=events, num_candidates=candidates, num_users=users)
        padded.max_len = max_len  # the attention kernels' bound: one per graph
        return shape, padded

    def _capture(self, padded: JaggedBatch) -> _Graph:
        static = padded._map(torch.clone)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and autotune at these shapes, outside the capture
            self.loss_fn(static).backward()
        torch.cuda.current_stream().wait_stream(side)
        for p in params:  # gradients live outside the graph pool, zeroed in place by each replay
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                self.optimizer.zero_grad(set_to_none=False)
                loss = self.loss_fn(static)
                loss.backward()
                self.optimizer.step()
                loss = loss.detach()
        except RuntimeError as exc:
            raise RuntimeError(f"GraphedTrainStep: the training step could not be captured as a CUDA graph "
                               f"(does it synchronise with the host?): {exc}") from exc
        return _Graph(graph, static, loss)
