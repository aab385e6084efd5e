"""Exercise 20.2, a behaviour exercise: the loop of greedy speculative decoding, with the cache rollback.

Each step the grader's drafter proposes k tokens and the grader runs the target's verify pass on its own
model and KV cache (the engine's Transformer and KVCache: the last committed token and the k drafts,
k + 1 positions written). The student's `speculative_decode_step(state)` sees the drafts and the target's
argmax at each verified position, and answers which tokens to emit and how many cache positions to keep;
the grader rolls its cache back to that length (KVCache.truncate) and checks, every step, that the
tokens are greedy decoding's and that the cache holds exactly the committed positions."""
from __future__ import annotations

import numpy as np

from minillm.course.behaviour import replay
from minillm.course.cases import Case, CaseFailed, case_rng


def speculative_decode_step_reference(state: dict) -> dict:
    """engine/speculative/acceptance.accept_draft at temperature 0, with the rollback the engine's
    speculative loop (engine/speculative/) makes: keep the accepted drafts' positions, drop the rest."""
    draft, best = state["draft"], state["target_argmax"]
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
    return {"emit": list(draft[:n]) + [best[n]], "cache_length": state["cache_length"] - (len(draft) - n)}


def _tiny_model(seed: int):
    """A small random Llama (the engine's Transformer): greedy decoding on it is the reference."""
    from minillm.model.config import ModelConfig
    from minillm.tools.bench import random_model
    config = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=256)
    return random_model(config, seed)


class SpeculativeWorld:
    """The grader's side: the target model, its KV cache, a drafter that is right with probability
    `hit` (otherwise a wrong token), and the greedy output to match."""

    def __init__(self, prompt: list[int], max_tokens: int, k: int, hit: float, seed: int):
        self.model, self.k, self.max_tokens = _tiny_model(seed), k, max_tokens
        self.rng = np.random.default_rng(seed)
        self.hit = hit
        self.greedy = self._greedy(prompt, max_tokens + k + 1)
        self.prompt, self.output = list(prompt), []
        self.cache = self.model.new_cache(len(prompt) + max_tokens + k + 2)
        first = int(np.argmax(self.model.prefill(prompt, self.cache)))   # the prompt's own next token
        self.output.append(first)
        self.steps = self.accepted = self.drafted = 0
        self._verify()

    def _greedy(self, prompt, n) -> list[int]:
        cache = self.model.new_cache(len(prompt) + n + 1)
        tokens = [int(np.argmax(self.model.prefill(prompt, cache)))]
        while len(tokens) < n:
            tokens.append(int(np.argmax(self.model.decode(tokens[-1], cache))))
        return tokens

    def _verify(self) -> None:
        """Draft k tokens, run the target over [last committed] + drafts (k + 1 new cache positions)."""
        at = len(self.output)
        truth = self.greedy[at:at + self.k]
        self.draft = [t if self.rng.random() < self.hit else (t + 1 + int(self.rng.integers(63))) % 64 for t in truth]
        logits = self.model.forward(np.array([self.output[-1]] + self.draft), self.cache)   # [k + 1, vocab]
        self.best = [int(t) for t in np.argmax(logits, axis=-1)]

    def observe(self) -> dict:
        return {"draft": self.draft, "target_argmax": self.best, "cache_length": self.cache.length}

    def apply(self, decision) -> None:
        self.steps += 1
        emit = [int(t) for t in decision["emit"]]
        keep = int(decision["cache_length"])
        if not 1 <= len(emit) <= self.k + 1:
            raise CaseFailed(f"emits {len(emit)} tokens; a verify pass of {self.k} drafts gives 1 to {self.k + 1}")
        for t in emit:
            want = self.greedy[len(self.output)]
            if t != want:
                raise CaseFailed(f"emits {t} as output token {len(self.output)}; greedy decoding gives {want}")
            self.output.append(t)
        committed = len(self.prompt) + len(self.output) - 1      # the newest token is fed next step
        if keep != committed:
            raise CaseFailed(f"keeps {keep} cache positions; the committed tokens need {committed} (the prompt "
                             f"and the output but its newest token, which the next pass feeds)")
        self.cache.truncate(keep)                                # the engine's rollback: rejected drafts zeroed
        self.drafted += self.k
        self.accepted += len(emit) - 1
        if not self.done():
            self._verify()

    def done(self) -> bool:
        return len(self.output) >= self.max_tokens

    def verdict(self) -> str:
        return (f"{len(self.output)} tokens equal to greedy decoding in {self.steps} verify passes "
                f"({self.accepted} of {self.drafted} drafts accepted); the cache rolled back every step")


def _loop_cases() -> list[Case]:
    rng = case_rng(20, 2)

    def case(name, k, hit, n=16):
        prompt = [int(t) for t in rng.integers(0, 64, int(rng.integers(3, 8)))]
        return Case(name, dict(prompt=prompt, max_tokens=n, k=k, hit=hit, seed=int(rng.integers(1 << 30))))
    return [case("a perfect drafter: every draft accepted, plus the bonus token", 4, 1.0),
            case("a drafter right half the time: rollbacks of different lengths", 4, 0.5),
            case("a drafter always wrong: one token per pass, every draft rolled back", 3, 0.0),
            case("one draft a pass", 1, 0.7),
            case("long drafts (k = 8), mostly right", 8, 0.85, n=24)]


def _check_loop(fn, case: Case) -> str:
    return replay(fn, SpeculativeWorld(**case.inputs))
