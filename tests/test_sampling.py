"""Sampling filters agree with HF transformers' logits warpers; seeded sampling is reproducible."""
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from minillm.engine.sampling import (Sampler, SamplingParams, next_token_distribution, top_k_filter,
                              top_p_filter)


def _hf(warpers, logits):
    scores = torch.tensor(logits, dtype=torch.float64)[None]
    for w in warpers:
        scores = w(None, scores)
    return torch.softmax(scores, -1)[0].numpy()


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, None, None), (0.7, None, None), (1.0, 5, None), (1.0, None, 0.9),
    (0.8, 40, 0.95), (1.3, 3, 0.5), (1.0, None, 0.01), (1.0, 1, None), (1.0, None, 1.0)])
def test_distribution_matches_hf_warpers(seed, temperature, top_k, top_p):
    logits = np.random.default_rng(seed).normal(0, 3, 200).astype(np.float32)
    ours = next_token_distribution(logits, SamplingParams(temperature, top_k, top_p))
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k is not None:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    np.testing.assert_allclose(ours, _hf(warpers, logits), atol=1e-9)


def test_top_k_keeps_exactly_k():
    logits = np.arange(10, dtype=np.float32)
    kept = np.isfinite(top_k_filter(logits, 3))
    assert kept.tolist() == [False] * 7 + [True] * 3


def test_top_p_always_keeps_the_most_likely_token():
    logits = np.array([5.0, 1.0, 0.0, -1.0], dtype=np.float32)
    assert np.isfinite(top_p_filter(logits, 1e-6)).tolist() == [True, False, False, False]


def test_greedy_is_argmax_and_seeded_sampling_repeats():
    logits = np.random.default_rng(0).normal(size=50).astype(np.float32)
    assert Sampler(SamplingParams(0.0))(logits) == int(np.argmax(logits))
    a = Sampler(SamplingParams(1.0, seed=7)); b = Sampler(SamplingParams(1.0, seed=7))
    assert [a(logits) for _ in range(20)] == [b(logits) for _ in range(20)]


def test_sampling_frequencies_follow_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.2], dtype=np.float32))
    s = Sampler(SamplingParams(1.0, seed=0))
    counts = np.bincount([s(logits) for _ in range(6000)], minlength=3) / 6000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.2], atol=0.03)


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=0)])
def test_bad_values_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_inverse_cdf_pick_picks_what_rng_choice_picks_for_the_same_uniform():
    """The sampler's fast path (two-level CDF, float32 exponentials) against rng.choice over the float64
    distribution, drawing the same uniforms: the same token every time, -inf (filtered) tokens never, and u
    at the very ends of [0, 1) still lands on a real token."""
    from minillm.engine.sampling import inverse_cdf_pick, next_token_distribution
    rng = np.random.default_rng(3)
    for vocab, temperature in ((32000, 0.8), (1000, 1.3), (300, 0.5)):     # 300: a ragged last chunk
        logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
        logits[rng.choice(vocab, vocab // 3, replace=False)] = -np.inf
        p = next_token_distribution(logits, SamplingParams(temperature))
        a, b = np.random.default_rng(9), np.random.default_rng(9)
        picks = [inverse_cdf_pick(logits, temperature, b.random()) for _ in range(500)]
        assert picks == [int(a.choice(vocab, p=p)) for _ in range(500)]
        for u in (0.0, np.nextafter(1.0, 0.0)):
            assert np.isfinite(logits[inverse_cdf_pick(logits, temperature, u)])
