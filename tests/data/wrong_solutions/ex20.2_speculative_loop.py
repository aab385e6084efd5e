"""A deliberately wrong solution of exercise 20.2: it never rolls the cache back (rejected drafts stay).
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""

FAILS_CASE = "a drafter always wrong"
SAYS = "the committed tokens need"


def speculative_decode_step(state):
    draft, best = state["draft"], state["target_argmax"]
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
    return {"emit": list(draft[:n]) + [best[n]], "cache_length": state["cache_length"]}
