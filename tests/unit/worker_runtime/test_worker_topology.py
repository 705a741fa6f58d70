"""The job's topology as the ranks report it."""

import pytest
import torch
import torch.distributed as dist

from distune.worker_runtime.topology import Topology, TopologyError, discover


def test_two_nodes_of_two_ranks():
    topology = Topology(rank=2, nodes=(0, 0, 1, 1), local_ranks=(0, 1, 0, 1))
    assert (topology.nnodes, topology.local_world_size) == (2, 2)
    assert topology.members(1) == (2, 3)
    assert topology.hierarchical_possible


def test_node_ids_need_not_be_dense_and_leaders_are_local_rank_zero():
    topology = Topology(rank=0, nodes=(7, 3, 7, 3), local_ranks=(1, 0, 0, 1))
    assert topology.node_ids == (3, 7)
    assert topology.members(7) == (2, 0)
    assert topology.members(3) == (1, 3)


@pytest.mark.parametrize(
    ("nodes", "local_ranks"),
    [((0, 0, 0, 0), (0, 1, 2, 3)), ((0, 1, 2, 3), (0, 0, 0, 0))],
)
def test_one_node_or_one_rank_per_node_offers_no_hierarchical(nodes, local_ranks):
    topology = Topology(0, nodes, local_ranks)
    assert topology.nnodes * topology.local_world_size == 4
    assert not topology.hierarchical_possible


def test_unequal_nodes_count_as_nodes_of_one_rank():
    topology = Topology(0, (0, 0, 0, 1), (0, 1, 2, 0))
    assert not topology.uniform
    assert (topology.nnodes, topology.local_world_size) == (4, 1)
    assert not topology.hierarchical_possible


def test_seen_as_single_rank_nodes_offers_no_hierarchical():
    topology = Topology(rank=1, nodes=(0, 0, 1, 1), local_ranks=(0, 1, 0, 1))
    flat = topology.as_single_rank_nodes()
    assert (flat.rank, flat.nnodes, flat.local_world_size) == (1, 4, 1)
    assert not flat.hierarchical_possible


def test_virtual_local_ranks_order_a_node_by_rank():
    # torchrun --virtual-local-rank sets LOCAL_RANK=0 in every worker; torch's DDP runs there.
    topology = Topology(rank=3, nodes=(0, 0, 1, 1), local_ranks=(0, 0, 0, 0))
    assert (topology.members(0), topology.members(1)) == ((0, 1), (2, 3))
    assert (topology.nnodes, topology.local_world_size) == (2, 2)
    assert topology.hierarchical_possible


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_discover_reads_group_rank_and_local_rank(world_of_one):
    topology = discover(world_of_one, torch.device("cpu"), {"GROUP_RANK": "5", "LOCAL_RANK": "0"})
    assert topology == Topology(0, (5,), (0,))


def test_discover_without_launcher_variables_assumes_one_node(world_of_one):
    topology = discover(world_of_one, torch.device("cpu"), {})
    assert (topology.nnodes, topology.local_world_size) == (1, 1)


@pytest.mark.parametrize("value", ["x", "-1"])
def test_discover_refuses_bad_variables(world_of_one, value):
    with pytest.raises(TopologyError, match="LOCAL_RANK must be a non-negative integer"):
        discover(world_of_one, torch.device("cpu"), {"GROUP_RANK": "0", "LOCAL_RANK": value})
