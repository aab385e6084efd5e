"""Lesson 27 — constrained decoding: a grammar as a state machine over tokens, and the mask it puts on the logits.

An application that asks for JSON needs JSON every time, not most of the time. Sampling cannot promise
that; a mask can. A grammar is a state machine over bytes, and every token of the vocabulary is a string
of bytes: in each state, the tokens whose bytes the machine can read without getting stuck are the ones
that may come next. Set every other logit to -inf before the pick (sampling.py's step 4) and the answer
cannot leave the grammar, whatever the temperature. Four steps, each measured here:

1. A grammar built by hand: the regex `[0-9]+ (kg|g)` as a 5-state DFA, its mask over SmolLM2's 49,152
   tokens computed in NumPy by walking every token's bytes at once (exercise 27). # NEW
2. The same regex through llguidance, the engine minillm uses (engine/structured.py): its masks are the
   hand-built ones, state for state. # NEW
3. Why JSON mode cannot break: the same seeds at rising temperatures, with and without the mask.
4. What a mask costs per token, against a decode step (the goal: under 10% of it on the CPU; in the
   engine the mask is filled on a worker thread while the forward pass runs, so on a GPU it hides).

Run: python lessons/27_constrained_decoding.py    (MINILLM_LESSON_QUICK=1: smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 04 (sampling: the pick from the logits)",
        "lesson 19 (serving: what an API client sends)",
    ],
    "objectives": [
        "compute the set of tokens a DFA state allows, over a real vocabulary, in NumPy",
        "explain why a masked answer cannot break its grammar, and how it can still end early",
        "measure what a mask costs per token against a decode step",
    ],
    "study_time": "45 min, plus 30 min for exercise 27 (the token mask of a DFA state)",
    "check_questions": [
        "A token spells \"2 k\": in which states of `[0-9]+ (kg|g)` is it allowed?",
        "Why can a masked JSON answer still fail to parse (and what finish_reason says so)?",
        "Why does the engine fill the mask while the forward pass runs?",
    ],
    "try_this": [
        "minillm serve, then send response_format {\"type\": \"json_object\"} at temperature 2",
        "change the regex in step 1 to allow a decimal point and rebuild the DFA by hand",
    ],
}
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # stable timings on a shared machine (lesson 08)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import json

import numpy as np

from minillm.course import dfa_token_mask_reference, digits_unit_dfa, lesson_model, print_table, quick, token_table
from minillm.engine.sampling import Sampler, SamplingParams
from minillm.course.measure import Spread, beside_reference, check, load_average, load_line

REGEX = "[0-9]+ (kg|g)"
PROMPT = "The parcel's weight, in kg or g: "
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "legs"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "legs": {"type": "integer", "minimum": 0, "maximum": 8}}}
ASK = [{"role": "user", "content": "Describe a cat as a JSON object with its name and number of legs."}]


def main() -> None:
    llm = lesson_model()
    tokenizer = llm.tokenizer
    vocab = llm.config.vocab_size
    real = hasattr(tokenizer, "special_tokens")         # random weights come with a one-byte-a-token stand-in

    # ---- 1. the grammar by hand: a DFA and the mask of each of its states ----------------------------------
    dfa, accepting = digits_unit_dfa()
    if real:
        special = set(tokenizer.special_tokens.values())
        tokens = [b"" if i in special else tokenizer._bytes[i] for i in range(vocab)]  # control tokens: no bytes
    else:
        tokens = [bytes([i - 256]) if 256 <= i < 512 else b"" for i in range(vocab)]
    table, lengths = token_table(tokens)                                              # [vocab, max_len], [vocab]
    rows = []
    for state, where in enumerate(["start", "after a digit", "after the space", "after k", "accepting"]):
        mask = dfa_token_mask_reference(dfa, state, table, lengths)                   # bool [vocab]
        examples = [tokens[i].decode("utf-8", "replace") for i in np.flatnonzero(mask)[:4]]
        rows.append((state, where, int(mask.sum()), f"{mask.mean():.4%}", " ".join(repr(e) for e in examples)))
    print_table(f"Lesson 27 — `{REGEX}` as a DFA: the tokens each state allows (of {vocab:,})",
                ["state", "where", "allowed", "share", "some of them"], rows)
    if not real:
        print("Steps 2-4 need a real tokenizer's token bytes: run this lesson on smollm2-135m.")
        return

    # A generation under the hand-built mask: the sampler's mask step (Sampler.allowed_tokens) does the rest.
    ends = list(tokenizer.eos_ids)                    # the tokens that end an answer: allowed where the DFA accepts
    text, hand_states = hand_masked_generation(llm, dfa, accepting, table, lengths, ends, temperature=1.5, seed=0)
    print(f"\nAt temperature 1.5, under the hand-built mask: {PROMPT!r} -> {text!r}")

    # ---- 2. the same regex through llguidance: the same masks ------------------------------------------------
    grammar = llm.grammar(structured_outputs={"regex": REGEX})
    state, agree = grammar.start(), 0
    for hand_mask, token in hand_states:
        library = state.allowed()                                                     # bool [vocab]
        agree += bool(np.array_equal(library, hand_mask))
        state.advance(token)
    print(f"2. llguidance's masks equal the hand-built ones at {agree} of {len(hand_states)} steps of that "
          f"generation (end token included where the DFA accepts)")

    # ---- 3. why JSON mode cannot break -------------------------------------------------------------------------
    json_grammar = llm.grammar({"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    seeds = range(1 if quick() else 2)
    rows = []
    for temperature in (1.0, 2.0) if not quick() else (1.0,):
        free = [llm.generate(ASK, max_tokens=40, temperature=temperature, seed=s) for s in seeds]
        held = [llm.generate(ASK, max_tokens=40, temperature=temperature, seed=s,
                             response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
                for s in seeds]
        rows.append((temperature, f"{sum(map(parses, (g.text for g in free)))}/{len(free)}",
                     f"{sum(map(parses, (g.text for g in held)))}/{len(held)}",
                     " ".join(g.finish_reason for g in held)))
    print_table("3. answers that parse as JSON, the same seeds without and with the mask (40 tokens at most)",
                ["temperature", "no mask", "mask", "finish (mask)"], rows)
    print("A masked answer can only be unfinished (finish_reason \"length\": max_tokens ran out), never wrong.")

    # ---- 4. what a mask costs per token ------------------------------------------------------------------------
    load_at_start = load_average()
    masks, hand, decodes = mask_costs(llm, json_grammar, table, lengths, dfa)
    mask_s, numpy_s, decode_s = masks.median, hand.median, decodes.median
    print_table("4. the cost of one token's mask against one decode step (SmolLM2 on this CPU), "
                "ms: median (min-max)", ["work", "ms per token", "share of a decode step"],
                [("decode step (model.decode, batch 1)", decodes.format(digits=2), "100%"),
                 ("llguidance mask, JSON schema (fill + unpack)", masks.format(digits=3), f"{mask_s / decode_s:.1%}"),
                 ("hand-built NumPy mask, the 5-state DFA", hand.format(digits=3), f"{numpy_s / decode_s:.1%}")])
    print(load_line(load_at_start))
    print(beside_reference("cpu.structured.mask-share", 100 * mask_s / decode_s))
    check("a token's mask costs well under a tenth of a decode step", mask_s < 0.1 * decode_s,
          f"mask {masks.ms(3)} ms vs decode {decodes.ms(2)} ms")
    print("The library precomputes a token trie and walks it per state; the hand-built mask walks every token "
          "each time. In the engine the mask is filled on a worker thread during the forward pass "
          "(Engine._fill_masks): on a GPU it costs no step time at all.")


def parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def hand_masked_generation(llm, dfa, accepting, table, lengths, ends, temperature, seed, max_tokens=12):
    """Generate under the hand-built DFA mask; -> (text, [(mask, token) per step])."""
    model, tokenizer = llm.model, llm.tokenizer
    ids = llm.prompt_ids(PROMPT, chat=False)
    cache = model.new_cache(len(ids) + max_tokens)
    logits = model.prefill(ids, cache)
    sampler, state, steps, out = Sampler(SamplingParams(temperature=temperature, seed=seed)), 0, [], []
    for _ in range(max_tokens):
        mask = dfa_token_mask_reference(dfa, state, table, lengths)     # bool [vocab]
        mask[ends] = accepting[state]                                   # the end tokens: only where the DFA accepts
        sampler.allowed_tokens = mask
        token = sampler(logits)
        steps.append((mask, token))
        if token in ends:
            break
        for byte in tokenizer._bytes[token]:
            state = int(dfa[state, byte])
        out.append(token)
        logits = model.decode(token, cache)
    return tokenizer.decode(out), steps


def mask_costs(llm, grammar, table, lengths, dfa, steps=None):
    """Seconds per token, each a Spread: llguidance's mask along a JSON answer, the hand-built NumPy mask, a decode
    step."""
    steps = steps or (8 if quick() else 24)
    answer = llm.generate(ASK, max_tokens=steps, temperature=1.0, seed=0,
                          response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    state, spent = grammar.start(), []
    for token in answer.token_ids:
        start = time.perf_counter()
        state.allowed()                                               # fill the bitmask, unpack to bool [vocab]
        spent.append(time.perf_counter() - start)
        state.advance(token)
    hand = []
    for s in range(5):
        start = time.perf_counter()
        dfa_token_mask_reference(dfa, s % 5, table, lengths)
        hand.append(time.perf_counter() - start)
    model = llm.model
    cache = model.new_cache(64 + steps)
    model.prefill(list(range(1, 65)), cache)
    decodes = []
    for i in range(steps):
        start = time.perf_counter()
        model.decode(100 + i, cache)
        decodes.append(time.perf_counter() - start)
    return Spread(tuple(spent)), Spread(tuple(hand)), Spread(tuple(decodes))


if __name__ == "__main__":
    main()
