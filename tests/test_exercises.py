"""The exercise grader: the engine's solution passes, an unwritten exercise fails kindly, and a
subtly wrong solution fails on the case that exposes it."""
import numpy as np
import pytest

from minillm import course
from minillm.course import EXERCISES, check_exercise, load_exercise


@pytest.mark.parametrize("number", sorted(EXERCISES))
def test_exercise_filled_with_the_engine_solution_passes(number, monkeypatch):
    student = load_exercise(number)
    monkeypatch.setattr(student, EXERCISES[number].function, EXERCISES[number].reference)
    report = check_exercise(number, student)
    assert report.passed, str(report)
    assert len(report.cases) >= 4


@pytest.mark.parametrize("number", sorted(EXERCISES))
def test_unfilled_exercise_fails_with_a_friendly_message(number):
    report = check_exercise(number)            # the file as shipped: `raise NotImplementedError`
    assert not report.passed
    assert "not written yet" in report.note and EXERCISES[number].function in report.note
    assert f"ex{number:02d}_" in str(report) and "FAILED" in str(report)


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
    from minillm.sampling import top_p_filter
    logits[:] = top_p_filter(logits, p)
    return logits


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
