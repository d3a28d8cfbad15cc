"""A character-level approximate radix tree shared by tenants (replicas), SGLang-router style.

Used by the `sglang-cache-aware` baseline. One compressed tree holds every tenant's
texts; each node records which tenants reached it and when (``tenants``: tenant ->
last access, in the order tenants first reached the node). Tenant sets are
prefix-closed: a tenant on a node is on all its ancestors.

- ``insert(text, tenant, now_s)``: add/refresh the path for a tenant.
- ``match(text)``: longest matched prefix over all tenants, counting a partial edge, and
  the first tenant of the deepest node reached (the one that created it), as SGLang's
  ``prefix_match`` does.
- ``evict(max_chars)``: per tenant over budget, drop that tenant's least recently used
  leaves until it holds at most ``max_chars`` characters.

Speed: edges are compared by slicing (``str.startswith`` with an offset, C speed);
only a diverging edge is searched for its split point (galloping, then bisection), so
inserting or matching a 400 KB text costs a few milliseconds.
"""

from __future__ import annotations

import heapq
import itertools


class _Node:
    __slots__ = ("children", "label", "parent", "tenants")

    def __init__(
        self, label: str, parent: _Node | None, tenants: dict[str, float] | None = None
    ) -> None:
        self.label = label
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.tenants: dict[str, float] = tenants if tenants is not None else {}


def common_prefix_len(label: str, text: str, start: int) -> int:
    """Length of the common prefix of ``label`` and ``text[start:]``."""
    limit = min(len(label), len(text) - start)
    lo, step = 0, 1  # invariant: label[:lo] matches
    while lo < limit:
        hi = min(lo + step, limit)
        if text.startswith(label[lo:hi], start + lo):
            lo, step = hi, step * 2
            continue
        while hi - lo > 1:  # label[:lo] matches, label[:hi] does not
            mid = (lo + hi) // 2
            if text.startswith(label[lo:mid], start + lo):
                lo = mid
            else:
                hi = mid
        return lo
    return lo


class ApproxRadixTree:
    def __init__(self) -> None:
        self.root = _Node("", None)
        self._chars: dict[str, int] = {}

    def tenant_chars(self, tenant: str) -> int:
        return self._chars.get(tenant, 0)

    def tenants(self) -> list[str]:
        return list(self._chars)

    def _touch(self, node: _Node, tenant: str, now_s: float) -> None:
        if tenant not in node.tenants:
            self._chars[tenant] = self._chars.get(tenant, 0) + len(node.label)
        node.tenants[tenant] = now_s  # an existing key keeps its position (creation order)

    def insert(self, text: str, tenant: str, now_s: float) -> None:
        node, i, n = self.root, 0, len(text)
        self._touch(node, tenant, now_s)
        while i < n:
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node)
                node.children[text[i]] = leaf
                self._touch(leaf, tenant, now_s)
                return
            if not text.startswith(child.label, i):
                child = self._split(node, child, common_prefix_len(child.label, text, i))
            self._touch(child, tenant, now_s)
            i += len(child.label)
            node = child

    def _split(self, parent: _Node, child: _Node, k: int) -> _Node:
        """Cut ``child``'s edge after ``k`` chars; return the new upper node."""
        upper = _Node(child.label[:k], parent, dict(child.tenants))
        child.label = child.label[k:]
        child.parent = upper
        upper.children[child.label[0]] = child
        parent.children[upper.label[0]] = upper
        return upper

    def match(self, text: str) -> tuple[int, str | None]:
        """(matched chars, first tenant of the deepest node reached). Pure read."""
        node, i, n = self.root, 0, len(text)
        while i < n:
            child = node.children.get(text[i])
            if child is None:
                break
            node = child
            if text.startswith(child.label, i):
                i += len(child.label)
                continue
            i += common_prefix_len(child.label, text, i)
            break
        return i, next(iter(node.tenants), None)

    def _leaves_of(self, tenant: str) -> list[_Node]:
        leaves: list[_Node] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            below = [c for c in node.children.values() if tenant in c.tenants]
            if below:
                stack.extend(below)
            elif node is not self.root:
                leaves.append(node)
        return leaves

    def _drop(self, node: _Node, tenant: str) -> None:
        del node.tenants[tenant]
        self._chars[tenant] -= len(node.label)
        if not node.tenants and node.parent is not None:
            node.parent.children.pop(node.label[0], None)

    def evict(self, max_chars: int) -> None:
        """Trim every tenant over ``max_chars`` by its least recently used leaves."""
        for tenant in [t for t, c in self._chars.items() if c > max_chars]:
            seq = itertools.count()
            heap = [(n.tenants[tenant], next(seq), n) for n in self._leaves_of(tenant)]
            heapq.heapify(heap)
            while heap and self._chars[tenant] > max_chars:
                _, _, node = heapq.heappop(heap)
                self._drop(node, tenant)
                parent = node.parent
                if parent is None or parent is self.root:
                    continue
                if not any(tenant in c.tenants for c in parent.children.values()):
                    heapq.heappush(heap, (parent.tenants[tenant], next(seq), parent))

    def remove_tenant(self, tenant: str) -> None:
        """Forget a tenant everywhere (a replica left the fleet)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(c for c in node.children.values() if tenant in c.tenants)
            if tenant in node.tenants and node is not self.root:
                self._drop(node, tenant)
        self.root.tenants.pop(tenant, None)
        self._chars.pop(tenant, None)
