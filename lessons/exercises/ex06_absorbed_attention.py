"""Exercise 06 (lesson 06): multi-head latent attention in latent space ("absorbed"), never expanding K or V.

Write `absorbed_attention` below, then check it:
    minillm exercise check 6          (in a clone: pytest lessons/exercises --exercise 6)
The grader compares it with the engine's `minillm.model.mla.absorbed_attention` on random inputs.
"""
import numpy as np


def absorbed_attention(q_nope: np.ndarray, q_rope: np.ndarray, c_kv: np.ndarray, k_rope: np.ndarray,
                       w_uk: np.ndarray, w_uv: np.ndarray, scale: float) -> np.ndarray:
    """Attention of H heads over a latent cache, with W_UK folded into the query and W_UV applied last.

    q_nope: [H, T, nope]   each head's query part without RoPE
    q_rope: [H, T, rope]   each head's query part with RoPE (already rotated)
    c_kv:   [L, r]         the cached latents (r = kv_lora_rank), one per position
    k_rope: [L, rope]      the cached RoPE key, one per position, shared by every head
    w_uk:   [H, nope, r]   per head: k_nope_h = w_uk[h] @ c        (the key up-projection)
    w_uv:   [H, v_head, r] per head: v_h      = w_uv[h] @ c        (the value up-projection)
    scale:  the softmax scale, 1/sqrt(nope + rope) in DeepSeek
    returns [H, T, v_head]: per head, softmax(scale · scores) · values, where the score of query t
            against position l is  q_nope[h, t] · k_nope_h[l] + q_rope[h, t] · k_rope[l]

    Never build k_nope or the values for all L positions. Use
        q_nope · (W_UK c) = (W_UKᵀ q_nope) · c      score each head directly against c_kv
        Σ_l p_l (W_UV c_l) = W_UV (Σ_l p_l c_l)      attend over c_kv, then up-project once
    The T queries are the LAST T of the L positions (L - T were cached before): when T > 1, query t
    may not see positions after its own (causal mask). Do not modify the inputs in place.
    """
    raise NotImplementedError("write absorbed_attention: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex06_absorbed_attention.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(6, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
