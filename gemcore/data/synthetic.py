"""Built-in synthetic data: heavy-tailed user histories with learnable structure, deterministic by seed.

Items belong to latent clusters (``item % num_clusters``). Each user has a primary and a secondary
interest cluster; a history is a Markov chain over clusters that mostly stays in the user's
interests, with Zipf-popular items inside a cluster. Candidates (same popularity law) are drawn half from the
user's interests, half from any cluster; the click probability depends on whether the candidate's cluster is the
user's primary (0.75), secondary (0.45) or neither (0.05) interest, so clicks are predictable from
the history well above chance. No download, ever.
"""
from __future__ import annotations

import numpy as np
import torch

from gemcore.data.dataset import JaggedDataset
from gemcore.data.workloads import history_lengths

CLICK_PROB = {"primary": 0.75, "secondary": 0.45, "other": 0.05}


def make_synthetic(*, num_users: int, num_items: int, num_actions: int, max_len: int,
                   num_candidates: int, num_clusters: int, kind: str = "heavytail",
                   seed: int = 0) -> JaggedDataset:
    """Generate a :class:`JaggedDataset` of ``num_users`` users (vectorised, seconds for 100k).

    History lengths follow the law ``kind`` of :mod:`gemcore.data.workloads` up to ``max_len``.
    """
    if num_clusters < 2 or num_clusters > num_items:
        raise ValueError(f"num_clusters must be in [2, num_items={num_items}], got {num_clusters}")
    lengths = history_lengths(kind, num_users, max_len, torch.Generator().manual_seed(seed)).numpy()
    rng = np.random.default_rng(seed)
    total = int(lengths.sum())
    user_of_token = np.repeat(np.arange(num_users), lengths)

    primary = rng.integers(0, num_clusters, num_users)
    secondary = (primary + rng.integers(1, num_clusters, num_users)) % num_clusters
    # cluster of each event: 60% primary, 25% secondary, 15% anywhere
    u = rng.random(total)
    cluster = np.where(u < 0.60, primary[user_of_token],
                       np.where(u < 0.85, secondary[user_of_token], rng.integers(0, num_clusters, total)))
    items_per_cluster = num_items // num_clusters
    rank = np.minimum(rng.zipf(1.3, total) - 1, items_per_cluster - 1)
    item_ids = cluster + num_clusters * rank
    # actions: engaging actions (>0) are more likely on interest clusters
    interested = cluster == primary[user_of_token]
    actions = np.where(rng.random(total) < np.where(interested, 0.6, 0.2),
                       rng.integers(1, num_actions, total), 0)
    time_gaps = rng.exponential(3600.0, total)

    cand_user = np.repeat(np.arange(num_users), num_candidates)
    pick = rng.random(cand_user.size)
    cand_cluster = np.where(pick < 0.3, primary[cand_user],
                            np.where(pick < 0.5, secondary[cand_user],
                                     rng.integers(0, num_clusters, cand_user.size)))
    cand_rank = np.minimum(rng.zipf(1.3, cand_user.size) - 1, items_per_cluster - 1)  # same popularity law
    cand_ids = cand_cluster + num_clusters * cand_rank
    p_click = np.where(cand_cluster == primary[cand_user], CLICK_PROB["primary"],
                       np.where(cand_cluster == secondary[cand_user], CLICK_PROB["secondary"],
                                CLICK_PROB["other"]))
    labels = (rng.random(cand_user.size) < p_click).astype(np.float32)
    return JaggedDataset.from_arrays(
        lengths=lengths, item_ids=item_ids, actions=actions, time_gaps=time_gaps,
        cand_lengths=np.full(num_users, num_candidates), cand_ids=cand_ids, labels=labels)
