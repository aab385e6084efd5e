"""Exercise 18.2, a behaviour exercise: a radix-tree prefix cache (SGLang's design; lesson 18 builds one).

The tree is data, a flat list of nodes `{"parent": index or -1 (the root), "tokens": [the edge's token
ids]}`. For each request of a branching conversation the grader hands the student's `radix_insert` the
tree as it stands and the request's tokens; the answer is how many leading tokens the tree already held
and the tree with the request inserted. The grader checks every answer against the conversation itself
(the longest prefix shared with an earlier request) and the tree's invariants, keeps the tree for the
next request, and reports the tokens reused beside what the engine's hashed blocks reuse (PrefixCache)."""
from __future__ import annotations

from minillm.course.behaviour import replay
from minillm.course.cases import Case, CaseFailed, case_rng


def radix_insert_reference(tree: list[dict], tokens: list[int]) -> dict:
    """Walk down to the longest match, splitting the edge where the request diverges (or ends), then
    hang the rest of the request below as one new edge."""
    tree = [{"parent": n["parent"], "tokens": list(n["tokens"])} for n in tree]
    node, i = -1, 0
    while i < len(tokens):
        child = next((c for c, n in enumerate(tree) if n["parent"] == node and n["tokens"][0] == tokens[i]), None)
        if child is None:
            tree.append({"parent": node, "tokens": list(tokens[i:])})
            return {"matched": i, "tree": tree}
        edge = tree[child]["tokens"]
        n = 0
        while n < len(edge) and i + n < len(tokens) and edge[n] == tokens[i + n]:
            n += 1
        if n < len(edge):                                   # split: a middle node holds the shared part
            tree.append({"parent": node, "tokens": edge[:n]})
            tree[child] = {"parent": len(tree) - 1, "tokens": edge[n:]}
            child = len(tree) - 1
        node, i = child, i + n
        if n < len(edge):
            matched = i
            if i < len(tokens):
                tree.append({"parent": node, "tokens": list(tokens[i:])})
            return {"matched": matched, "tree": tree}
    return {"matched": len(tokens), "tree": tree}


def _shared(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class RadixWorld:
    """The grader's side: the conversation, the tree the student last returned, and the engine's
    hashed-block PrefixCache fed the same requests (for comparison)."""

    def __init__(self, requests: list[list[int]], block_size: int = 4):
        from minillm.engine.prefix_cache import PrefixCache
        self.requests, self.block_size = requests, block_size
        self.tree: list[dict] = []
        self.i = self.reused = self.hashed = 0
        self.cache, self.next_block = PrefixCache(), 0

    def observe(self) -> dict:
        return {"tree": self.tree, "tokens": self.requests[self.i]}

    def apply(self, decision) -> None:
        from minillm.engine.prefix_cache import block_hashes
        tokens, earlier = self.requests[self.i], self.requests[:self.i]
        matched = int(decision["matched"])
        want = max((_shared(tokens, r) for r in earlier), default=0)
        if matched != want:
            raise CaseFailed(f"matched {matched} tokens, but an earlier request shares its first {want}")
        tree = [{"parent": int(n["parent"]), "tokens": [int(t) for t in n["tokens"]]} for n in decision["tree"]]
        _check_tree(tree, self.requests[:self.i + 1])
        self.tree, self.reused = tree, self.reused + matched
        hashes = block_hashes(tokens, self.block_size)
        self.hashed += len(self.cache.match(hashes)) * self.block_size
        for h in hashes:
            if self.cache.insert(h, self.next_block):
                self.next_block += 1
        self.i += 1

    def done(self) -> bool:
        return self.i == len(self.requests)

    def verdict(self) -> str:
        total = sum(len(r) for r in self.requests)
        return (f"{self.reused} of {total} tokens reused over {len(self.requests)} requests, {len(self.tree)} nodes "
                f"(the engine's hashed {self.block_size}-token blocks reuse {self.hashed})")


def _check_tree(tree: list[dict], inserted: list[list[int]]) -> None:
    """A radix tree holding exactly `inserted`: edges non-empty, siblings start with different tokens,
    every request walkable to its end, as many tokens as distinct prefixes, and no unbranched node that
    ends no request (a chain that should be one edge)."""
    children: dict[int, list[int]] = {}
    for i, n in enumerate(tree):
        if not n["tokens"]:
            raise CaseFailed(f"node {i} has an empty edge")
        if not -1 <= n["parent"] < len(tree) or n["parent"] == i:
            raise CaseFailed(f"node {i} has parent {n['parent']}, which is no node")
        children.setdefault(n["parent"], []).append(i)
    paths = {-1: ()}

    def path(i: int, depth: int = 0) -> tuple:
        if i not in paths:
            if depth > len(tree):
                raise CaseFailed(f"node {i} is its own ancestor")
            paths[i] = path(tree[i]["parent"], depth + 1) + tuple(tree[i]["tokens"])
        return paths[i]
    for parent, kids in children.items():
        firsts = [tree[k]["tokens"][0] for k in kids]
        if len(set(firsts)) < len(firsts):
            raise CaseFailed(f"two edges below node {parent} start with the same token: split the shared part")
    ends = {tuple(r) for r in inserted}
    full = {path(i) for i in range(len(tree))}
    for r in inserted:
        if not any(p[:len(r)] == tuple(r) for p in full):
            raise CaseFailed(f"request {inserted.index(r)} is not in the tree")
    prefixes = {tuple(r[:k]) for r in inserted for k in range(1, len(r) + 1)}
    held = sum(len(n["tokens"]) for n in tree)
    if held != len(prefixes):
        raise CaseFailed(f"the tree holds {held} tokens; the requests so far have {len(prefixes)} distinct "
                         f"prefixes (a token stored twice, or one no request has)")
    for i in range(len(tree)):
        if len(children.get(i, [])) == 1 and path(i) not in ends:
            raise CaseFailed(f"node {i} has one child and ends no request: its edge and its child's are one run")


def _radix_cases() -> list[Case]:
    rng = case_rng(18, 2)

    def run(n):                                     # n tokens, give or take two (hidden cases vary the lengths)
        return [int(t) for t in rng.integers(0, 500, n + int(rng.integers(-2, 3)))]
    system, q1, a1, q2 = run(12), run(5), run(7), run(4)
    chat = [system + q1, system + q1 + a1 + q2, system + q1 + a1 + q2 + run(6)]
    regen = [system + q1 + a1, system + q1 + run(6), system + q1 + a1[:3] + run(5)]
    other = run(3)
    return [Case("a chat growing turn by turn", dict(requests=chat)),
            Case("a branching conversation: answers regenerated from the middle of an edge",
                 dict(requests=regen)),
            Case("two agents whose system prompts share their first tokens",
                 dict(requests=[system + q1, system[:6] + other + q2, system[:6] + other + a1, system + q2])),
            Case("a request that is a prefix of an earlier one, then one that extends it",
                 dict(requests=[system + q1 + a1, system + q1, system + q1 + q2])),
            Case("the same request twice, and one sharing nothing", dict(requests=[q1 + a1, q1 + a1, q2]))]


def _check_radix(fn, case: Case) -> str:
    return replay(lambda state: fn(state["tree"], state["tokens"]), RadixWorld(**case.inputs))
