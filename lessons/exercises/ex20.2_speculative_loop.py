"""Exercise 20.2 (lesson 20): one step of greedy speculative decoding, and rolling back the KV cache.

A behaviour exercise: the grader owns the model, its KV cache and a drafter; you decide, as data, what
one verify pass commits. The grader applies your decision to its cache (KVCache.truncate) and fails the
case as soon as a token differs from plain greedy decoding or the cache holds the wrong positions.
Lesson 20 explains why the verify pass costs about one decode step, and exercise 20 the sampled case.

Write `speculative_decode_step` below, then check it:
    minillm exercise check 20.2       (in a clone: pytest lessons/exercises --exercise 20.2)
"""


def speculative_decode_step(state: dict) -> dict:
    """Decide what one verify pass commits.

    state (plain data):
      draft          [k] token ids the drafter proposed to follow the last committed token
      target_argmax  [k + 1] the target's greedy token after each verified position: entry i is what the
                     target predicts after the last committed token and draft[:i]
      cache_length   positions in the target's KV cache now: the verify pass wrote the last committed
                     token and all k drafts into it
    returns {"emit": [token, ...], "cache_length": int}
      emit           the tokens this pass commits, in order: the drafts the target agrees with, then
                     one token of the target's own (always at least one, at most k + 1)
      cache_length   how many cache positions to keep: those of the tokens committed before this
                     pass and of the accepted drafts; the positions of rejected drafts must go (the
                     grader truncates the cache to this length). The newest emitted token is not in
                     the cache: the next verify pass feeds it.

    The output must be exactly plain greedy decoding's, token for token.
    """
    raise NotImplementedError("write speculative_decode_step: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex20.2_speculative_loop.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise("20.2", __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
