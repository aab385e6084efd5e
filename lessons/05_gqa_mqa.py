"""Lesson 05 — MHA -> GQA -> MQA: fewer KV heads, a smaller cache, and what it costs in quality, measured.

Lesson 02 priced the KV cache at 2 × layers × n_kv_heads × head_dim values per token. The only
factor a model's designer can cut without touching the rest is n_kv_heads: multi-head attention
(MHA) gives every query head its own K and V, grouped-query attention (GQA) lets a group of query
heads share one, multi-query attention (MQA) keeps a single K and V for all. SmolLM2 is GQA (9 query
heads, 3 KV heads). We build its exact MHA twin (copy each KV head to its 3 query heads), and its
MQA version by mean-pooling the 3 KV heads into one (`minillm.checkpoints.kv_heads.convert_kv_heads`, the GQA
paper's recipe), then measure each: cache bytes, perplexity on real text, decode speed.

Run: python lessons/05_gqa_mqa.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 02 (KV bytes per token)",
        "lesson 03 (decode reads bytes)",
    ],
    "objectives": [
        "build MHA and MQA twins of a GQA model and measure cache size against perplexity",
        "time decode at long context with the variants taking turns, median and range",
        "see why pooling KV heads without uptraining breaks a model",
    ],
    "study_time": "45 min, plus 20 min for exercise 05 (pooling KV heads)",
    "check_questions": [
        "Why is GQA exactly MHA with tied heads, and what does that cost in cache?",
        "At which context length does the number of KV heads start to matter for decode time, and why?",
    ],
    "try_this": [
        "time at 16k context (edit `contexts`) and watch the gap between MHA and MQA grow",
        "compare the 7B table's users in 60 GB with `minillm plan -m llama-2-7b`",
    ],
}
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm import PRESETS
from minillm.model.config import ModelConfig
from minillm.course import hf_tensors, lesson_model, print_table, quick, save_plot
from minillm.course.measure import Spread, faster, interleaved, load_average, load_line
from minillm.tools.evaluate import eval_text, perplexity
from minillm.checkpoints.kv_heads import convert_kv_heads
from minillm.llm import LLM
from minillm.model.transformer import Transformer


# NEW: more KV heads (exact), fewer KV heads (pooled) ------------------------------------------------
def repeat_kv_heads(config: ModelConfig, tensors: dict, n_kv_heads: int) -> tuple[ModelConfig, dict]:
    """GQA -> more KV heads by copying: KV head g becomes heads g·k .. g·k + k-1 (k = n_kv_heads / old).

    Query head h read KV head h // (n_heads // old); now it reads a copy of the same head, so the model
    computes exactly what it did, with k times the cache. GQA is MHA whose heads were tied.
    """
    copies = n_kv_heads // config.n_kv_heads
    out = dict(tensors)
    for i in range(config.n_layers):
        for name in ("k_proj", "v_proj"):
            key = f"model.layers.{i}.self_attn.{name}.weight"
            w = tensors[key].reshape(config.n_kv_heads, 1, config.head_dim, -1)          # [n_kv, 1, hd, dim]
            out[key] = np.repeat(w, copies, axis=1).reshape(n_kv_heads * config.head_dim, -1)  # [n_new * hd, dim]
    return config.replace(n_kv_heads=n_kv_heads), out


def variants(llm) -> dict[str, LLM]:
    """MHA (exact copy), GQA (as trained) and MQA (mean-pooled) versions of the same weights."""
    config, tensors = llm.config, hf_tensors(llm.model)
    made = {f"MHA-{config.n_heads} (KV heads copied)": repeat_kv_heads(config, tensors, config.n_heads),
            f"GQA-{config.n_kv_heads} (as trained)": (config, tensors),
            "MQA-1 (KV heads mean-pooled)": convert_kv_heads(config, tensors, 1)}
    return {name: LLM(c, Transformer(c, t), llm.tokenizer, name=name) for name, (c, t) in made.items()}
# ---------------------------------------------------------------------------------------------------


def decode_times(models: dict[str, LLM], context: int, rounds: int) -> dict[str, Spread]:
    """Seconds of one decode step of each model with `context` cached positions, over `rounds` rounds.
    Speed does not depend on the cached values, so we write ones instead of running a long prefill
    (writing makes the pages real). The models take turns (course/measure.py), so a burst of other work
    on the machine hits them all alike."""
    caches = {name: m.model.new_cache(context + 1) for name, m in models.items()}
    for cache in caches.values():
        cache.k.fill(1.0)
        cache.v.fill(1.0)

    def step(name):
        caches[name].length = context
        models[name].model.decode(1, caches[name])
    return interleaved({name: functools.partial(step, name) for name in models}, rounds)


def main():
    small = quick()
    llm = lesson_model()
    models = variants(llm)
    text = eval_text(400 if small else 3000)
    context, n_tokens = (32, 64) if small else (128, 384)
    ids = llm.prompt_ids(text, chat=False)[:context]
    reference = llm.logits(ids)                                                    # [context, vocab]
    contexts = [64] if small else [256, 4096]
    next(iter(models.values())).model.decode(1, next(iter(models.values())).model.new_cache(2))   # warm up

    rows, ppls = [], {}
    for name, m in models.items():
        c = m.config
        result = perplexity(m, text, context=context, max_tokens=n_tokens)
        logits = m.logits(ids)
        ppls[name] = result.ppl
        rows.append([name, c.n_kv_heads, f"{c.kv_bytes_per_token(2):,}",
                     f"{c.kv_bytes_per_token(2) / llm.config.kv_bytes_per_token(2):.0%}",
                     f"{c.kv_bytes_per_token(2) * c.max_seq_len / 2**20:,.0f}",
                     f"{result.ppl:.2f}", f"{np.abs(logits - reference).max():.2g}",
                     f"{np.mean(logits.argmax(-1) == reference.argmax(-1)):.0%}"])
    load_start = load_average()
    rounds = 1 if small else 5
    times = {n: decode_times(models, n, rounds) for n in contexts}           # {context: {model: Spread}}
    speed = [[name] + [times[n][name].ms() for n in contexts] + [
             times[contexts[-1]][name].rate(), f"{m.config.kv_bytes_per_token(4) * contexts[-1] / 1e6:.0f}"]
             for name, m in models.items()]

    # The same trade on a model that was trained with full MHA: Llama-2-7B's 32 KV heads.
    presets = []
    llama2 = PRESETS["llama-2-7b"].config
    for n_kv in (32, 8, 4, 1):
        c = llama2.replace(n_kv_heads=n_kv)
        presets.append([f"llama-2-7b as {'MHA' if n_kv == 32 else 'MQA' if n_kv == 1 else 'GQA'}-{n_kv}", n_kv,
                        f"{c.kv_bytes_per_token(2):,}", f"{c.kv_bytes_per_token(2) * 4096 / 2**30:.2f}",
                        f"{int(60e9 // (c.kv_bytes_per_token(2) * 4096)):,}"])

    print_table(f"Lesson 05 — KV heads: cache size against quality ({result.n_tokens} tokens of eval_text, "
                f"windows of {context})",
                ["model", "KV heads", "bytes/token fp16", "vs GQA", f"MiB at {llm.config.max_seq_len:,} tokens",
                 "perplexity", f"max |Δ logit| ({context} tok)", "top-1 agree"], rows)
    print(f"MHA computes exactly what GQA does (GQA is MHA with tied heads) at {llm.config.n_heads // llm.config.n_kv_heads}x "
          "the cache. Pooling to one KV head "
          "without retraining loses most of the model: the GQA paper recovers it with ~5% of pre-training "
          "compute (\"uptraining\"), which this lesson does not do.")
    print_table(f"decode speed: ms per token with the cache at each context (the rest of the model is the same; "
                f"median (min-max) of {rounds} interleaved rounds)",
                ["model"] + [f"ms at {n:,}" for n in contexts] + [f"tok/s at {contexts[-1]:,}",
                                                                  f"KV MB read at {contexts[-1]:,} (fp32)"], speed)
    print(load_line(load_start))
    longest = times[contexts[-1]]
    mha, gqa, mqa = list(models)
    faster(longest, gqa, mha, f"at {contexts[-1]:,} positions GQA decodes faster than MHA (a third of the cache to read)")
    faster(longest, mqa, gqa, f"at {contexts[-1]:,} positions MQA decodes faster than GQA (a third again)")
    print_table("the same trade at 7B scale: Llama-2-7B (trained as MHA) with fewer KV heads, fp16",
                ["model", "KV heads", "bytes/token", "GiB per 4096-token user", "users in 60 GB of KV"], presets)

    def draw(ax):
        sizes = [int(r[2].replace(",", "")) for r in rows]
        ax.plot(sizes, list(ppls.values()), "o")
        for size, (name, ppl) in zip(sizes, ppls.items()):
            ax.annotate(name.split(" ")[0], (size, ppl), textcoords="offset points", xytext=(5, 5))
        ax.set_xscale("log"), ax.set_yscale("log")
        ax.set_xlabel("KV cache bytes per token (fp16)"), ax.set_ylabel("perplexity")
        ax.set_title("Lesson 05: fewer KV heads, smaller cache; pooling without uptraining costs quality")
        ax.grid(alpha=0.3)
    save_plot("05_kv_heads.png", draw)


if __name__ == "__main__":
    main()
