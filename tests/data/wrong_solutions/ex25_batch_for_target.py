"""A deliberately wrong solution of exercise 25: it stops at the first batch that misses the target, which
is right on a table that only grows and wrong on a measured one that dips.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""
FAILS_CASE = "a measured table that dips"
SAYS = "expected batch"


def batch_for_target(step_ms, prefill_ms, output_tokens, latency_ms, ttft_ms):
    best = 0
    for b, step in enumerate(step_ms, start=1):
        if step + b / output_tokens * prefill_ms > latency_ms or step + prefill_ms > ttft_ms:
            break
        best = b
    return best
