"""Exercise 18.2 (lesson 18): a radix-tree prefix cache, matched and grown one request at a time.

A behaviour exercise: the grader plays a branching conversation (a chat growing, answers regenerated,
agents sharing a system prompt) through your function, one request at a time, keeps the tree you return
for the next request, and checks each answer and the tree's shape. Lesson 18 builds the same tree with
objects and compares it with the engine's hashed blocks; here the tree is plain data.

Write `radix_insert` below, then check it:
    minillm exercise check 18.2       (in a clone: pytest lessons/exercises --exercise 18.2)
"""


def radix_insert(tree: list[dict], tokens: list[int]) -> dict:
    """Match `tokens` against the tree, then insert them.

    tree     a flat list of nodes {"parent": p, "tokens": [...]}: node i hangs below node p (-1: the
             root) by an edge holding a run of token ids; a node's path is the tokens of the edges from
             the root down to it. Indices are what the grader gave you; new nodes go at the end.
    tokens   the request's token ids
    returns  {"matched": n, "tree": new_tree}
      matched  how many leading tokens of the request were already in the tree (to the token; a match
               may end inside an edge)
      tree     the tree holding every earlier request and this one: below a node no two edges start with
               the same token (where the request leaves an edge part-way, split the edge: a new node
               holds the shared part, the old edge's rest and the request's rest hang below it), no
               token stored twice, and no node with a single child unless a request ends there

    Do not modify `tree` in place: return a new list (copy the nodes you change).
    """
    raise NotImplementedError("write radix_insert: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex18.2_radix_insert.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise("18.2", __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
