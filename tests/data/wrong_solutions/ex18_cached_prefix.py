"""A deliberately wrong solution of exercise 18: it counts matching tokens, not whole blocks.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""

FAILS_CASE = 'a cached 40-token system prompt'
SAYS = 'only whole blocks'


def cached_prefix_tokens(prompt, cached, block_size):
    best = 0
    for seq in cached:
        n = 0
        while n < min(len(prompt) - 1, len(seq)) and prompt[n] == seq[n]:
            n += 1
        best = max(best, n)
    return best
