"""A deliberately wrong solution of exercise 05: it averages every n_new-th head instead of consecutive ones.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""

FAILS_CASE = '8 heads -> 2'
SAYS = 'consecutive'


def mean_pool_kv_heads(w, n_kv_heads, n_new, head_dim):
    group = n_kv_heads // n_new
    return w.reshape(group, n_new, head_dim, -1).mean(axis=0).reshape(n_new * head_dim, -1)
