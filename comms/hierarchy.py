"""Node layout of a group and the hierarchical collectives built on it (intra-node copy engine,
inter-node delegate).

The collectives here take two kinds of sub-communicator of the group: ``intra``, the ranks of this
rank's node (the ``ce`` backend gives a copy-engine communicator), and communicators of ranks on
different nodes (sub-communicators of the delegate, ``torch`` / ``mpi``). They only call the
``_*_impl`` methods, so any backend's communicators (or the tests' simulated ones) can stand in.

*all_gather* (nodes of equal size):

1. *inter*: the ranks holding the same place on their node (the i-th rank of every node) gather
   their inputs through the delegate: each gets ``num_nodes`` chunks;
2. *intra*: the ranks of each node gather those results with the copy engine: each gets
   ``local_size * num_nodes`` chunks.

Step 2's result holds the chunk of the ``q``-th member of inter group ``i`` at position
``i * num_nodes + q`` (sub-communicators number their members in increasing rank order), which
is rank order only when every node holds a block of consecutive ranks; :attr:`Layout.position`
says where each rank's chunk landed.

*broadcast* (any node sizes): one *leader* per node receives from the root through the delegate
(the root on its own node; on another node the rank with the root's place on its node, or the
node's first rank when the node is smaller), then each leader broadcasts to its node with the
copy engine (:func:`broadcast_leaders`).

*all_to_all(-v)* (nodes of equal size, at least 2 ranks each), for rank ``r`` at place ``k`` of
its node:

1. *intra*: ``r`` sends to its node's rank at place ``k'`` every chunk bound for a rank at place
   ``k'`` (on any node), with the copy engine;
2. *inter*: each rank now holds, from every rank of its node, the chunks bound for the ranks at its
   own place on every node, and exchanges them through the delegate within its inter group.

The input is regrouped by destination place before step 1, the received chunks by destination
node between the steps, and the result into source-rank order after step 2 (each regrouping is
skipped when it is the identity; on a GPU it is a ``torch.cat``, a kernel). Groups whose nodes
hold different numbers of ranks, or one rank each, are left to the delegate's flat all_to_all:
with unequal nodes a place has no partner on some nodes, and with one rank per node there is no
intra-node step to save.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    """Where every rank of a group sits for the two-step collectives (nodes of equal size).

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


def node_groups(peers: list[tuple[int, int]]) -> tuple[tuple[int, ...], ...]:
    """The ranks of each node of a group whose rank r runs on node ``peers[r][0]``: nodes in order
    of their lowest rank, ranks increasing."""
    if not peers:
        raise ValueError("peers must name the node of at least one rank")
    nodes: dict[int, list[int]] = {}
    for rank, (node, _) in enumerate(peers):
        nodes.setdefault(node, []).append(rank)
    return tuple(tuple(ranks) for ranks in nodes.values())  # dict order: by lowest rank


def node_layout(peers: list[tuple[int, int]]) -> Layout | None:
    """The layout of a group whose rank r runs on node ``peers[r][0]``; None when the nodes hold
    different numbers of ranks (or there is only one node: nothing to compose)."""
    intra = node_groups(peers)
    if len(intra) < 2 or len({len(g) for g in intra}) != 1:
        return None
    local = len(intra[0])
    inter = [tuple(sorted(g[i] for g in intra)) for i in range(local)]
    position = [0] * len(peers)
    for i, members in enumerate(inter):
        for q, rank in enumerate(members):
            position[rank] = i * len(intra) + q
    return Layout(intra, tuple(inter), tuple(position))


def broadcast_leaders(groups: tuple[tuple[int, ...], ...], src: int) -> tuple[int, ...]:
    """The rank of each node that receives a broadcast from ``src`` across nodes, increasing: ``src``
    on its own node; on another node the rank at ``src``'s place there, or the node's first rank
    when the node has no such place. ``groups``: :func:`node_groups`."""
    place = next(g.index(src) for g in groups if src in g)
    return tuple(sorted(src if src in g else g[place] if place < len(g) else g[0] for g in groups))


def _reorder(t: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """The blocks of ``t`` (rows ``sizes[0]``, then ``sizes[1]``, ... along dim 0) in ``order``."""
    if order == list(range(len(sizes))):
        return t
    blocks = t.split(sizes)
    return torch.cat([blocks[b] for b in order])


class Hierarchy:
    """The sub-communicators of a group spanning several nodes and the collectives composed of them.

    Built collectively (every rank of ``delegate`` constructs it, in the same collective):
    ``intra`` = ``make_intra(delegate split into nodes)``, ``inter`` = the delegate split into
    places (nodes of equal size only). Broadcast leader groups for unequal nodes are split off the
    delegate on first use, one per place of the root (also collective: every rank broadcasts from
    the same root).
    """

    def __init__(self, delegate, make_intra: Callable[[object], object]) -> None:
        self.delegate = delegate
        self.rank = delegate.rank
        self.world_size = delegate.world_size
        self.groups = node_groups(delegate.peers)
        self.layout = node_layout(delegate.peers)
        self.node = next(j for j, g in enumerate(self.groups) if self.rank in g)
        self.intra = make_intra(delegate._split_impl([list(g) for g in self.groups], self.node))
        self.inter = None
        if self.layout is not None:
            self.inter = delegate._split_impl([list(g) for g in self.layout.inter],
                                              self.layout.inter_index(self.rank))
        #: unequal nodes: the delegate's sub-communicator holding this rank for each root place
        self._leader_comms: dict[int, object] = {}

    # ------------------------------------------------------------------ all_gather
    def all_gather(self, t: torch.Tensor) -> torch.Tensor | None:
        """Inter-node delegate all_gather, then intra-node all_gather of the result; None when the
        nodes hold different numbers of ranks."""
        layout = self.layout
        if layout is None:
            return None
        across = self.inter._all_gather_impl(t)  # the i-th rank of every node: num_nodes chunks
        gathered = self.intra._all_gather_impl(across)  # the node's ranks: local_size * num_nodes chunks
        if layout.in_rank_order:
            return gathered
        chunks = gathered.view(self.world_size, *t.shape)
        order = torch.tensor(layout.position, dtype=torch.long, device=t.device)
        return chunks.index_select(0, order).reshape(self.world_size * t.shape[0], *t.shape[1:])

    # ------------------------------------------------------------------ broadcast
    def _leaders_comm(self, src: int, leaders: tuple[int, ...]):
        """The delegate's sub-communicator of ``leaders`` (None on the other ranks)."""
        if self.layout is not None:  # leaders = the inter group of src's place
            return self.inter if self.rank in leaders else None
        place = next(g.index(src) for g in self.groups if src in g)
        if place not in self._leader_comms:  # collective: every rank broadcasts from src
            others = [r for r in range(self.world_size) if r not in leaders]
            mine = 0 if self.rank in leaders else 1
            self._leader_comms[place] = self.delegate._split_impl([list(leaders), others], mine)
        return self._leader_comms[place] if self.rank in leaders else None

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        """``src`` to one leader per node through the delegate, then each leader to its node."""
        leaders = broadcast_leaders(self.groups, src)
        node = self.groups[self.node]
        leader = next(r for r in leaders if r in node)
        comm = self._leaders_comm(src, leaders)
        if comm is not None:
            comm._broadcast_impl(t, leaders.index(src))
        if len(node) > 1:
            self.intra._broadcast_impl(t, node.index(leader))

    # ------------------------------------------------------------------ all_to_all
    def all_to_all(self, t: torch.Tensor, in_splits: list[int], out_splits: list[int]) -> torch.Tensor | None:
        """Intra-node exchange by destination place, then inter-node exchange within the place
        (module docstring); None when the nodes hold different numbers of ranks or one each."""
        layout = self.layout
        if layout is None or layout.local_size < 2:
            return None
        n_nodes, local = layout.num_nodes, layout.local_size
        place = layout.inter_index(self.rank)
        # rows[p][d]: rows the node's p-th rank sends to rank d
        rows = self.intra._all_gather_impl(torch.tensor(in_splits, dtype=torch.int64))
        rows = rows.view(local, self.world_size).tolist()
        # step 1: to the node's rank at place k, the chunks for every rank at place k (inter order)
        send = _reorder(t, in_splits, [d for members in layout.inter for d in members])
        in1 = [sum(in_splits[d] for d in members) for members in layout.inter]
        mine = layout.inter[place]  # the ranks at this rank's place, in inter-member order
        out1 = [sum(rows[p][d] for d in mine) for p in range(local)]
        got = self.intra._all_to_all_impl(send, in1, out1)
        # got: blocks (p, q) = node rank p's chunk for mine[q]; step 2 sends by q, then p
        sizes = [rows[p][d] for p in range(local) for d in mine]
        send = _reorder(got, sizes, [p * n_nodes + q for q in range(n_nodes) for p in range(local)])
        in2 = [sum(rows[p][d] for p in range(local)) for d in mine]
        sources = [layout.intra[layout.intra_index(d)] for d in mine]  # node of each inter member
        out2 = [sum(out_splits[s] for s in node) for node in sources]
        got = self.inter._all_to_all_impl(send, in2, out2)
        # got: blocks (q, p) = from rank sources[q][p]; the result is in source-rank order
        arrival = [s for node in sources for s in node]
        at = {s: b for b, s in enumerate(arrival)}
        return _reorder(got, [out_splits[s] for s in arrival], [at[s] for s in range(self.world_size)])

    def finalize(self) -> None:
        for comm in [self.intra, self.inter, *self._leader_comms.values()]:
            if comm is not None:
                comm._finalize_impl()
        self._leader_comms = {}
