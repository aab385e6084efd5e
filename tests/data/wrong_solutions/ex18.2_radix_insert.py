"""A deliberately wrong solution of exercise 18.2: where a request leaves an edge part-way it adds a second
edge beside it instead of splitting it. The grader must fail it on the case named FAILS_CASE, with SAYS in
its message (tests/test_exercises.py)."""

FAILS_CASE = "a branching conversation"
SAYS = "start with the same token"


def radix_insert(tree, tokens):
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
        if n < len(edge):                                   # the bug: no split, a second edge from the same node
            if i + n < len(tokens):
                tree.append({"parent": node, "tokens": list(tokens[i:])})
            return {"matched": i + n, "tree": tree}
        node, i = child, i + n
    return {"matched": len(tokens), "tree": tree}
