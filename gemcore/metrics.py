"""Metrics: held-out AUC and peak FLOP/s for MFU."""
from __future__ import annotations

import torch

from gemcore.planner.cluster import GPUS


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U with tie-averaged ranks). NaN if one class is absent."""
    scores, labels = scores.double().flatten(), labels.flatten().bool()
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    sorted_scores, order = scores.sort()
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    # average the ranks of ties
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    mean_rank = ends - (counts.double() - 1) / 2
    ranks[order] = mean_rank[inverse]
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def peak_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of ``device`` if known (None on CPU or an unknown GPU).

    The GPU is looked up by name in the planner's table (:data:`gemcore.planner.cluster.GPUS`).
    """
    if device.type != "cuda":
        return None
    return peak_flops_of_name(torch.cuda.get_device_name(device))


def peak_flops_of_name(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of the GPU whose CUDA name (e.g. "NVIDIA H200") contains a kind of
    :data:`gemcore.planner.cluster.GPUS`; None if none matches."""
    name = device_name.lower()
    for kind, gpu in GPUS.items():
        if kind in name:
            return gpu.peak_bf16_tflops * 1e12
    return None
