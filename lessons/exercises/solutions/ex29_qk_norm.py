"""Exercise 29 (lesson 29): QK-norm, each attention head's query and key normed on its own (Qwen3, Gemma 3).

Reference solution (for teachers; never in the handout). The stub is lessons/exercises/ex29_qk_norm.py.

Write `qk_norm` below, then check it:
    minillm exercise check 29         (in a clone: pytest lessons/exercises --exercise 29)
The grader compares it with what the engine runs when config.qk_norm is set (`Transformer.qkv`:
`minillm.model.layers.rmsnorm` over the last axis of q and k, `minillm.course.qk_norm_reference`).
"""
import numpy as np


def qk_norm(q: np.ndarray, k: np.ndarray, q_gain: np.ndarray, k_gain: np.ndarray, eps: float):
    """RMSNorm each head's query and key vector over its own head_dim values, then scale by the gain.

    q       [T, n_heads, head_dim]      the queries after q_proj, split into heads (before RoPE)
    k       [T, n_kv_heads, head_dim]   the keys after k_proj, split into heads (before RoPE)
    q_gain  [head_dim]                  one gain per dimension, shared by every query head
    k_gain  [head_dim]                  the same for the keys
    eps     float                       added to the mean square before the square root
    returns (q_normed, k_normed), the same shapes: x / sqrt(mean(x²) + eps) * gain, the mean taken over
            each head's head_dim values (the last axis), never over all the heads of a token at once.

    Why: a query or key that grows large makes the attention scores q·k huge and the softmax one-hot;
    normed, every score is at most about head_dim · gain², whatever the activations do. Compute in float32;
    do not modify the inputs in place.
    """
    def norm(x, gain):                                           # x: [T, heads, head_dim]
        x = x.astype(np.float32)
        mean_square = np.square(x).mean(axis=-1, keepdims=True)  # [T, heads, 1]: one per head
        return x / np.sqrt(mean_square + eps) * gain             # [T, heads, head_dim]
    return norm(q, q_gain), norm(k, k_gain)


if __name__ == "__main__":   # `python lessons/exercises/ex29_qk_norm.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(29, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
