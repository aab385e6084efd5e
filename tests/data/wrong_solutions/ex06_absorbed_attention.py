"""A deliberately wrong solution of exercise 06: it forgets the causal mask.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""
import numpy as np

FAILS_CASE = 'prefill'
SAYS = 'causal mask'


def absorbed_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, scale):
    scores = ((q_nope @ w_uk) @ c_kv.T + q_rope @ k_rope.T) * scale
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ c_kv @ w_uv.transpose(0, 2, 1)
