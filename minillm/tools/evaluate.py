"""Perplexity: how surprised a model is by real text, the quality number every compression is judged by.

    perplexity = exp(mean over scored tokens t of  -log p(token_t | the tokens before it))

A model that spreads its probability evenly over a vocabulary of V tokens scores exactly V; a model
that always puts probability 1 on the right token scores 1. Quantizing weights, pooling KV heads or
compressing the cache should move it as little as possible, so lessons report it before and after.

The text is cut into windows of `context` tokens and each window runs as one fresh prefill, so a
token is predicted from at most `context` - 1 earlier tokens (of its own window). Numbers are only
comparable at the same text, tokenizer and context length.
"""
from __future__ import annotations

import importlib
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from minillm.errors import MiniLLMError

DEFAULT_CHARS = 20_000      # `run_cli`'s slice of eval_text(): ~5k SmolLM2 tokens
DEFAULT_CONTEXT = 256


def eval_text(n_chars: int | None = None) -> str:
    """The first `n_chars` characters (all ~465k when None) of Python's help topics, as one text.

    The text is the standard library's `pydoc_data/topics.py` (the prose behind `help("with")`, ...):
    English technical writing that ships with every Python, so no download is needed. Its topics are
    joined in sorted key order with a blank line between them; the text starts with the "assert"
    statement. It differs slightly between Python versions: compare numbers within one version.
    """
    topics = importlib.import_module("pydoc_data.topics").topics        # {topic name: text}
    text = "\n\n".join(topics[name] for name in sorted(topics))
    return text if n_chars is None else text[:n_chars]


@dataclass
class PerplexityResult:
    ppl: float          # exp(nll_mean)
    nll_mean: float     # mean negative log-likelihood per scored token, in nats
    n_tokens: int       # tokens scored (each window's first token has no context and is not scored)
    seconds: float      # wall time of the forward passes

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.seconds if self.seconds > 0 else 0.0


def perplexity(llm, text: str, context: int = DEFAULT_CONTEXT, stride: int | None = None,
               max_tokens: int | None = None, progress: bool = False) -> PerplexityResult:
    """Perplexity of `llm` on `text`, over windows of `context` tokens.

    Tokens: `llm.prompt_ids(text, chat=False)`, i.e. the plain text with a BOS in front only where the
    tokenizer asks for one (SmolLM2 does not); `max_tokens` keeps the first that many.
    Windows: without `stride`, back to back and non-overlapping, each scoring its tokens 2..context
    (what HF's `model(window, labels=window).loss` averages). With `stride` < context, a window starts
    every `stride` tokens and scores only the tokens no earlier window scored, so each of them sees at
    least context - stride earlier tokens: slower (context / stride times the work), slightly lower.
    """
    stride = stride or context
    if context < 2 or not 0 < stride <= context:
        raise MiniLLMError(f"need context >= 2 and 0 < stride <= context (got context={context}, stride={stride})")
    if context > llm.config.max_seq_len:              # said before the progress bar starts, in one line
        raise MiniLLMError(f"windows of {context} tokens exceed this model's context of {llm.config.max_seq_len}: "
                           f"lower --context")
    ids = llm.prompt_ids(text, chat=False)[:max_tokens]
    if len(ids) < 2:
        raise MiniLLMError(f"the text is {len(ids)} token(s); perplexity needs at least 2")
    windows = list(_windows(len(ids), context, stride))
    bar = tqdm(total=sum(end - first for _, first, end in windows), unit="tok", desc="perplexity",
               disable=not progress, file=sys.stderr)
    nll_sum, n_scored = 0.0, 0
    start_time = time.perf_counter()
    for start, first, end in windows:
        logits = llm.logits(ids[start:end])                                 # [end - start, vocab]
        rows = logits[first - 1 - start:end - 1 - start].astype(np.float64)  # predictions of ids[first:end]
        targets = np.asarray(ids[first:end])                                # [n]
        # log-softmax in float64: a sum over ~50k exponentials per row loses digits in float32.
        peak = rows.max(axis=1, keepdims=True)
        log_z = peak[:, 0] + np.log(np.exp(rows - peak).sum(axis=1))       # [n]
        nll_sum += float((log_z - rows[np.arange(len(targets)), targets]).sum())
        n_scored += len(targets)
        bar.update(len(targets))
    seconds = time.perf_counter() - start_time
    bar.close()
    nll_mean = nll_sum / n_scored
    return PerplexityResult(math.exp(nll_mean), nll_mean, n_scored, seconds)


def _windows(n: int, context: int, stride: int):
    """(start, first scored, end) of each window over n tokens; every token 1..n-1 is scored once."""
    scored_to = 1                                  # token 0 has nothing before it
    for start in range(0, n - 1, stride):
        end = min(start + context, n)
        first = max(scored_to, start + 1)          # a window cannot score its own first token
        if first < end:
            yield start, first, end
            scored_to = end
        if end == n:
            return


def run_cli(model: str, text_file: str | Path | None = None, n_chars: int | None = None,
            context: int = DEFAULT_CONTEXT, quant: str | None = None, dtype: str | None = None,
            baseline: bool = True, group_size: int | None = None, kv_cache: str | None = None) -> str:
    """`minillm eval perplexity`: load `model`, measure, and return the lines to print.

    Text: `text_file` (its first `n_chars` characters, all when None) or eval_text(n_chars or
    DEFAULT_CHARS). A progress bar goes to stderr. quant, dtype, group_size and kv_cache go to
    `minillm.load`; when any of them changes the model from how it is stored and `baseline` is set,
    the model as stored is measured too, on the same tokens, with the change in %.
    """
    import minillm

    if text_file is not None:
        path = Path(text_file)
        if not path.is_file():
            raise MiniLLMError(f"{path}: text file not found")
        try:
            text = path.read_text(encoding="utf-8")[:n_chars]
        except UnicodeDecodeError as e:
            raise MiniLLMError(f"{path}: not a UTF-8 text file (byte {e.start}: {e.reason})") from None
        source = f"{path} ({len(text)} chars)"
    else:
        text = eval_text(n_chars or DEFAULT_CHARS)
        source = (f"Python {sys.version_info.major}.{sys.version_info.minor} help topics "
                  f"(first {len(text)} chars)")
    options = {k: v for k, v in dict(dtype=dtype, quant=quant, group_size=group_size,
                                     kv_cache=kv_cache).items() if v is not None}
    llm = minillm.load(model, **options)
    result = perplexity(llm, text, context=context, progress=True)
    variant = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in options.items())
    lines = [
        f"model       {model}" + (f" ({variant})" if variant else ""),
        f"text        {source}",
        f"perplexity  {result.ppl:.3f}   (mean NLL {result.nll_mean:.4f} nats/token)",
        f"tokens      {result.n_tokens} scored, windows of {context}",
        f"seconds     {result.seconds:.1f}   ({result.tokens_per_s:.0f} tokens/s)",
    ]
    stored = llm.config.torch_dtype
    changed = quant is not None or dtype not in (None, stored) or kv_cache not in (None, "auto", "float32")
    if baseline and changed:
        ref = perplexity(minillm.load(model), text, context=context, progress=True)
        delta = 100.0 * (result.ppl / ref.ppl - 1.0)
        lines.append(f"baseline    {ref.ppl:.3f} as stored ({stored}): {delta:+.2f}%")
    return "\n".join(lines)
