"""A deliberately wrong solution of exercise 29: one RMS over all the heads of a token, as a Llama input norm.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""
import numpy as np

FAILS_CASE = 'heads 1000x apart in size'
SAYS = 'normed over all the heads of a token at once'


def qk_norm(q, k, q_gain, k_gain, eps):
    def norm(x, gain):
        T, heads, hd = x.shape
        flat = x.reshape(T, heads * hd)
        rms = np.sqrt(np.square(flat).mean(axis=-1, keepdims=True) + eps)
        return (flat / rms).reshape(T, heads, hd) * gain
    return norm(q, q_gain), norm(k, k_gain)
