"""A deliberately wrong solution of exercise 24: it rescales l but forgets to rescale acc.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""
import numpy as np

FAILS_CASE = 'two halves of 64 keys'
SAYS = 'acc: max abs error'


def merge_softmax_partials(m_a, l_a, acc_a, m_b, l_b, acc_b):
    m = np.maximum(m_a, m_b)
    ref = np.where(m == -np.inf, 0.0, m)
    w_a = np.where(m_a == -np.inf, 0.0, np.exp(m_a - ref)).astype(np.float32)
    w_b = np.where(m_b == -np.inf, 0.0, np.exp(m_b - ref)).astype(np.float32)
    return m, l_a * w_a + l_b * w_b, acc_a + acc_b
