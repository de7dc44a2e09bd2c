"""Pure planners of csrc/algorithm/topology.*: ring order, double binary tree, broadcast trees,
chunking; checked for every world size 1..65 (no processes, no communication)."""

import pytest

from dist_kernels import _C

WORLD_SIZES = range(1, 66)


def _tree(node_fn, n):
    """{rank: (parent, children)} for one tree, checked for parent/child consistency."""
    nodes = {r: node_fn(r) for r in range(n)}
    for r, (parent, children) in nodes.items():
        assert len(children) <= 2
        if parent >= 0:
            assert r in nodes[parent][1], f"n={n}: {r}'s parent {parent} does not list it"
        for c in children:
            assert nodes[c][0] == r, f"n={n}: child {c} of {r} names parent {nodes[c][0]}"
    return nodes


def _reaches_everyone_once(nodes, n):
    roots = [r for r, (p, _) in nodes.items() if p < 0]
    assert len(roots) == 1, f"n={n}: roots {roots}"
    seen, frontier = [], roots
    while frontier:
        seen += frontier
        frontier = [c for r in frontier for c in nodes[r][1]]
    assert sorted(seen) == list(range(n)), f"n={n}: reached {sorted(seen)}"
    return roots[0]


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_order_is_a_permutation(n):
    assert sorted(_C._ring_order(n)) == list(range(n))


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_double_tree(n):
    trees = [_tree(lambda r, t=t: _C._double_tree_node(t, n, r), n) for t in (0, 1)]
    for nodes in trees:
        _reaches_everyone_once(nodes, n)
    interior = [{r for r, (_, ch) in nodes.items() if ch} for nodes in trees]
    assert not interior[0] & interior[1], (
        f"n={n}: interior in both trees: {interior[0] & interior[1]}"
    )
    depth = max(len(bin(n)) - 2, 1)
    for nodes in trees:  # the in-order tree is balanced: depth ~ log2 n
        for r in range(n):
            hops, p = 0, r
            while nodes[p][0] >= 0:
                p, hops = nodes[p][0], hops + 1
            assert hops <= depth, f"n={n}: rank {r} is {hops} hops deep"


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_broadcast_trees_rooted_at_src(n):
    for root in {0, n // 2, n - 1}:
        for fn in (_C._chain_node, _C._heap_tree_node):
            nodes = _tree(lambda r, fn=fn, root=root: fn(n, root, r), n)
            assert _reaches_everyone_once(nodes, n) == root


@pytest.mark.parametrize("count", [0, 1, 7, 64, 1000, 2**20 + 7])
@pytest.mark.parametrize("parts", [1, 2, 3, 8, 65])
def test_chunks_tile_the_buffer(count, parts):
    granule = 16
    offset = 0
    for i in range(parts):
        start, size = _C._chunk_range(count, parts, i, granule)
        assert start == offset, (count, parts, i)
        if i + 1 < parts and start + size < count:
            assert size % granule == 0, "inner boundaries stay aligned"
        offset += size
    assert offset == count
