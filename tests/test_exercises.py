"""The exercise grader: the engine's solution passes, an unwritten exercise fails kindly, and a
subtly wrong solution fails on the case that exposes it."""
import numpy as np
import pytest

from minillm import course
from pathlib import Path

from minillm.course import EXERCISES, check_exercise, exercise_path, load_exercise
from minillm.course.cases import hidden_cases
from minillm.course.classroom import solution_path


@pytest.mark.parametrize("number", sorted(EXERCISES))
def test_exercise_filled_with_the_engine_solution_passes(number, monkeypatch):
    student = load_exercise(number)
    monkeypatch.setattr(student, EXERCISES[number].function, EXERCISES[number].reference)
    report = check_exercise(number, student)
    if _no_gpu_for(number):
        return _assert_not_graded(report)
    assert report.passed, str(report)
    assert len(report.cases) >= 4


def _no_gpu_for(number) -> bool:
    """A GPU exercise (12.2) on a machine without a GPU: its report must say so, and never pass."""
    from minillm.course.gpu_parts import why_no_gpu
    return EXERCISES[number].needs_gpu and why_no_gpu() is not None


def _assert_not_graded(report) -> None:
    assert not report.passed and not report.cases, str(report)
    assert report.note.startswith("not graded (no GPU") and "NOT GRADED: no case ran" in str(report)


@pytest.mark.parametrize("number", sorted(EXERCISES))
def test_unfilled_exercise_fails_with_a_friendly_message(number):
    report = check_exercise(number)            # the file as shipped: `raise NotImplementedError`
    assert not report.passed
    assert "not written yet" in report.note and EXERCISES[number].function in report.note
    assert f"ex{number}_" in str(report) and "FAILED" in str(report)


def test_pytest_exercise_option_grades_only_that_exercise():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(course.EXERCISES_DIR), "--exercise", "2"],
                          capture_output=True, text=True, cwd=course.LESSONS_DIR.parent)
    assert done.returncode == 1                       # the shipped file is not written yet
    assert "1 failed" in done.stdout and "kv_cache_update() is not written yet" in done.stdout


# ---- subtly wrong solutions, and the case that must catch each ------------------------------------

def rmsnorm_without_eps(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True)) * weight


def rmsnorm_eps_outside_the_root(x, weight, eps):
    return x / (np.sqrt(np.mean(x * x, axis=-1, keepdims=True)) + eps) * weight


def layernorm_instead(x, weight, eps):
    centred = x - x.mean(axis=-1, keepdims=True)
    return centred / np.sqrt(np.mean(centred ** 2, axis=-1, keepdims=True) + eps) * weight


def kv_update_returns_copies(cache_k, cache_v, k_new, v_new, pos):
    T = k_new.shape[1]
    cache_k[:, pos:pos + T], cache_v[:, pos:pos + T] = k_new, v_new
    return cache_k[:, :pos + T].copy(), cache_v[:, :pos + T].copy()


def kv_update_not_in_place(cache_k, cache_v, k_new, v_new, pos):
    if pos + k_new.shape[1] > cache_k.shape[1]:
        raise ValueError("full")
    return (np.concatenate([cache_k[:, :pos], k_new], axis=1),
            np.concatenate([cache_v[:, :pos], v_new], axis=1))


def kv_update_off_by_one(cache_k, cache_v, k_new, v_new, pos):
    T = k_new.shape[1]
    if pos + T > cache_k.shape[1]:
        raise ValueError("full")
    cache_k[:, pos + 1:pos + 1 + T], cache_v[:, pos + 1:pos + 1 + T] = k_new[:, :T - 1 or None], v_new[:, :T - 1 or None]
    return cache_k[:, :pos + T], cache_v[:, :pos + T]


def rope_adjacent_pairs(x, cos, sin):
    """llama.cpp's layout (pairs of neighbours) where the weights expect HF's half-split pairs."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = x1 * c - x2 * s, x2 * c + x1 * s
    return out


def rope_sign_flipped(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c + x2 * s, x2 * c - x1 * s], axis=-1)


def top_p_drops_the_crossing_token(logits, p):
    order = np.argsort(-logits)
    probs = np.exp(logits[order] - logits.max())
    probs /= probs.sum()
    out = np.full_like(logits, -np.inf)
    keep = order[np.cumsum(probs) <= p]
    out[keep] = logits[keep]
    return out


def top_p_in_place(logits, p):
    from minillm.engine.sampling import top_p_filter
    logits[:] = top_p_filter(logits, p)
    return logits


def pool_strided(w, n_kv_heads, n_new, head_dim):
    """Groups heads j, j + n_new, ... where the query heads expect consecutive groups."""
    group = n_kv_heads // n_new
    return w.reshape(group, n_new, head_dim, -1).mean(axis=0).reshape(n_new * head_dim, -1)


def pool_summed(w, n_kv_heads, n_new, head_dim):
    group = n_kv_heads // n_new
    return w.reshape(n_new, group, head_dim, -1).sum(axis=1).reshape(n_new * head_dim, -1)


def pool_rows_mixed(w, n_kv_heads, n_new, head_dim):
    """Reshapes as [n_new, head_dim, group]: averages rows of one head instead of one row of each head."""
    group = n_kv_heads // n_new
    return w.reshape(n_new, head_dim, group, -1).mean(axis=2).reshape(n_new * head_dim, -1)


def _latent(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, scale, causal=True):
    scores = ((q_nope @ w_uk) @ c_kv.T + q_rope @ k_rope.T) * scale       # [H, T, L]
    T, L = scores.shape[1:]
    if causal and T > 1:
        scores = scores + np.triu(np.full((T, L), -np.inf), k=L - T + 1)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ c_kv @ w_uv.transpose(0, 2, 1)


def mla_without_causal_mask(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, scale):
    return _latent(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, scale, causal=False)


def mla_without_scale(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, scale):
    return _latent(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, 1.0)


def mla_w_uk_transposed(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, scale):
    return _latent(q_nope, q_rope, c_kv, k_rope, w_uk.transpose(0, 2, 1), w_uv, scale)


def window_one_too_wide(n_queries, n_keys, window):
    from minillm.model.attention import attention_mask
    return attention_mask(n_queries, n_keys, None if window is None else window + 1)


def mask_queries_first(n_queries, n_keys, window):
    """Puts the queries at positions 0 .. T-1, as if nothing were cached."""
    q = np.arange(n_queries)[:, None]
    k = np.arange(n_keys)[None, :]
    return (k <= q) & (k > q - window) if window is not None else k <= q


def mask_without_window(n_queries, n_keys, window):
    from minillm.model.attention import attention_mask
    return attention_mask(n_queries, n_keys, None)


def int8_scale_from_max_not_abs(w):
    scales = (w.max(axis=1) / 127).astype(np.float32)
    return np.clip(np.rint(w / np.where(scales > 0, scales, 1.0)[:, None]), -127, 127).astype(np.int8), scales


def int8_scale_per_column(w):
    scales = (np.abs(w).max(axis=0) / 127).astype(np.float32)
    return np.clip(np.rint(w / np.where(scales > 0, scales, 1.0)), -127, 127).astype(np.int8), scales


def int8_divides_by_128(w):
    scales = (np.abs(w).max(axis=1) / 128).astype(np.float32)
    return np.clip(np.rint(w / np.where(scales > 0, scales, 1.0)[:, None]), -128, 127).astype(np.int8), scales


def int4_nibbles_swapped(w, group_size):
    from minillm.model.quant import quantize_int4
    q = quantize_int4(w, group_size)
    return ((q.qweight & 0x0F) << 4 | q.qweight >> 4).astype(np.uint8), q.scales, q.mins


def int4_without_padding(w, group_size):
    from minillm.model.quant import quantize_int4
    keep = w.shape[1] - w.shape[1] % group_size
    q = quantize_int4(w[:, :keep], group_size)
    return q.qweight, q.scales, q.mins


def int4_symmetric(w, group_size):
    """A symmetric grid stored as (codes + 8, min = -8·scale): right shapes, wrong levels."""
    from minillm.model.quant import pack_int4
    out, n = w.shape
    g = np.pad(w, ((0, 0), (0, -n % group_size)), mode="edge").reshape(out, -1, group_size)
    scale = np.abs(g).max(-1) / 7
    q = np.clip(np.rint(g / np.where(scale > 0, scale, 1)[..., None]) + 8, 0, 15).astype(np.uint8)
    return pack_int4(q.reshape(out, -1)), scale.astype(np.float16), (-8 * scale).astype(np.float16)


def kv_int8_scale_per_head(x):
    scales = np.broadcast_to(np.abs(x).max(axis=(1, 2))[:, None] / 127, x.shape[:2]).astype(np.float32)
    return np.clip(np.rint(x / np.where(scales > 0, scales, 1)[..., None]), -127, 127).astype(np.int8), scales


def kv_int8_scale_per_channel(x):
    scales = (np.abs(x).max(axis=1) / 127).astype(np.float32)                    # [n_kv, hd]: KIVI's keys
    return np.clip(np.rint(x / np.where(scales > 0, scales, 1)[:, None]), -127, 127).astype(np.int8), scales


def fold_scales_rows(gain, w):
    """Scales output rows: same shape on a square matrix, wrong numbers."""
    return w * gain[:, None]


def fold_divides(gain, w):
    return w / gain[None, :]


def fold_in_place(gain, w):
    w *= gain[None, :]
    return w


def transfer_norms_at_weight_bytes(config, weight_bytes=2):
    """Every parameter at weight_bytes: the fp32 norm gains counted as 16-bit."""
    return config.n_params * weight_bytes, 8, config.vocab_size * 4


def transfer_tied_head_twice(config, weight_bytes=2):
    from minillm.course import transfer_bytes_reference
    upload, up, down = transfer_bytes_reference(config, weight_bytes)
    return upload + (config.vocab_size * config.dim * weight_bytes if config.tie_embeddings else 0), up, down


def transfer_token_without_position(config, weight_bytes=2):
    from minillm.course import transfer_bytes_reference
    return transfer_bytes_reference(config, weight_bytes)[0], 4, config.vocab_size * 4


def block_sum_numpy_order(values, n_threads):
    return values.sum(axis=1, dtype=np.float32)


def block_sum_contiguous_chunks(values, n_threads):
    """Thread t adds a contiguous run of values instead of every n_threads-th one."""
    from minillm.course import _warps_reduced, _xor_shuffle_sum
    rows, n = values.shape
    per = -(-n // n_threads)
    padded = np.zeros((rows, n_threads * per), np.float32)
    padded[:, :n] = values
    acc = np.zeros((rows, n_threads), np.float32)
    for j in range(per):
        acc = acc + padded.reshape(rows, n_threads, per)[:, :, j]
    return _warps_reduced(_xor_shuffle_sum(acc.reshape(rows, -1, 32))[..., 0])


def block_sum_warps_in_a_loop(values, n_threads):
    """Right per-warp trees, but the warp totals summed in a loop instead of warp 0's xor tree."""
    from minillm.course import _xor_shuffle_sum
    rows, n = values.shape
    acc = np.zeros((rows, n_threads), np.float32)
    for start in range(0, n, n_threads):
        chunk = values[:, start:start + n_threads]
        acc[:, :chunk.shape[1]] += chunk
    partials = _xor_shuffle_sum(acc.reshape(rows, -1, 32))[..., 0]
    total = np.zeros(rows, np.float32)
    for w in range(partials.shape[1]):
        total = total + partials[:, w]
    return total


def block_sum_in_float64(values, n_threads):
    from minillm.course import block_sum_reference
    return block_sum_reference(values, n_threads).astype(np.float64)


def launches_without_the_embedding(config, gemv_version, fuse_norm):
    from minillm.course import decode_launches_reference
    return decode_launches_reference(config, gemv_version, fuse_norm) - 1


def launches_v2_attention_as_one(config, gemv_version, fuse_norm):
    """Counts the split + combine attention of gemv v1/v2 as one launch a layer."""
    from minillm.course import decode_launches_reference
    n = decode_launches_reference(config, gemv_version, fuse_norm)
    return n - config.n_layers if gemv_version < 4 else n


def launches_ignoring_the_v3_limit(config, gemv_version, fuse_norm):
    """Right per-layer counts, but assumes fuse_norm always fuses."""
    per_layer = (5 if fuse_norm else 7) if gemv_version >= 4 else (9 if fuse_norm else 11)
    return 1 + per_layer * config.n_layers + (1 if fuse_norm else 2)


def int4_words_high_nibble_first(words, scales, mins, in_features):
    """Reads element 2j from the high nibble of byte j."""
    from minillm.course import dequantize_int4_words_reference
    b = words.astype("<u4").view(np.uint8)
    return dequantize_int4_words_reference((((b & 0x0F) << 4) | (b >> 4)).view("<u4"), scales, mins, in_features)


def int4_words_keeps_padding(words, scales, mins, in_features):
    from minillm.course import dequantize_int4_words_reference
    return dequantize_int4_words_reference(words, scales, mins, words.shape[1] * 8)


def sse_text_field_only(body):
    """Reads completion chunks only: a chat chunk's text is in delta.content, not in text."""
    import json
    text, finish = "", None
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                text += choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
    return text, finish


def sse_assumes_choices(body):
    """Takes choices[0] of every chunk: the usage chunk has none."""
    import json
    text, finish = "", None
    for line in body.splitlines():
        if line.startswith("data: ") and line.strip() != "data: [DONE]":
            choice = json.loads(line[6:])["choices"][0]
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            finish = choice.get("finish_reason") or finish
    return text, finish


def sse_exact_done_line(body):
    """Splits on "\n" only, so under CRLF the end marker is "[DONE]\r" and goes to json.loads."""
    import json
    text, finish = "", None
    for line in body.split("\n"):
        if not line.startswith("data: "):
            continue
        if line[6:] == "[DONE]":
            break
        for choice in json.loads(line[6:])["choices"]:
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            finish = choice.get("finish_reason") or finish
    return text, finish


def gather_ignores_the_table(pool, block_table, length):
    """Blocks 0, 1, 2, ... as if the table were always in order."""
    keys = pool[:len(block_table)].reshape(-1, *pool.shape[2:])[:length]
    return keys.transpose(1, 0, 2)


def gather_positions_first(pool, block_table, length):
    return pool[block_table].reshape(-1, *pool.shape[2:])[:length]


def gather_whole_blocks(pool, block_table, length):
    n = -(-length // pool.shape[1])
    return pool[block_table[:n]].reshape(-1, *pool.shape[2:]).transpose(1, 0, 2)


def pack_positions_from_zero(chunks):
    tokens = np.concatenate([np.asarray(t, dtype=np.int64) for t, _ in chunks])
    positions = np.concatenate([np.arange(len(t)) for t, _ in chunks])
    return tokens, positions, np.cumsum([len(t) for t, _ in chunks]) - 1


def pack_last_rows_past_the_end(chunks):
    tokens = np.concatenate([np.asarray(t, dtype=np.int64) for t, _ in chunks])
    positions = np.concatenate([np.arange(s, s + len(t)) for t, s in chunks])
    return tokens, positions, np.cumsum([len(t) for t, _ in chunks])


def prefix_tokens_not_blocks(prompt, cached, block_size):
    best = 0
    for seq in cached:
        n = 0
        while n < min(len(prompt) - 1, len(seq)) and prompt[n] == seq[n]:
            n += 1
        best = max(best, n)
    return best


def prefix_blocks_compared_alone(prompt, cached, block_size):
    """Matches each block by its own tokens, wherever the prefix before it went."""
    blocks = {tuple(seq[i:i + block_size]) for seq in cached for i in range(0, len(seq) - block_size + 1, block_size)}
    n = 0
    while n + block_size <= len(prompt) - 1 and tuple(prompt[n:n + block_size]) in blocks:
        n += block_size
    return n


def prefix_reuses_the_last_token(prompt, cached, block_size):
    best = 0
    for seq in cached:
        n = 0
        while n < min(len(prompt), len(seq)) and prompt[n] == seq[n]:
            n += 1
        best = max(best, n // block_size * block_size)
    return best


def merge_without_the_new_max(m_a, l_a, acc_a, m_b, l_b, acc_b):
    """Un-shifts both parts to exp(s) itself: overflows once scores pass ~88 in float32."""
    with np.errstate(over="ignore", invalid="ignore"):
        w_a, w_b = np.exp(m_a), np.exp(m_b)
        l = l_a * w_a + l_b * w_b
        return np.maximum(m_a, m_b), l, acc_a * w_a[:, None] + acc_b * w_b[:, None]


def merge_nan_when_both_empty(m_a, l_a, acc_a, m_b, l_b, acc_b):
    m = np.maximum(m_a, m_b)
    with np.errstate(invalid="ignore"):
        w_a, w_b = np.exp(m_a - m), np.exp(m_b - m)
    return m, l_a * w_a + l_b * w_b, acc_a * w_a[:, None] + acc_b * w_b[:, None]


def merge_keeps_the_first_max(m_a, l_a, acc_a, m_b, l_b, acc_b):
    with np.errstate(invalid="ignore"):
        w_b = np.where(m_b == -np.inf, 0.0, np.exp(np.minimum(m_b - m_a, 80))).astype(np.float32)
    return m_a, l_a + l_b * w_b, acc_a + acc_b * w_b[:, None]


@pytest.mark.parametrize("number,wrong,failing_case,words", [
    (1, rmsnorm_without_eps, "tiny activations", "max abs error"),
    (1, rmsnorm_eps_outside_the_root, "eps goes inside the square root", "max abs error"),
    (1, layernorm_instead, "4 positions", "max abs error"),
    (2, kv_update_returns_copies, "decode: one position", "views"),
    (2, kv_update_not_in_place, "prefill", "in place"),
    (2, kv_update_off_by_one, "decode: one position", "outside the new positions"),
    (3, rope_adjacent_pairs, "prefill", "max abs error"),
    (3, rope_sign_flipped, "decode: one position", "max abs error"),
    (4, top_p_drops_the_crossing_token, "the token that crosses p", "carries the mass past p"),
    (4, top_p_in_place, "vocab 50", "in place"),
    (5, pool_strided, "8 heads -> 2", "consecutive"),
    (5, pool_summed, "3 KV heads -> 1", "instead of averaging"),
    (5, pool_rows_mixed, "6 heads -> 3", "max abs error"),
    (6, mla_without_causal_mask, "prefill", "causal mask"),
    (6, mla_without_scale, "decode", "scale"),
    (6, mla_w_uk_transposed, "square W_UK", "max abs error"),
    (7, window_one_too_wide, "prefill", "one too many"),
    (7, mask_queries_first, "decode", "LAST n_queries"),
    (7, mask_without_window, "a chunk", "may see keys 5..9"),
    (8, int8_scale_from_max_not_abs, "largest |w| is negative", "max(|w|)"),
    (8, int8_scale_per_column, "non-square", "one scale per row"),
    (8, int8_divides_by_128, "8 rows", "divides by 128"),
    (9, int4_nibbles_swapped, "one row of 32", "LOW 4 bits"),
    (9, int4_without_padding, "not a multiple of 64", "pad each row"),
    (9, int4_symmetric, "all weights positive", "mins differ"),
    (10, kv_int8_scale_per_head, "20x larger", "one scale per head"),
    (10, kv_int8_scale_per_channel, "prefill", "one scale per (KV head, position)"),
    (11, transfer_norms_at_weight_bytes, "SmolLM2", "gains stay fp32"),
    (11, transfer_tied_head_twice, "Llama-3.2-1B", "sent once"),
    (11, transfer_token_without_position, "Mistral", "the position goes up"),
    (12, block_sum_numpy_order, "Mistral's dim", "NumPy's own order"),
    (12, block_sum_contiguous_chunks, "SmolLM2's dim 576", "contiguous chunk"),
    (12, block_sum_warps_in_a_loop, "1024 threads", "warp 0 reduces them"),
    (12, block_sum_in_float64, "one warp", "float32"),
    (13, launches_without_the_embedding, "Mistral-7B, gemv v4, norms fused", "outside the layers"),
    (13, launches_v2_attention_as_one, "the first version", "each of the 32 layers launches 11"),
    (13, launches_ignoring_the_v3_limit, "16384-wide", "MAX_FUSED_NORM"),
    (14, int4_words_high_nibble_first, "which nibble is element 0", "LOW nibble"),
    (14, int4_words_keeps_padding, "in = 200", "has shape [3, 256], expected [3, 200]"),
    (15, fold_scales_rows, "rows or columns?", "scaled the rows"),
    (15, fold_divides, "SmolLM2's q_proj", "divided by the gain"),
    (15, fold_in_place, "square", "in place"),
    (16, gather_ignores_the_table, "a scattered table", "read the blocks the table names"),
    (16, gather_positions_first, "a table in order", "transpose"),
    (16, gather_whole_blocks, "the last block partly filled", "cut the gathered blocks"),
    (17, pack_positions_from_zero, "a decode step of 3", "continue from the chunk's `start`"),
    (17, pack_last_rows_past_the_end, "one prompt of 5", "one past each chunk's end"),
    (18, prefix_tokens_not_blocks, "a cached 40-token system prompt", "only whole blocks"),
    (18, prefix_blocks_compared_alone, "after a different block 1", "expected 16"),
    (18, prefix_reuses_the_last_token, "the prompt is a cached sequence", "last token must always be computed"),
    (19, sse_text_field_only, "chat: a role chunk first", "expected 'Hello there!'"),
    (19, sse_assumes_choices, "a usage chunk with no choices", "IndexError"),
    (19, sse_exact_done_line, "CRLF line endings", "JSONDecodeError"),
    (24, merge_without_the_new_max, "scores near 1000", "NaN"),
    (24, merge_nan_when_both_empty, "neither part saw a key", "NaN"),
    (24, merge_keeps_the_first_max, "part a's max is far above", "expected the larger of m_a and m_b"),
])
def test_subtly_wrong_exercise_fails_on_the_revealing_case(number, wrong, failing_case, words):
    report = check_exercise(number, wrong)
    assert not report.passed
    failed = {c.name: c.detail for c in report.failures}
    hits = [name for name in failed if failing_case in name]
    assert hits, f"expected a failing case named like {failing_case!r}:\n{report}"
    assert words in failed[hits[0]], str(report)
    assert report.note == ""        # a wrong answer is not "not written yet"


def test_exercise_shape_mistake_is_reported_with_shapes():
    report = check_exercise(1, lambda x, weight, eps: (x * weight)[:, :-1])
    assert "shape" in report.failures[0].detail and "expected [4, 64]" in report.failures[0].detail


def test_unknown_exercise_is_a_clear_error():
    from minillm.errors import MiniLLMError
    with pytest.raises(MiniLLMError, match="no exercise 99"):
        check_exercise(99)


# ---- every exercise has a reference solution and a wrong one (lessons/exercises/README.md) ------------

WRONG_DIR = Path(__file__).parent / "data" / "wrong_solutions"


@pytest.mark.parametrize("number", sorted(EXERCISES))
def test_reference_solution_passes_every_case(number):
    path = solution_path(number)
    assert path is not None, f"exercise {number} has no lessons/exercises/solutions/ex{number}_*.py"
    assert path.name == exercise_path(number).name            # the same file name as the stub it solves
    report = check_exercise(number, path, seed=20261206)        # the public cases and hidden ones
    if _no_gpu_for(number):
        return _assert_not_graded(report)
    hidden = hidden_cases(EXERCISES[number], 20261206)
    assert report.passed and len(report.cases) == len(EXERCISES[number].cases()) + len(hidden), str(report)


@pytest.mark.parametrize("number", sorted(EXERCISES))
def test_wrong_solution_fails_on_the_case_it_names(number):
    matches = sorted(WRONG_DIR.glob(f"ex{number}_*.py"))
    assert matches, f"exercise {number} has no tests/data/wrong_solutions/ex{number}_*.py"
    wrong = load_exercise(number, matches[0])
    report = check_exercise(number, wrong)
    if _no_gpu_for(number):
        return _assert_not_graded(report)
    failed = {c.name: c.detail for c in report.failures}
    hits = [name for name in failed if wrong.FAILS_CASE in name]
    assert not report.passed and report.note == "" and hits, f"expected {wrong.FAILS_CASE!r} to fail:\n{report}"
    assert wrong.SAYS in failed[hits[0]], str(report)
