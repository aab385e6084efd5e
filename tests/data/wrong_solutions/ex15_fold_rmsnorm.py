"""A deliberately wrong solution of exercise 15: it scales the rows of W instead of its columns.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""

FAILS_CASE = 'rows or columns?'
SAYS = 'scaled the rows'


def fold_rmsnorm_into_linear(gain, w):
    return w * gain[:, None]
