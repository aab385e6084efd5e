"""Drafters: whatever proposes the next k tokens cheaply. One small interface:

    drafter.begin(prompt_ids, max_len, k)              a new sequence (allocate caches)
    drafter.propose(context, k, params, rng) -> (tokens [<= k], probs [n, vocab] or None)

`context` is the prompt plus every token emitted so far. `probs` are the distributions the tokens were
drawn from (after temperature / top-k / top-p, as the target's are filtered); None means the drafter is
deterministic (q is one-hot), which the acceptance rule handles without a table. A drafter may propose
fewer than k tokens, or none: the verify pass is then a plain decode step.

- NgramDrafter: prompt lookup (vLLM's "ngram", llama.cpp's lookup decoding). No model: find the latest
  earlier place where the context's last n tokens occurred and propose what followed them there. Free,
  and right whenever the answer copies its input (edit this code, repeat this passage, quote a document).
- ModelDrafter: a smaller model with the same tokenizer, the target quantized to int4 (`int4_drafter`),
  or the target's first N layers + final norm + head (`early_exit_drafter`, LayerSkip-style). It keeps
  its own KV cache and rolls it back to what the target accepted before drafting again.
"""
from __future__ import annotations

import copy
from typing import Protocol, Sequence

import numpy as np

from minillm.backend import as_f32
from minillm.engine.sampling import SamplingParams, next_token_distribution
from minillm.errors import MiniLLMError
from minillm.model.quant import QuantizedWeight, quantize_int4
from minillm.threads import for_rows


class Drafter(Protocol):
    name: str
    default_k: int                        # drafts a pass when the caller does not say

    def begin(self, prompt_ids: Sequence[int], max_len: int, k: int) -> None: ...

    def propose(self, context: Sequence[int], k: int, params: SamplingParams,
                rng: np.random.Generator) -> tuple[list[int], np.ndarray | None]: ...


class NgramDrafter:
    """Prompt lookup: the longest suffix of the context (max_n down to min_n tokens) that occurred before,
    latest occurrence first; propose the k tokens that followed it.

    Defaults as measured on SmolLM2's copy-heavy prompts (tools/data): a one-token match guesses wrong too
    often to pay for its verify rows, and since drafting is free, 8 drafts a pass beat 4 (lessons/BENCHMARKS.md,
    "Speculative decoding")."""
    default_k = 8

    def __init__(self, max_n: int = 4, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise MiniLLMError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n, self.name = max_n, min_n, "ngram"

    def begin(self, prompt_ids, max_len: int, k: int) -> None:
        pass

    def propose(self, context, k: int, params=None, rng=None) -> tuple[list[int], None]:
        ids = np.asarray(context, dtype=np.int64)                           # [L]
        L = len(ids)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(ids[:L - 1], n)   # [L - n, n]: ends before the suffix's end
            hits = np.flatnonzero((windows == ids[L - n:]).all(axis=1))     # starts of earlier occurrences
            if len(hits):
                start = int(hits[-1]) + n                                   # what followed the latest one
                return ids[start:start + k].tolist(), None
        return [], None


class ModelDrafter:
    """A model that drafts token by token over its own cache: another checkpoint, the int4 target, or
    the target's first `n_layers` layers (early exit)."""

    default_k = 4                         # each draft costs a draft forward: fewer than ngram's free ones

    def __init__(self, model, n_layers: int | None = None, name: str = "draft model",
                 vocab_size: int | None = None):
        """vocab_size: the target's (a draft with a padded vocabulary gets its q cut to the target's)."""
        self.model, self.n_layers, self.name = model, n_layers, name
        self.vocab_size = vocab_size or model.config.vocab_size
        self.cache, self.ids = None, []

    def begin(self, prompt_ids, max_len: int, k: int) -> None:
        self.cache = self.model.new_cache(max_len + k, spare=k)
        self.ids = []                                                       # the tokens the cache holds

    def propose(self, context, k: int, params: SamplingParams,
                rng: np.random.Generator) -> tuple[list[int], np.ndarray | None]:
        """Roll the cache back to what it shares with the context, run the rest, then draft k tokens."""
        context = list(context)
        common = _common_prefix(self.ids, context, len(context) - 1)        # the last token is always run
        self.cache.truncate(common)
        for_rows(len(context) - common)                                     # the whole prompt, the first time
        logits = self.model.prefill(context[common:], self.cache, n_layers=self.n_layers)   # [vocab]
        for_rows(1)
        tokens, probs = [], []
        for i in range(k):
            logits = logits[:self.vocab_size]
            if params.temperature == 0.0:
                token = int(np.argmax(logits))
            else:
                q = next_token_distribution(logits, params)                # [vocab], filtered as the target's p
                token = int(rng.choice(len(q), p=q))
                probs.append(q)
            tokens.append(token)
            if i + 1 < k:
                logits = self.model.decode(token, self.cache, n_layers=self.n_layers)
        self.ids = context + tokens[:-1]
        return tokens, (np.stack(probs) if probs else None)


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def early_exit_drafter(model, n_layers: int) -> ModelDrafter:
    """The target's first n_layers layers, then its final norm and head, as the draft (LayerSkip)."""
    if not 1 <= n_layers < model.config.n_layers:
        raise MiniLLMError(f"layers:N needs 1 <= N < {model.config.n_layers} (the target's layers), got {n_layers}")
    return ModelDrafter(model, n_layers=n_layers, name=f"layers:{n_layers}")


def int4_drafter(model, group_size: int = 128) -> ModelDrafter:
    """The target with every layer matrix and the LM head quantized to int4 (min-max groups: quick to
    build), the embedding and norms as they are: a draft without a second checkpoint."""
    if model.config.attention != "gqa" or any(layer.moe is not None for layer in model.layers):
        raise MiniLLMError("the int4 self-draft supports dense Llama-style (GQA) models; use ngram or a draft model")
    names = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    if any(isinstance(getattr(layer, n), QuantizedWeight) for layer in model.layers for n in names):
        raise MiniLLMError("the target is already quantized: it is its own cheap draft only in float; use ngram")
    draft = copy.copy(model)
    draft.layers = []
    for layer in model.layers:
        q = copy.copy(layer)
        for n in names:
            setattr(q, n, quantize_int4(as_f32(getattr(layer, n)), group_size))
        q.wqkv = q.w_gate_up = None                                         # the fused stacks stay float: unused
        draft.layers.append(q)
    draft.lm_head = quantize_int4(as_f32(model.lm_head), group_size)
    draft.attend = draft.attention_block                                    # bound to the copy, not the target
    return ModelDrafter(draft, name="int4")


def parse_speculative(spec: str) -> tuple[str, int | None]:
    """'ngram' | 'int4' | 'layers:N' | a model name or path -> (kind, N). kind 'model' for the rest."""
    spec = spec.strip()
    if spec in ("ngram", "int4"):
        return spec, None
    if spec.startswith("layers:"):
        try:
            return "layers", int(spec.split(":", 1)[1])
        except ValueError:
            raise MiniLLMError(f"--speculative layers:N needs a number of layers, got {spec!r}") from None
    if not spec:
        raise MiniLLMError("--speculative needs ngram, int4, layers:N or a draft model")
    return "model", None
