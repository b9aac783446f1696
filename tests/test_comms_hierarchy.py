"""Hierarchical ce all_gather (intra-node copy engine after an inter-node delegate exchange): the
node layout and the reordering, on CPU with simulated node layouts. The copy-engine half runs on
the GPU machine (docs/comms.md, "GPU command for the lead": 4 ranks on 2 simulated nodes)."""
from __future__ import annotations

import pytest
import torch

from gemcore.comms.ce_backend import CopyEngineCommunicator
from gemcore.comms.hierarchy import node_layout


def _peers(nodes: list[str]) -> list[tuple[int, int]]:
    return [(hash(n) & 0xFFFF, 0) for n in nodes]


def test_layout_of_blocks():
    layout = node_layout(_peers(["a", "a", "b", "b", "c", "c"]))
    assert layout.intra == ((0, 1), (2, 3), (4, 5)) and layout.inter == ((0, 2, 4), (1, 3, 5))
    assert layout.num_nodes == 3 and layout.local_size == 2
    assert [layout.inter_index(r) for r in range(6)] == [0, 1, 0, 1, 0, 1]
    assert [layout.intra_index(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    # the two-step result: [rank 0, 2, 4 | rank 1, 3, 5]
    assert layout.position == (0, 3, 1, 4, 2, 5) and not layout.in_rank_order


def test_layout_in_rank_order_with_one_rank_per_node():
    layout = node_layout(_peers(["a", "b", "c"]))
    assert layout.local_size == 1 and layout.in_rank_order


@pytest.mark.parametrize("nodes", [["a", "a", "b"], ["a", "a", "a"], ["a"]])
def test_no_layout_for_unequal_or_single_nodes(nodes):
    assert node_layout(_peers(nodes)) is None


def test_layout_needs_peers():
    with pytest.raises(ValueError, match="peers"):
        node_layout([])


class _Gather:
    """A sub-communicator whose all_gather concatenates the members' inputs (simulated)."""

    def __init__(self, members: tuple[int, ...], inputs) -> None:
        self.members, self.inputs = members, inputs

    def _all_gather_impl(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.inputs(m) for m in self.members])


@pytest.mark.parametrize("nodes", [
    ["a", "a", "b", "b"],                      # blocks (the usual launch)
    ["a", "b", "a", "b"],                      # round-robin
    ["a", "b", "b", "a"],                      # inter groups in different node orders
    ["x", "y", "z", "x", "z", "y"],
    ["a", "b", "c", "d"],                      # one rank per node
])
@pytest.mark.parametrize("shape", [(2, 3), (0, 2), (1,)])
def test_hierarchical_all_gather_equals_the_flat_one(nodes, shape):
    layout = node_layout(_peers(nodes))
    world = len(nodes)

    def chunk(rank: int) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        return (torch.arange(n, dtype=torch.float32) + 100 * rank).reshape(shape)

    def across(rank: int) -> torch.Tensor:  # step 1 on rank `rank`: its inter group's chunks
        return _Gather(layout.inter[layout.inter_index(rank)], chunk)._all_gather_impl(chunk(rank))

    flat = torch.cat([chunk(r) for r in range(world)])
    for rank in range(world):
        c = object.__new__(CopyEngineCommunicator)
        c.rank, c.world_size, c._hier_tried = rank, world, True
        c._hier = (layout, _Gather(layout.intra[layout.intra_index(rank)], across),
                   _Gather(layout.inter[layout.inter_index(rank)], chunk))
        got = c._hierarchical_all_gather(chunk(rank))
        assert torch.equal(got, flat), f"rank {rank} of layout {nodes}"
