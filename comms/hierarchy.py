"""Node layout of a group for hierarchical collectives (intra-node copy engine, inter-node delegate).

A hierarchical all_gather over ranks on several nodes runs in two steps:

1. *inter*: the ranks holding the same place on their node (the i-th rank of every node) gather
   their inputs through the delegate (``torch`` / ``mpi``): each gets ``num_nodes`` chunks;
2. *intra*: the ranks of each node gather those results with the copy engine: each gets
   ``local_size * num_nodes`` chunks.

Step 2's result holds the chunk of the ``q``-th member of inter group ``i`` at position
``i * num_nodes + q`` (sub-communicators number their members in increasing rank order), which
is rank order only when every node holds a block of consecutive ranks; :attr:`Layout.position`
says where each rank's chunk landed. Nodes must hold equal numbers of ranks; other groups are
left to the delegate (:func:`node_layout` returns None).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """Where every rank of a group sits for the two-step collectives.

    ``intra[j]``: ranks of node j (nodes in order of their lowest rank), increasing;
    ``inter[i]``: the i-th rank of every node, increasing (a sub-communicator's member order);
    ``position[r]``: the chunk index of rank r in the two-step all_gather result.
    """

    intra: tuple[tuple[int, ...], ...]
    inter: tuple[tuple[int, ...], ...]
    position: tuple[int, ...]

    @property
    def num_nodes(self) -> int:
        return len(self.intra)

    @property
    def local_size(self) -> int:
        return len(self.intra[0])

    def intra_index(self, rank: int) -> int:
        """Which ``intra`` group holds ``rank``."""
        return next(j for j, g in enumerate(self.intra) if rank in g)

    def inter_index(self, rank: int) -> int:
        """Which ``inter`` group holds ``rank`` (its place on its node)."""
        return self.intra[self.intra_index(rank)].index(rank)

    @property
    def in_rank_order(self) -> bool:
        """True when the two-step result needs no reordering."""
        return all(p == r for r, p in enumerate(self.position))


def node_layout(peers: list[tuple[int, int]]) -> Layout | None:
    """The layout of a group whose rank r runs on node ``peers[r][0]``; None when the nodes hold
    different numbers of ranks (or there is only one node: nothing to compose)."""
    if not peers:
        raise ValueError("peers must name the node of at least one rank")
    nodes: dict[int, list[int]] = {}
    for rank, (node, _) in enumerate(peers):
        nodes.setdefault(node, []).append(rank)
    intra = [tuple(ranks) for ranks in nodes.values()]  # dict order: by lowest rank; members increasing
    if len(intra) < 2 or len({len(g) for g in intra}) != 1:
        return None
    local = len(intra[0])
    inter = [tuple(sorted(g[i] for g in intra)) for i in range(local)]
    position = [0] * len(peers)
    for i, members in enumerate(inter):
        for q, rank in enumerate(members):
            position[rank] = i * len(intra) + q
    return Layout(tuple(intra), tuple(inter), tuple(position))
