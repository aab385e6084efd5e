"""A deliberately wrong solution of exercise 16: it reads blocks 0, 1, 2, ... whatever the table says.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""

FAILS_CASE = 'a scattered table'
SAYS = 'read the blocks the table names'


def gather_through_block_table(pool, block_table, length):
    keys = pool[:len(block_table)].reshape(-1, *pool.shape[2:])[:length]
    return keys.transpose(1, 0, 2)
