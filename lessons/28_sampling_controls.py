"""Lesson 28 — sampling controls: penalties, logit bias and min-p on a real distribution, and what logprobs report.

Lesson 04 reshaped the next-token distribution with temperature, top-k and top-p. The API an application
calls has more knobs, and the engine applies them in one order (engine/sampling.py), each measured here on
SmolLM2's distribution after a prompt that repeats itself:

1. logit_bias           a number added to chosen tokens' logits (-100 bans a token)            # NEW
2. repetition_penalty   every token seen in the prompt or the answer: l / r if l > 0 else l * r  # NEW
3. presence_penalty,    subtracted from tokens the ANSWER holds: once, and once per occurrence  # NEW
   frequency_penalty
4. (a token mask: lesson 27)   5. temperature   6. top-k   7. top-p   8. min-p                   # NEW: min-p
Then min-p against top-p on a confident and on a flat distribution, the penalties on a greedy answer that
loops, and logprobs: the log-softmax of the RAW logits, before any of the steps above (vLLM's default), so
they say what the model thought, not what the controls made of it. Last, parallel sampling (OpenAI's `n`):
n continuations of one prompt, prefilled once, its KV blocks shared copy-on-write, against n separate requests.

Run: python lessons/28_sampling_controls.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 04 (sampling: temperature, top-k, top-p)",
        "lesson 19 (serving: the OpenAI API)",
    ],
    "objectives": [
        "say what each control does to the next-token distribution, and in which order they apply",
        "tell the penalties apart: which tokens each touches (prompt or answer) and how much",
        "choose min-p or top-p, and read logprobs correctly (raw model, not the controlled draw)",
        "run n continuations of one prompt on one prefill, its KV blocks shared copy-on-write",
    ],
    "study_time": "40 min, plus 20 min for exercise 28 (the repetition penalty)",
    "check_questions": [
        "A token appeared 3 times in the answer: what do presence 0.5 and frequency 0.5 subtract from its logit?",
        "Why does the repetition penalty multiply a negative logit instead of dividing it?",
        "When does min-p 0.1 keep more tokens than top-p 0.9, and when fewer? And with logit_bias -100 on the "
        "model's favourite token, what does its logprob say?",
    ],
    "try_this": [
        "minillm generate \"List: apple, banana, apple,\" --no-chat --repetition-penalty 1.3 --logprobs 3",
        "minillm generate \"Once upon a time\" -t 1.5 --min-p 0.1 --seed 0",
    ],
}
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.course import lesson_model, print_table, quick, save_plot
from minillm.engine.sampling import SamplingParams, TokenHistory, log_softmax, next_token_distribution, \
    processed_logits

PROMPT = "Fruits I like:"                                     # the prompt: the repetition penalty's only
ANSWER = " apple, banana, apple, banana, apple,"              # as if generated: what presence/frequency count

# NEW: the controls we compare, as the engine's SamplingParams (temperature 1: the model's own distribution)
SETTINGS = {
    "none":                       SamplingParams(temperature=1.0),
    "repetition_penalty 1.3":     SamplingParams(temperature=1.0, repetition_penalty=1.3),
    "presence_penalty 1.0":       SamplingParams(temperature=1.0, presence_penalty=1.0),
    "frequency_penalty 1.0":      SamplingParams(temperature=1.0, frequency_penalty=1.0),
    "logit_bias ' banana' -100":  None,                       # filled in main(): needs the token's id
    "min_p 0.1":                  SamplingParams(temperature=1.0, min_p=0.1),
    "top_p 0.9 (lesson 04)":      SamplingParams(temperature=1.0, top_p=0.9),
}


def entropy_bits(probs: np.ndarray) -> float:
    p = probs[probs > 0]
    return max(0.0, float(-(p * np.log2(p)).sum()))


def controlled(logits: np.ndarray, params: SamplingParams, prompt_ids, answer_ids) -> np.ndarray:
    """The distribution a draw comes from under `params`: steps 1-3 (they need the history), then 5-8."""
    history = TokenHistory(prompt_ids)
    for token in answer_ids:
        history.append(token)
    return next_token_distribution(processed_logits(logits, params, history), params)     # [vocab]


def kept(probs: np.ndarray) -> int:
    return int((probs > 0).sum())


def distinct_share(ids: list[int]) -> float:
    """Distinct tokens / tokens: 1.0 never repeats, a loop drives it down."""
    return len(set(ids)) / max(1, len(ids))


# NEW: parallel sampling (OpenAI's n): n continuations of one prompt, its KV blocks shared copy-on-write
def parallel_sampling(llm, n: int = 4) -> None:
    """n choices of one prompt, prefilled once: the other choices fork from the first, each block's reference
    count +1 per choice, and a shared block is copied on a choice's first write into it (only the prompt's
    partly filled last block ever is; engine/choices.py). Then KV blocks and time against n separate requests."""
    from minillm.engine.engine import Engine
    from minillm.tools.choices_bench import run_mode
    prompt = llm.prompt_ids("Once upon a time, in a village by the sea, there lived an old fisherman who",
                            chat=False)
    engine = Engine(llm, prefix_caching=False)
    rids = engine.add_choices(prompt, n, max_tokens=3, temperature=1.0, seed=0)
    seqs = [engine.requests[rid].seq for rid in rids]

    def tables(when: str) -> None:
        rows = [[f"choice {i}", " ".join(str(b) for b in s.block_table),
                 " ".join(str(engine.blocks.refcount[b]) for b in s.block_table)] for i, s in enumerate(seqs)]
        print_table(f"{when}: {engine.blocks.num_used} blocks in use", ["", "block table", "refcounts"], rows)

    engine.step()                  # one prefill (choice 0's); the others fork and sample from the same logits
    tables(f"after the prefill of {len(prompt)} prompt tokens (blocks of {engine.pool.block_size})")
    engine.step()                  # each writes its first token's keys into the shared, partly filled last block
    tables(f"after one decode step, (from, to) blocks copied: {engine.scheduler.copies}")
    while engine.has_unfinished():
        engine.step()

    new = 4 if quick() else 16
    rows = []
    for name, k, shared in [("one request", 1, True), (f"{n} choices, prompt shared", n, True),
                            (f"{n} separate requests", n, False)]:
        seconds, blocks, _ = run_mode(llm, prompt, k, new, shared, seed=0)
        rows.append([name, k, f"{seconds:.2f}", blocks])
    print_table(f"{new} tokens each, temperature 1: wall time and KV blocks at the peak",
                ["", "sequences", "seconds", "KV blocks"], rows)
    print("(one round, so noisy: `minillm bench choices` takes the median of interleaved rounds, lessons/BENCHMARKS.md)")


def main():
    llm = lesson_model()
    tok = llm.tokenizer
    prompt_ids = llm.prompt_ids(PROMPT, chat=False)
    answer_ids = tok.encode(ANSWER)
    logits = llm.logits(prompt_ids + answer_ids)[-1]                     # [vocab] after the whole text
    apple, banana = tok.encode(" apple")[0], tok.encode(" banana")[0]
    SETTINGS["logit_bias ' banana' -100"] = SamplingParams(temperature=1.0, logit_bias={banana: -100.0})
    print(f"\ntext {PROMPT + ANSWER!r}: the prompt is {len(prompt_ids)} tokens, the answer so far "
          f"{len(answer_ids)} (' apple' x{answer_ids.count(apple)}, ' banana' x{answer_ids.count(banana)})")

    # 1. each control on the same distribution
    rows, dists = [], {}
    for name, params in SETTINGS.items():
        probs = controlled(logits, params, prompt_ids, answer_ids)
        dists[name] = probs
        top = np.argsort(-probs)[:3]
        rows.append([name, f"{kept(probs):,}", f"{entropy_bits(probs):.2f}", f"{probs[banana]:.3f}",
                     f"{probs[apple]:.3f}", ", ".join(f"{tok.decode([int(t)])!r} {probs[t]:.2f}" for t in top)])
    print_table("Lesson 28 — what each control does to the next-token distribution",
                ["control", "tokens kept", "entropy bits", "P(' banana')", "P(' apple')", "top 3"], rows)

    # the penalties by hand, on the two tokens: the formulas of engine/sampling.py's docstring
    raw = {t: float(logits[t]) for t in (apple, banana)}
    counts = {t: answer_ids.count(t) for t in (apple, banana)}
    hand = [[tok.decode([t]), f"{raw[t]:.3f}", f"{raw[t] / 1.3 if raw[t] > 0 else raw[t] * 1.3:.3f}",
             f"{raw[t] - 1.0:.3f}", f"{raw[t] - 1.0 * counts[t]:.3f}"] for t in (apple, banana)]
    print_table("the logits of the repeated tokens, by each penalty's formula",
                ["token", "raw logit", "repetition 1.3", "presence 1.0 (once)", "frequency 1.0 (x count)"], hand)

    # 2. min-p against top-p: the cut follows the model's confidence, not the mass
    cases = {"confident: 'The capital of France is'": "The capital of France is",
             "flat: 'Once upon a time, there was a'": "Once upon a time, there was a"}
    cut_rows = []
    for name, text in cases.items():
        row_logits = llm.logits(llm.prompt_ids(text, chat=False))[-1]
        p = next_token_distribution(row_logits, SamplingParams(temperature=1.0))
        cut_rows.append([name, f"{p.max():.2f}"] + [
            f"{kept(next_token_distribution(row_logits, SamplingParams(**{'temperature': 1.0, **k}))):,}"
            for k in (dict(top_p=0.9), dict(min_p=0.1), dict(min_p=0.05), dict(temperature=1.5, min_p=0.1))])
    print_table("tokens each filter keeps", ["distribution", "top-1 prob", "top_p 0.9", "min_p 0.1", "min_p 0.05",
                                             "T 1.5 + min_p 0.1"], cut_rows)

    # 3. the penalties on a greedy answer that loops
    n_new = 16 if quick() else 40
    loop_prompt = "Repeat after me: I like apples. I like apples. I like apples."
    gen_rows = []
    for name, controls in {"greedy": {}, "repetition_penalty 1.3": dict(repetition_penalty=1.3),
                           "frequency_penalty 0.5": dict(frequency_penalty=0.5),
                           "presence_penalty 1.0": dict(presence_penalty=1.0)}.items():
        g = llm.generate(loop_prompt, max_tokens=n_new, chat=False, **controls)
        gen_rows.append([name, f"{distinct_share(g.token_ids):.2f}", repr(g.text)[:64]])
    print_table(f"{n_new} greedy tokens after a repetitive prompt", ["controls", "distinct / tokens", "text"],
                gen_rows)

    # 4. logprobs: the raw model's, whatever the controls did to the pick
    favourite = int(np.argmax(logits))
    g = llm.generate(PROMPT + ANSWER, max_tokens=4, chat=False, logprobs=3, logit_bias={favourite: -100.0})
    first = g.logprobs[0]
    raw_logp = log_softmax(logits)
    lp_rows = [[i, repr(tok.decode([e.token])), f"{e.logprob:.3f}", f"{np.exp(e.logprob):.3f}",
                ", ".join(f"{tok.decode([t])!r} {lp:.2f}" for t, lp in e.top)] for i, e in enumerate(g.logprobs)]
    print_table(f"logprobs=3 with logit_bias {{{tok.decode([favourite])!r}: -100}} (the favourite banned)",
                ["position", "token", "logprob", "prob", "top 3 (raw)"], lp_rows)
    print(f"position 0: the banned {tok.decode([favourite])!r} is still the reported top-1 "
          f"({first.top[0][1]:.3f} = log-softmax of the raw logits {raw_logp[favourite]:.3f}); the pick was "
          f"{tok.decode([first.token])!r}. Perplexity of these {len(g.logprobs)} tokens under the model: "
          f"{np.exp(-np.mean([e.logprob for e in g.logprobs])):.1f}")

    # 5. n continuations of one prompt (OpenAI's n): one prefill, the prompt's KV blocks shared
    parallel_sampling(llm)

    def draw(ax):
        order = np.argsort(-dists["none"])[:12]
        width = 0.8 / len(dists)
        for j, (name, probs) in enumerate(dists.items()):
            ax.bar(np.arange(12) + j * width, probs[order], width, label=name)
        ax.set_xticks(np.arange(12) + 0.4, [tok.decode([int(i)]) for i in order], rotation=60, fontsize=7)
        ax.set_ylabel("probability"), ax.legend(fontsize=7)
        ax.set_title("Lesson 28: the next-token distribution under each control")
    save_plot("28_controls.png", draw)


if __name__ == "__main__":
    main()
