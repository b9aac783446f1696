"""A training step's forward and backward replayed as CUDA graphs, one graph per batch bucket.

A jagged batch changes shape every step and a CUDA graph replays fixed shapes, so
:class:`GraphedForwardBackward` pads each batch up to its bucket (:func:`gemcore.data.padding.pad_batch`:
extra users only, padding candidates weigh 0) and replays that bucket's graph. The host then issues
one graph launch for the forward and backward instead of a launch a kernel, which is what bounds a
step when the GPU outruns Python (`CUDA Graphs`_ in the PyTorch docs, "whole network capture").
The optimizer step stays outside the graph (a few fused launches), so learning-rate schedules,
gradient clipping and any optimizer work unchanged.

Usage (one GPU)::

    graphed = GraphedForwardBackward(model.loss, model.parameters())
    for batch in loader:
        loss = graphed(batch.to("cuda"))   # forward + backward; (,) float32 on the GPU, no sync
        opt.step()                         # reads p.grad as after loss.backward()

A bucket's first batch runs a forward + backward outside any graph (compiling and autotuning at
those shapes), then the graph is captured and replayed; every batch is trained on once, padded.
``prepare(batch)`` captures a batch's bucket ahead of time. The gradients live in the graphs'
memory: after a call, ``p.grad`` is that call's gradient (no accumulation across calls), valid
until the next call.

.. _CUDA Graphs: https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from gemcore.data.dataset import JaggedBatch
from gemcore.data.padding import pad_batch, padding_user_length

#: rows per attention tile: the padded max_len bound is a power of two of at least this
_MIN_MAX_LEN = 128
#: the batch tensors a graph reads (copied into its static batch before each replay)
_INPUTS = ("item_ids", "actions", "time_buckets", "offsets", "cand_ids", "cand_offsets", "labels", "label_weights")


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

    def pad(self, batch: JaggedBatch) -> tuple[tuple[int, int, int, int], JaggedBatch]:
        """(shape, ``batch`` padded to it), the padded batch's max_len set to the shape's bound."""
        events, candidates, users, max_len = shape = self.shape_of(batch)
        padded = pad_batch(batch, num_events=events, num_candidates=candidates, num_users=users)
        padded.max_len = max_len  # the attention kernels' bound: one per graph
        return shape, padded


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: JaggedBatch  # the static inputs the graph reads
    loss: torch.Tensor  # (,) the graph's output
    grads: list  # each parameter's gradient as the graph writes it (None: no gradient)


class GraphedForwardBackward:
    """``loss_fn(batch).backward()`` a call, replayed as a CUDA graph per :class:`Buckets` shape.

    loss_fn(batch) -> (,) loss: the forward, autocast included, on a padded :class:`JaggedBatch`
    (it must honour ``batch.label_weights``, as ``GemModel.loss`` does); params: the parameters
    whose gradients the optimizer reads. The forward and backward must not synchronise with the
    host (``.item()``, data-dependent shapes): capture refuses that with a named error.

    Memory: the graphs share one pool for activations, and each keeps its own gradients (the size
    of ``params``), which its backward writes instead of accumulating into shared ones (zeroing and
    accumulating cost another pass over every gradient each step). max_graphs bounds them; a batch
    whose shape finds no graph once that many exist runs eagerly, counted in ``eager_steps``.
    """

    def __init__(self, loss_fn: Callable[[JaggedBatch], torch.Tensor], params: Iterable[torch.nn.Parameter],
                 buckets: Buckets = Buckets(), max_graphs: int = 16):
        if not isinstance(max_graphs, int) or max_graphs <= 0:
            raise ValueError(f"max_graphs must be a positive int, got {max_graphs!r}")
        if not isinstance(buckets, Buckets):
            raise TypeError(f"buckets must be a Buckets, got {type(buckets).__name__}")
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("params: no parameter requires a gradient")
        if not torch.cuda.is_available():
            raise RuntimeError("GraphedForwardBackward replays CUDA graphs: no CUDA GPU is available")
        self.loss_fn, self.buckets, self.max_graphs = loss_fn, buckets, max_graphs
        self.graphs: dict[tuple[int, int, int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.eager_steps = 0
        self.replays = 0
        self.real_tokens = 0  # history events + candidates, summed over calls
        self.padded_tokens = 0

    @property
    def padding_fraction(self) -> float:
        """Share of the tokens trained on so far that were padding."""
        return 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0

    def __call__(self, batch: JaggedBatch) -> torch.Tensor:
        """Forward and backward of ``batch`` (on the GPU), padded to its bucket: sets each
        parameter's ``.grad`` to this batch's gradient and returns the loss, (,) on the GPU."""
        self._check(batch)
        shape, padded = self.buckets.pad(batch)
        self.real_tokens += batch.num_tokens
        self.padded_tokens += padded.num_tokens
        if shape not in self.graphs and len(self.graphs) >= self.max_graphs:
            self.eager_steps += 1
            return self._eager_forward_backward(padded)
        if shape not in self.graphs:
            self.graphs[shape] = self._capture(padded)
        graph = self.graphs[shape]
        for name in _INPUTS:
            getattr(graph.batch, name).copy_(getattr(padded, name), non_blocking=True)
        graph.graph.replay()
        for p, g in zip(self.params, graph.grads):
            p.grad = g
        self.replays += 1
        return graph.loss.clone()

    def prepare(self, batch: JaggedBatch) -> None:
        """Capture the graph of ``batch``'s bucket now if it has none (a capture leaves every
        ``p.grad`` None: nothing has run yet)."""
        self._check(batch)
        shape, padded = self.buckets.pad(batch)
        if shape not in self.graphs and len(self.graphs) < self.max_graphs:
            self.graphs[shape] = self._capture(padded)

    def _check(self, batch: JaggedBatch) -> None:
        if not isinstance(batch, JaggedBatch):
            raise TypeError(f"batch must be a JaggedBatch, got {type(batch).__name__}")
        if batch.offsets.device.type != "cuda":
            raise ValueError(f"batch must be on a CUDA device, got {batch.offsets.device}")

    def _eager_forward_backward(self, batch: JaggedBatch) -> torch.Tensor:
        for p in self.params:
            p.grad = None
        loss = self.loss_fn(batch)
        loss.backward()
        return loss.detach()

    def _capture(self, padded: JaggedBatch) -> _Graph:
        static = padded._map(torch.clone)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and autotune at these shapes, outside the capture
            self._eager_forward_backward(static)
        torch.cuda.current_stream().wait_stream(side)
        for p in self.params:  # the graph's backward writes fresh gradients (no accumulation)
            p.grad = None
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                loss = self.loss_fn(static)
                loss.backward()
                loss = loss.detach()
        except RuntimeError as exc:
            raise RuntimeError(f"GraphedForwardBackward: the forward and backward could not be captured as a "
                               f"CUDA graph (do they synchronise with the host?): {exc}") from exc
        grads = [p.grad for p in self.params]
        for p in self.params:  # nothing has run yet: no gradient to read until a replay
            p.grad = None
        return _Graph(graph, static, loss, grads)
