"""What the speculative tests (CPU and GPU) share: greedy equality up to a near-tie of the plain run."""
from __future__ import annotations

import numpy as np


def assert_greedy_equal(model, prompt, plain, spec, near_tie: float, relative: bool = False):
    """spec == plain, or they part where the plain run's top two logits are within `near_tie` (of the
    largest logit's magnitude when `relative`): a verify over k rows rounds unlike a one-row decode."""
    if spec == plain:
        return
    i = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    logits = model.prefill(list(prompt) + plain[:i], model.new_cache(len(prompt) + i + 1))
    top2 = np.sort(logits)[-2:]
    bound = near_tie * np.abs(logits).max() if relative else near_tie
    assert top2[1] - top2[0] < bound, f"speculation changed token {i} where the plain run had no near-tie"
