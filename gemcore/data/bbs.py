"""Base Batch Shuffling (BBS): cost-balanced data-parallel batches with no communication.

Every rank holds the (N,) history lengths of the whole dataset and the shared seed, so every rank
computes the same global assignment and keeps its own part; nothing is exchanged.

One step, for a global batch of G samples over W ranks:

1. The epoch permutation (drawn from ``(seed, epoch)``) gives the step's G samples.
2. They are sorted by cost, heaviest first, and cut into rounds of W (the last round padded with
   zero-cost placeholders), so each round holds one sample per rank.
3. Blocks of up to ``MAX_FOLD`` consecutive rounds are first folded in serpentine order (odd
   rounds reversed, then summed; at least ``MIN_LDM_ROWS`` rows remain). The rows are then merged
   pairwise by the balanced largest-differencing method: the two rows with the largest spread
   (heaviest minus lightest entry) are combined entry by entry, heaviest of one with lightest of
   the other, so their spreads cancel; this repeats, vectorised over all pairs at once, until one
   row of W groups remains. Each group holds exactly one entry of every round, so ranks get
   ``ceil(G/W)`` or ``floor(G/W)`` samples. A folded row's spread is at most the block's cost range
   and a merge never widens the wider spread, so the heaviest and lightest rank differ by at most
   the largest single sample's cost.
4. Each rank splits its own samples into ``ceil(local / sub_batch)`` sub-batches of near-equal cost
   the same way (local work, for gradient accumulation or micro-batches) and yields them back to
   back as one list.

GEM's published rule (random 128-sample sub-batches sorted by cost, heaviest paired with lightest)
is :func:`gem_rule_loads`; ``gem bench bbs`` compares the two.

Tail: an epoch has ``ceil(N / G)`` steps; the last step holds the ``N mod G`` left-over samples,
balanced the same way (ranks get ``floor`` or ``ceil`` of ``t / W`` samples; with fewer than W
left-over samples some ranks get an empty list). ``drop_last=True`` drops that step instead. No
other sample is ever dropped: over an epoch the ranks' lists partition the dataset.

Determinism: sorts are stable or on keys with no ties, and float64 sums are added in a fixed
order, so the plan is a pure function of (lengths, cost, seed, epoch, step, W, G) on every
platform. A custom cost function must itself be deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import numpy as np
import torch

from gemcore.data.samplers import EpochSampler

CostFn = Callable[[torch.Tensor], torch.Tensor]
Cost = Union[str, CostFn]


# --------------------------------------------------------------------------- per-sample cost
def model_cost(model) -> CostFn:
    """Per-sample cost ``a·L + b·L²`` with the coefficients of ``model.flops(num_tokens, sum_sq_len)``.

    ``model`` is a :class:`gemcore.model.GemModel` (or anything with that FLOP counter, linear in
    both arguments): ``a = flops(1, 0)`` (projections, MLPs), ``b = flops(0, 1)`` (attention).
    """
    a, b = float(model.flops(1, 0)), float(model.flops(0, 1))

    def cost(lengths: torch.Tensor) -> torch.Tensor:
        length = lengths.to(torch.float64)
        return a * length + b * length * length

    return cost


def default_model_cost(model_config=None) -> CostFn:
    """:func:`model_cost` of a GemModel built (on the meta device, no memory) from ``model_config``
    (default: ``gemcore.config.ModelConfig()``)."""
    from gemcore.config import ModelConfig
    from gemcore.model import GemModel

    with torch.device("meta"):
        model = GemModel(model_config or ModelConfig(), attention=None)
    return model_cost(model)


def _tokens_cost(lengths: torch.Tensor) -> torch.Tensor:
    return lengths.to(torch.float64)


def _quadratic_cost(lengths: torch.Tensor) -> torch.Tensor:
    return lengths.to(torch.float64) ** 2


#: named costs; "attention" is the default model's FLOP count (linear + quadratic terms)
NAMED_COSTS: dict[str, Callable[[], CostFn]] = {
    "attention": default_model_cost,
    "tokens": lambda: _tokens_cost,
    "quadratic": lambda: _quadratic_cost,
}


def resolve_cost(cost: Cost) -> CostFn:
    if callable(cost):
        return cost
    if cost in NAMED_COSTS:
        return NAMED_COSTS[cost]()
    raise ValueError(f"cost must be a callable or one of {sorted(NAMED_COSTS)}, got {cost!r}")


def sample_costs(lengths, cost: Cost) -> np.ndarray:
    """(N,) float64 costs of each sample, validated (finite, non-negative)."""
    lengths_t = torch.as_tensor(np.asarray(lengths), dtype=torch.int64)
    values = resolve_cost(cost)(lengths_t)
    values = np.asarray(values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else values,
                        dtype=np.float64)
    if values.shape != (lengths_t.numel(),):
        raise ValueError(f"cost must return one value per sample, shape ({lengths_t.numel()},); "
                         f"got shape {values.shape}")
    if not np.isfinite(values).all() or (values < 0).any():
        raise ValueError("cost must return finite, non-negative values")
    return values + 0.0  # -0.0 -> +0.0 (keys below read the bit pattern)


# --------------------------------------------------------------------------- the balancer
def _unique_keys(values: np.ndarray) -> np.ndarray:
    """int64 keys ordering each row of non-negative float64 ``values: (m, W)`` with no ties.

    A non-negative double's bit pattern read as int64 grows with its value; its lowest
    ``ceil(log2 W)`` mantissa bits are replaced by the column, so equal (or within a relative
    2**-40) values are ordered by column. Unique keys make every sort algorithm agree, so the
    fast default sort gives the same order on every platform.
    """
    bits = max(1, int(values.shape[1] - 1).bit_length())
    keys = values.view(np.int64) & np.int64(~((1 << bits) - 1))
    keys |= np.arange(values.shape[1], dtype=np.int64)
    return keys


def _merge_rounds(rows: np.ndarray, rows_sorted_desc: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Balanced largest-differencing merge of ``rows: (m, W)`` costs into W groups.

    Returns ``(group, loads)``: ``group: (m, W)`` int64, the group (0..W-1) of each entry, one entry
    of every row per group; ``loads: (W,)`` float64 summed cost of each group. With
    ``rows_sorted_desc`` each row must already be sorted heaviest first (saves the first sort).
    """
    m0, W = rows.shape
    sums = rows
    dests: list[np.ndarray] = []
    cols = np.arange(W, dtype=np.int32)
    sorted_desc = rows_sorted_desc
    while sums.shape[0] > 1:
        m = sums.shape[0]
        if sorted_desc:  # ascending order is the row read backwards: no sort, no gather
            ordered = sums[:, ::-1]
            order = None
        else:  # flat positions of each row's entries in ascending order
            order = np.argsort(_unique_keys(sums), axis=1).astype(np.int32)
            order += (np.arange(m, dtype=np.int32) * np.int32(W))[:, None]
            ordered = sums.ravel()[order]
        sorted_desc = False
        spread = ordered[:, -1] - ordered[:, 0]
        by_spread = np.argsort(-spread, kind="stable")
        pairs = m // 2
        heavy, light = by_spread[0:2 * pairs:2], by_spread[1:2 * pairs:2]
        merged = np.empty((pairs + m % 2, W))
        np.add(ordered[heavy], ordered[light, ::-1], out=merged[:pairs])  # lightest + heaviest
        new_row = np.empty(m, np.int32)
        new_row[heavy] = np.arange(pairs, dtype=np.int32)
        new_row[light] = new_row[heavy]
        if m % 2:  # the row with the smallest spread passes through unchanged
            rest = by_spread[-1]
            merged[pairs] = ordered[rest]
            new_row[rest] = pairs
        # destination of the entry in sorted position j: column j, or W-1-j in a "light" row
        base = new_row * np.int32(W)
        sorted_dest = base[:, None] + cols
        sorted_dest[light] = base[light, None] + cols[::-1]
        if order is None:
            dest = sorted_dest[:, ::-1].ravel()
        else:
            dest = np.empty(m * W, np.int32)
            dest[order.ravel()] = sorted_dest.ravel()
        dests.append(dest)
        sums = merged
    group = cols
    for dest in reversed(dests):  # compose the per-level moves, smallest level first
        group = group[dest]
    return group.reshape(m0, W).astype(np.int64), sums[0].copy()


#: serpentine pre-fold of sorted rounds: at most MAX_FOLD rounds per row, at least MIN_LDM_ROWS rows
MAX_FOLD, MIN_LDM_ROWS = 16, 64


def _partition_sorted(sorted_costs: np.ndarray, num_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Group (int32) of each item of ``sorted_costs`` (heaviest first), and the groups' loads."""
    n, W = sorted_costs.shape[0], num_groups
    rounds = -(-n // W)
    # Consecutive sorted rounds differ little: fold each block of `fold` of them in serpentine
    # order first (pure reshapes), leaving >= MIN_LDM_ROWS rows for the differencing merge.
    fold = min(MAX_FOLD, max(1, rounds // MIN_LDM_ROWS))
    blocks = -(-rounds // fold)
    padded = np.zeros((blocks * fold, W))  # placeholders cost nothing and come last
    padded.ravel()[:n] = sorted_costs
    cols = np.broadcast_to(np.arange(W, dtype=np.int32), (rounds, W)).copy()
    if fold > 1:
        padded[1::2] = padded[1::2, ::-1]  # odd rounds reversed: heaviest meets lightest
        cols[1::2] = cols[1::2, ::-1]
        folded = padded.reshape(blocks, fold, W)
        rows = folded[:, 0].copy()
        for j in range(1, fold):  # explicit order: the same float sums on every platform
            rows += folded[:, j]
    else:
        rows = padded
    group, loads = _merge_rounds(rows, rows_sorted_desc=fold == 1)
    # entry (round r, column c) sits in folded row r // fold at column c (W-1-c for odd r)
    cols += (np.arange(rounds, dtype=np.int32) // np.int32(fold) * np.int32(W))[:, None]
    return group.ravel()[cols.ravel()[:n]], loads


def balanced_partition(costs: np.ndarray, num_groups: int, sort_key: np.ndarray | None = None
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Split items into ``num_groups`` groups of ``floor``/``ceil(n / num_groups)`` items, balancing cost.

    costs: (n,) float64, non-negative. sort_key: optional (n,) integer key ordering the items like
    ``costs`` (a dense rank; uint16 keys sort in linear time). Returns ``(group_of_item: (n,) int64,
    loads: (num_groups,) float64)``. The spread of the loads is at most the largest cost.
    """
    n = costs.shape[0]
    if num_groups <= 0:
        raise ValueError(f"num_groups must be positive, got {num_groups}")
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(num_groups)
    order = np.argsort(costs if sort_key is None else sort_key, kind="stable")[::-1]  # heaviest first
    group_sorted, loads = _partition_sorted(costs[order], num_groups)
    group_of_item = np.empty(n, np.int64)
    group_of_item[order] = group_sorted
    return group_of_item, loads


def _members(group_sorted: np.ndarray, order: np.ndarray, num_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Items (``order[i]`` is item of sorted position i) listed group by group, heaviest first
    within a group, and the (num_groups+1,) offsets."""
    key = group_sorted.astype(np.uint16) if num_groups <= 1 << 16 else group_sorted
    members = order[np.argsort(key, kind="stable")]
    offsets = np.zeros(num_groups + 1, np.int64)
    np.cumsum(np.bincount(group_sorted, minlength=num_groups), out=offsets[1:])
    return members, offsets


# --------------------------------------------------------------------------- plans
@dataclass
class StepPlan:
    """All ranks' samples for one step.

    indices: (G,) int64 sample indices, rank after rank; rank_offsets: (W+1,) int64;
    rank_cost: (W,) float64 summed per-sample cost of each rank.
    """

    indices: np.ndarray
    rank_offsets: np.ndarray
    rank_cost: np.ndarray

    def rank_indices(self, rank: int) -> np.ndarray:
        return self.indices[self.rank_offsets[rank]:self.rank_offsets[rank + 1]]

    @property
    def imbalance(self) -> float:
        """max / mean per-rank cost (1.0 is perfect; 1.0 for an all-zero step)."""
        mean = float(self.rank_cost.mean())
        return float(self.rank_cost.max()) / mean if mean > 0 else 1.0


class BaseBatchShuffler(EpochSampler):
    """Per step, this rank's list of sample indices, cost-balanced across ranks without communication.

    lengths: (N,) history lengths of the dataset (the same on every rank).
    world_size, rank: data-parallel readers and this one. global_batch: samples per step over all
    ranks. sub_batch: most samples per sub-batch of a rank's list (see :meth:`sub_batch_sizes`).
    seed: shared by all ranks. cost: ``"attention"`` (the default model's FLOP count per sample),
    ``"tokens"``, ``"quadratic"``, or a callable ``lengths (N,) int64 tensor -> (N,) costs``
    (called once). drop_last: drop the epoch's last, smaller step.

    Iterating yields one epoch, as torch's ``DistributedSampler`` does (:class:`EpochSampler`):
    ``len(self)`` lists, then stops; ``set_epoch(e + 1)`` starts the next; the first iteration after
    ``load_state_dict`` of a mid-epoch state yields the rest of that epoch. ``state_dict()`` holds
    (epoch, step within epoch) and the dataset's size, global batch and seed.
    """

    def __init__(self, lengths, *, world_size: int, rank: int, global_batch: int, sub_batch: int = 128,
                 seed: int = 0, cost: Cost = "attention", drop_last: bool = False):
        lengths = np.asarray(lengths.cpu() if isinstance(lengths, torch.Tensor) else lengths)
        if lengths.ndim != 1 or lengths.size == 0:
            raise ValueError(f"lengths must be a non-empty 1-D array, got shape {lengths.shape}")
        if not isinstance(world_size, int) or world_size <= 0:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        if not isinstance(global_batch, int) or global_batch < world_size:
            raise ValueError(f"global_batch must be an int >= world_size ({world_size}), got {global_batch!r}")
        if not isinstance(sub_batch, int) or sub_batch <= 0:
            raise ValueError(f"sub_batch must be a positive int, got {sub_batch!r}")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.n = int(lengths.size)
        self.world_size, self.rank, self.global_batch = world_size, rank, global_batch
        self.sub_batch, self.seed, self.drop_last = sub_batch, seed, drop_last
        self.costs = sample_costs(lengths, cost)
        distinct, rank_of_cost = np.unique(self.costs, return_inverse=True)
        self._key = rank_of_cost.astype(np.uint16 if distinct.size <= 1 << 16 else np.int64)
        self._perm_epoch, self._perm = -1, None
        self._perm_key = self._perm_cost = None

    # ------------------------------------------------------------------ schedule
    def _permutation(self, epoch: int) -> np.ndarray:
        """The epoch's sample order, with sort keys and costs laid out in that order (once per
        epoch, so each step reads contiguous slices)."""
        if self._perm_epoch != epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._perm_key, self._perm_cost = self._key[self._perm], self.costs[self._perm]
            self._perm_epoch = epoch
        return self._perm

    def step_samples(self, epoch: int, step: int) -> np.ndarray:
        """The global batch of ``step`` in ``epoch`` (before balancing)."""
        start = step * self.global_batch
        return self._permutation(epoch)[start:start + self.global_batch]

    # ------------------------------------------------------------------ planning
    def plan(self, epoch: int, step: int) -> StepPlan:
        """Every rank's samples for ``step`` of ``epoch`` (the same on every rank)."""
        batch = self.step_samples(epoch, step)
        window = slice(step * self.global_batch, step * self.global_batch + batch.size)
        heaviest_first = np.argsort(self._perm_key[window], kind="stable")[::-1]
        order = batch[heaviest_first]
        group, loads = _partition_sorted(self._perm_cost[window][heaviest_first], self.world_size)
        indices, offsets = _members(group, order, self.world_size)
        return StepPlan(indices, offsets, loads)

    def local_batch(self, plan: StepPlan) -> np.ndarray:
        """This rank's samples of ``plan`` as back-to-back balanced sub-batches."""
        mine = plan.rank_indices(self.rank)
        parts = -(-mine.size // self.sub_batch)
        if parts <= 1:
            return mine
        order = mine[np.argsort(self._key[mine], kind="stable")[::-1]]
        group, _ = _partition_sorted(self.costs[order], parts)
        return _members(group, order, parts)[0]

    def sub_batch_sizes(self, num_samples: int) -> list[int]:
        """Sizes of the consecutive sub-batches of a local list of ``num_samples`` samples."""
        parts = max(1, -(-num_samples // self.sub_batch))
        small, extra = divmod(num_samples, parts)
        return [small + 1] * extra + [small] * (parts - extra)

    def _step(self, step: int) -> list[int]:
        return self.local_batch(self.plan(self.epoch, step)).tolist()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {**super().state_dict(), "num_samples": self.n, "global_batch": self.global_batch,
                "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("num_samples", self.n), ("global_batch", self.global_batch), ("seed", self.seed)):
            if key in state and int(state[key]) != mine:
                raise ValueError(f"sampler state: {key} was {state[key]} when saved, is {mine} now")
        super().load_state_dict(state)


# --------------------------------------------------------------------------- baselines (for the bench)
def random_loads(costs: np.ndarray, world_size: int) -> np.ndarray:
    """(W,) per-rank cost when a shuffled batch is dealt rank by rank (``random`` sampler's rule)."""
    return np.array([costs[r::world_size].sum() for r in range(world_size)])


def gem_rule_loads(costs: np.ndarray, world_size: int, sub_batch: int = 128) -> np.ndarray:
    """(W,) per-rank cost under GEM's rule: consecutive ``sub_batch``-sample sub-batches of the
    shuffled batch, sorted by cost, dealt in serpentine order (heaviest with lightest)."""
    n_sub = -(-costs.size // sub_batch)
    padded = np.zeros(n_sub * sub_batch)
    padded[:costs.size] = costs
    sub_cost = np.sort(padded.reshape(n_sub, sub_batch).sum(axis=1))[::-1]
    rounds = -(-n_sub // world_size)
    dealt = np.zeros(rounds * world_size)
    dealt[:n_sub] = sub_cost
    dealt = dealt.reshape(rounds, world_size)
    dealt[1::2] = dealt[1::2, ::-1]
    return dealt.sum(axis=0)
