"""Peer placement: a pure function of the recorded topology (whole nodes, pairs, a ring of three)."""

from __future__ import annotations

import pytest

from tierstore.placement import place


def hosts(count: int) -> dict[int, str]:
    return {node: f"host{node}" for node in range(count)}


def test_nodes_pair_up_in_order() -> None:
    assert place(hosts(4)).holder_of == {0: 1, 1: 0, 2: 3, 3: 2}


@pytest.mark.parametrize("count", [3, 5, 7])
def test_an_odd_count_ends_in_a_ring_of_three_and_each_holds_one_foreign_copy(count: int) -> None:
    placement = place(hosts(count))
    a, b, c = count - 3, count - 2, count - 1
    assert {k: placement.holder_of[k] for k in (a, b, c)} == {a: b, b: c, c: a}
    assert sorted(placement.holder_of.values()) == list(range(count)), "one mirror per node"
    assert all(owner != holder for owner, holder in placement.holder_of.items())


def test_a_single_node_has_no_partner() -> None:
    placement = place(hosts(1))
    assert placement.holder_of == {} and "single node" in placement.refused[0]


def test_stride_pairs_nodes_across_failure_domains() -> None:
    # Two racks of four: with stride 4 every partner sits in the other rack.
    assert place(hosts(8), stride=4).holder_of == {0: 4, 4: 0, 1: 5, 5: 1, 2: 6, 6: 2, 3: 7, 7: 3}


def test_indices_need_not_be_contiguous() -> None:
    assert place({3: "a", 7: "b", 9: "c", 12: "d"}).holder_of == {3: 7, 7: 3, 9: 12, 12: 9}


def test_a_partner_on_the_same_host_is_refused() -> None:
    placement = place({0: "box", 1: "box", 2: "x", 3: "y"})
    assert 0 not in placement.holder_of and 1 not in placement.holder_of
    assert "same host" in placement.refused[0] and "same host" in placement.refused[1]
    assert placement.holder_of == {2: 3, 3: 2}


def test_the_same_topology_gives_the_same_placement() -> None:
    assert place(hosts(5), stride=2) == place(dict(reversed(list(hosts(5).items()))), stride=2)


def test_stride_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stride"):
        place(hosts(2), stride=0)
