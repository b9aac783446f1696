"""Collectives that carry gradients, over any :class:`~gemcore.comms.base.Communicator`.

``all_to_all(comm, t, in_splits, out_splits)`` moves rows like ``comm.all_to_all`` and is an
autograd function: the gradient of the rows this rank received goes back to the ranks that sent
them, i.e. the backward pass is the reverse all-to-all of the output's gradient with the splits
swapped (``in_splits`` <-> ``out_splits``). The backward is itself built from this function, so
second derivatives work too.

Every rank of ``comm`` must run the backward of its all-to-alls in the same order (it is a
collective); one autograd graph of the same structure per rank, as in expert parallelism, does.
"""
from __future__ import annotations

from typing import Sequence

import torch

from gemcore.comms.base import Communicator, _need_splits, _need_tensor, _send_splits


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm: Communicator, t: torch.Tensor, in_splits: list[int], out_splits: list[int]):
        ctx.comm, ctx.in_splits, ctx.out_splits = comm, in_splits, out_splits
        return comm.all_to_all(t, in_splits, out_splits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # rows received from rank r came from rows [.., ..) of r's input: send their gradient back
        return None, _AllToAll.apply(ctx.comm, grad, ctx.out_splits, ctx.in_splits), None, None


def all_to_all(comm: Communicator, t: torch.Tensor, in_splits: Sequence[int] | None = None,
               out_splits: Sequence[int] | None = None) -> torch.Tensor:
    """Differentiable all-to-all-v along dim 0 (collective over ``comm``).

    :param comm: the group to exchange within.
    :param t: ``(sum(in_splits), ...)``; trailing shape and dtype equal on every rank. Integer
        tensors (no gradient) are fine.
    :param in_splits: rows sent to each rank (None: ``t.shape[0] / world_size`` each).
    :param out_splits: rows received from each rank (None: exchanged between the ranks first, one
        small all-to-all; the backward pass then reuses them).
    :return: ``(sum(out_splits), ...)``; its gradient flows back to ``t`` on the sending ranks.
    """
    if not isinstance(comm, Communicator):
        raise ValueError(f"comm must be a gemcore.comms Communicator, got {type(comm).__name__}")
    _need_tensor(t, "t", min_dim=1)
    w = comm.world_size
    in_splits = _send_splits(t, in_splits, w)
    if out_splits is None:  # the backward needs them: ask the ranks now
        ones = [1] * w
        out_splits = comm.all_to_all(torch.tensor(in_splits, dtype=torch.int64), ones, ones).tolist()
    else:
        out_splits = _need_splits(out_splits, "out_splits", w)
    return _AllToAll.apply(comm, t, in_splits, out_splits)


__all__ = ["all_to_all"]
