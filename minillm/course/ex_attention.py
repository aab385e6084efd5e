"""Exercises 05-07, attention variants: mean-pooling KV heads (GQA/MQA), MLA in latent space, the
sliding-window mask. Each has its cases and its check; the references are the engine's own functions."""
from __future__ import annotations

import numpy as np

from minillm.course.cases import Case, CaseFailed, case_rng, expect_close, expect_unchanged


# 05: mean-pooling KV heads ---------------------------------------------------------------------------

def _pool_cases() -> list[Case]:
    def case(name, n_kv, n_new, hd, dim):
        return Case(name, dict(n_kv=n_kv, n_new=n_new, hd=hd, dim=dim))
    return [case("SmolLM2 keys: 3 KV heads -> 1 (MQA), head_dim 64, dim 576", 3, 1, 64, 576),
            case("MHA -> GQA: 8 heads -> 2, groups of 4 consecutive heads", 8, 2, 16, 48),
            case("6 heads -> 3: heads (0, 1), (2, 3), (4, 5)", 6, 3, 8, 32),
            case("n_new = n_kv_heads: nothing to pool, the same weights", 4, 4, 8, 16),
            case("MHA -> MQA: 32 heads -> 1", 32, 1, 8, 16)]


def _check_pool(fn, case: Case) -> str:
    from minillm.checkpoints.kv_heads import pool_heads
    c = case.inputs
    n_kv, n_new, hd, dim = c["n_kv"], c["n_new"], c["hd"], c["dim"]
    rng = case_rng(n_kv * 100 + n_new)
    # Each head gets its own offset, so mixing up which heads are averaged cannot hide.
    offsets = np.repeat(np.arange(n_kv, dtype=np.float32) * 0.5, hd)[:, None]        # [n_kv * hd, 1]
    w = (rng.standard_normal((n_kv * hd, dim)) * 0.1 + offsets).astype(np.float32)  # [n_kv * hd, dim]
    w_in = w.copy()
    got = fn(w_in, n_kv, n_new, hd)
    expect_unchanged("w", w, w_in)
    want = pool_heads(w, n_kv, n_new, hd)
    group = n_kv // n_new
    if isinstance(got, np.ndarray) and got.shape == want.shape:
        strided = w.reshape(group, n_new, hd, dim).mean(axis=0).reshape(n_new * hd, dim)
        if group > 1 and n_new > 1 and np.allclose(got, strided, atol=1e-5):
            raise CaseFailed(f"new head j is the mean of heads j, j + {n_new}, j + {2 * n_new}, ... (a stride of {n_new}); "
                             f"the groups are consecutive heads j*{group} .. j*{group} + {group - 1}")
        if group > 1 and np.allclose(got, want * group, atol=1e-4):
            raise CaseFailed(f"summed the {group} heads of each group instead of averaging them")
    return expect_close("pooled weights", got, want)


# 06: MLA attention in latent space ------------------------------------------------------------------

def _mla_cases() -> list[Case]:
    def case(name, H, T, L, nope, rope, r, v):
        return Case(name, dict(H=H, T=T, L=L, nope=nope, rope=rope, r=r, v=v))
    return [case("decode: one query against 12 cached latents", 4, 1, 12, 16, 8, 24, 12),
            case("prefill: 6 queries into an empty cache (causal mask)", 4, 6, 6, 16, 8, 24, 12),
            case("a chunk: 3 queries after 7 cached positions", 2, 3, 10, 16, 8, 24, 12),
            case("DeepSeek-V3 head shapes: nope 128, rope 64, r 512, v_head 128", 2, 2, 9, 128, 64, 512, 128),
            case("square W_UK (nope = r = 16): a transposed W_UK gives wrong numbers, not a shape error",
                 3, 2, 5, 16, 8, 16, 16),
            case("a model from mla_convert: nope = 0, scores from the RoPE part alone", 3, 2, 7, 0, 16, 20, 8)]


def _latent_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, scale, causal=True, rope_term=True):
    """The absorbed formula written plainly, with switches the grader uses to name a student's mistake."""
    from minillm.model.attention import mask_bias
    H, T, _ = q_rope.shape
    scores = (q_nope @ w_uk) @ c_kv.T                                    # [H, T, L]
    if rope_term:
        scores = scores + q_rope @ k_rope.T
    scores = scores * scale
    if causal and T > 1:
        scores = scores + mask_bias(T, c_kv.shape[0])
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ c_kv) @ w_uv.transpose(0, 2, 1)                          # [H, T, v_head]


def _check_mla(fn, case: Case) -> str:
    from minillm.model.mla import absorbed_attention
    c = case.inputs
    H, T, L, nope, rope, r, v = (c[k] for k in ("H", "T", "L", "nope", "rope", "r", "v"))
    rng = case_rng(H * 1000 + T * 100 + L)

    def rand(*shape, s=1.0):
        return (rng.standard_normal(shape) * s).astype(np.float32)
    inputs = dict(q_nope=rand(H, T, nope), q_rope=rand(H, T, rope), c_kv=rand(L, r), k_rope=rand(L, rope),
                  w_uk=rand(H, nope, r, s=r ** -0.5), w_uv=rand(H, v, r, s=r ** -0.5))
    scale = float((nope + rope) ** -0.5)
    copies = {k: a.copy() for k, a in inputs.items()}
    got = fn(**copies, scale=scale)
    for k, a in inputs.items():
        expect_unchanged(k, a, copies[k])
    want = absorbed_attention(**{k: a.copy() for k, a in inputs.items()}, scale=scale)
    if isinstance(got, np.ndarray) and got.shape == want.shape and not np.allclose(got, want, rtol=1e-4, atol=1e-5):
        hints = [(dict(causal=False), "no causal mask: with T > 1, query t (position L - T + t) must not see "
                                      "the positions after it"),
                 (dict(scale=1.0), f"the softmax scale is missing: multiply the scores by scale ({scale:.3g})"),
                 (dict(rope_term=False), "the RoPE part of the score is missing: add q_rope · k_ropeᵀ")]
        for change, message in hints:
            args = dict(inputs, scale=scale) | change
            if np.allclose(got, _latent_attention(**args), rtol=1e-4, atol=1e-5):
                raise CaseFailed(message)
    return expect_close("output", got, want)


# 07: the sliding-window mask -------------------------------------------------------------------------

def _mask_cases() -> list[Case]:
    def case(name, T, L, window):
        return Case(name, dict(T=T, L=L, window=window))
    return [case("prefill: 8 positions, window 3", 8, 8, 3),
            case("decode: the newest of 10 positions, window 4", 1, 10, 4),
            case("a chunk: 3 queries after 9 cached positions, window 5", 3, 12, 5),
            case("window 1: each query sees only itself", 5, 5, 1),
            case("window longer than the sequence: plain causal", 6, 6, 100),
            case("no window (None): plain causal, 4 queries after 3 cached", 4, 7, None),
            case("Mistral at decode: position 5000, window 4096", 1, 5001, 4096)]


def _mask_hidden(seed: int) -> list[Case]:
    """Fresh lengths and windows: a mask recalled from the public cases fails these."""
    rng = np.random.default_rng([seed, 7])
    cases = []
    for i in range(6):
        L = int(rng.integers(1, 300))
        T = int(rng.integers(1, L + 1))
        window = None if i == 0 else int(rng.integers(1, L + 3))
        cases.append(Case(f"{T} queries after {L - T} cached positions, window {window}",
                          dict(T=T, L=L, window=window)))
    return cases


def _check_mask(fn, case: Case) -> str:
    from minillm.model.attention import attention_mask
    T, L, window = case.inputs["T"], case.inputs["L"], case.inputs["window"]
    got = fn(T, L, window)
    want = attention_mask(T, L, window)
    if not isinstance(got, np.ndarray) or got.shape != want.shape:
        raise CaseFailed(f"returned {getattr(got, 'shape', type(got).__name__)}, expected a bool array of "
                         f"shape {list(want.shape)}")
    if got.dtype != bool and not np.isin(got, (0, 1)).all():
        raise CaseFailed(f"returned {got.dtype} values other than 0/1; return a bool array (True = may attend)")
    got = got.astype(bool)
    if np.array_equal(got, want):
        return f"mask {list(want.shape)}: {int(want.sum())} allowed pairs"
    if window is not None and np.array_equal(got, attention_mask(T, L, window + 1)):
        raise CaseFailed(f"each query sees {window + 1} keys, one too many: the window is W = {window} key(s) "
                         f"with the query itself included (positions p - W + 1 .. p)")
    if T < L and np.array_equal(got, _top_left(T, L, window)):
        raise CaseFailed("the queries are the LAST n_queries of the n_keys positions (query i is at position "
                         "n_keys - n_queries + i), not the first")
    i = int(np.flatnonzero((got != want).any(axis=1))[0])
    pos = L - T + i
    return _fail_row(i, pos, got[i], want[i])


def _top_left(T: int, L: int, window) -> np.ndarray:
    """The common mistake: queries placed at positions 0 .. T-1 instead of L-T .. L-1."""
    from minillm.model.attention import attention_mask
    return attention_mask(T, T, window) if T == L else np.pad(attention_mask(T, T, window), ((0, 0), (0, L - T)))


def _fail_row(i: int, pos: int, got: np.ndarray, want: np.ndarray):
    def spans(row):
        keys = np.flatnonzero(row)
        return "none" if keys.size == 0 else (f"{keys[0]}..{keys[-1]}" if keys[-1] - keys[0] + 1 == keys.size
                                               else ", ".join(map(str, keys[:8])) + (" ..." if keys.size > 8 else ""))
    raise CaseFailed(f"query {i} (position {pos}) may see keys {spans(want)}; yours allows {spans(got)}")
