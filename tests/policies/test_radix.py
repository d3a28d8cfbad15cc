"""The approximate radix tree against a naive model (Hypothesis), and its eviction."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.radix import ApproxRadixTree, _Node, common_prefix_len

texts = st.text(alphabet="abc", min_size=0, max_size=30)
tenants = st.sampled_from(["r0", "r1", "r2"])


def common(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def nodes(tree: ApproxRadixTree) -> list[_Node]:
    out, stack = [], [tree.root]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def check_invariants(tree: ApproxRadixTree) -> None:
    all_nodes = nodes(tree)
    for node in all_nodes:
        for child in node.children.values():
            assert set(child.tenants) <= set(node.tenants)  # prefix-closed
            assert child.label and child.parent is node
    for t in tree.tenants():
        assert tree.tenant_chars(t) == sum(len(n.label) for n in all_nodes if t in n.tenants)


@given(st.text(alphabet="ab", max_size=50), st.text(alphabet="ab", max_size=50), st.integers(0, 50))
def test_common_prefix_len(a: str, b: str, start: int) -> None:
    start = min(start, len(b))
    assert common_prefix_len(a, b, start) == common(a, b[start:])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(texts, tenants), max_size=15), texts)
def test_match_agrees_with_naive_model(inserted: list[tuple[str, str]], query: str) -> None:
    tree = ApproxRadixTree()
    for i, (text, who) in enumerate(inserted):
        tree.insert(text, who, float(i))
    check_invariants(tree)
    matched, tenant = tree.match(query)
    best = max((common(t, query) for t, _ in inserted), default=0)
    assert matched == best
    if matched > 0:
        assert any(common(t, query) >= matched and who == tenant for t, who in inserted)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(texts, tenants), max_size=15), st.integers(0, 40))
def test_evict_bounds_every_tenant(inserted: list[tuple[str, str]], budget: int) -> None:
    tree = ApproxRadixTree()
    for i, (text, who) in enumerate(inserted):
        tree.insert(text, who, float(i))
    tree.evict(budget)
    check_invariants(tree)
    assert all(tree.tenant_chars(t) <= budget for t in tree.tenants())


def test_evict_drops_least_recently_used_first() -> None:
    tree = ApproxRadixTree()
    tree.insert("old-text", "r0", 1.0)
    tree.insert("new-text", "r0", 2.0)
    tree.evict(8)
    assert tree.match("new-text") == (8, "r0")
    assert tree.match("old-text")[0] < 8


def test_first_creator_wins_the_deepest_node() -> None:
    tree = ApproxRadixTree()
    tree.insert("shared system prompt", "r1", 1.0)
    tree.insert("shared system prompt", "r0", 2.0)
    assert tree.match("shared system prompt and more") == (20, "r1")


def test_remove_tenant() -> None:
    tree = ApproxRadixTree()
    tree.insert("abcdef", "r0", 1.0)
    tree.insert("abcxyz", "r1", 1.0)
    tree.remove_tenant("r0")
    check_invariants(tree)
    assert tree.match("abcdef") == (3, "r1")
    assert tree.tenant_chars("r0") == 0
