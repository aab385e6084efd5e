"""Lesson 15 — FlashNorm: fold the norm gains away, defer the normalization, and join two streams explicitly.

Every Llama projection reads RMSNorm(x) = x · 1/RMS(x) ⊙ g. FlashNorm (Graef et al., arXiv 2407.09577)
rewrites that without changing a single logit:
  Prop. 1  the gain g moves into the next weight matrix (W* = W·diag(g)): the norm becomes weightless;
  Prop. 2  1/RMS(x) is one number per token, so it can be applied AFTER the matmul: x·W* and the
           reduction no longer wait for each other (on a GPU: two streams at once);
  Prop. 3  a norm right after a normalized projection cancels the inner 1/RMS (shown, not used: Llama
           has no such double norm; Gemma 3's and Qwen3's QK-norm is one, shown on a Gemma-3 shape).
Then the GPU part, and the bug that comes with it: two streams need an explicit join. Without it the
model reads the previous token's projection and "talks one step late".

Exercise 15 folds a gain; exercise 15.2 plans the deferred block as two streams (the projections of the raw
x on one, 1/RMS on the other) and the join where each output takes its scale, SwiGLU's gate before SiLU.

Run: python lessons/15_flashnorm.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 01 (rmsnorm)",
        "lesson 13 (streams and graphs) for the GPU part",
    ],
    "objectives": [
        "fold a norm's gain into the next matrix and check the logits",
        "defer the 1/RMS past the matmul and bound its fp16 error",
        "see how a missing join between two streams passes unit tests yet talks one step late",
    ],
    "study_time": "60 min, plus 25 min for exercise 15 (folding the gain)",
    "check_questions": [
        "Why can a norm's gain move into the following matrix but not into the previous one?",
        "What does a missing stream join do to the text, and why does perplexity not catch it?",
    ],
    "try_this": [
        "minillm generate --flashnorm \"The capital of France is\"",
        "on a GPU: run the micro-benchmark's fused vs two-stream rows",
    ],
}
import os
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.backend import as_f32
from minillm.course import hf_tensors, lesson_model, print_table, quick, run_gpu_parts
from minillm.cuda.dev.flashnorm import (FlashNormGPUTransformer, TwoStreamNorm, benchmark, e2e, print_benchmark,
                                        print_e2e)
from minillm.model.flashnorm import deferred_swiglu, fold_checkpoint, fold_rmsnorm_into_linear, inv_rms
from minillm.model.layers import linear, rmsnorm, rope_tables
from minillm.model.transformer import Transformer

PROMPT = "The capital of France is Paris. The capital of Italy is"


# NEW: the greedy loop as the race sees it -----------------------------------------------------------
def greedy(model, prompt: list[int], n: int) -> list[int]:
    cache = model.new_cache(len(prompt) + n + 1)
    out = [int(np.argmax(model.prefill(prompt, cache)))]
    for _ in range(n - 1):
        out.append(int(np.argmax(model.decode(out[-1], cache))))
    return out


def greedy_one_step_late(model, prompt: list[int], n: int) -> list[int]:
    """What a scale that reads the PREVIOUS step's projection buffer emits: at every decode step, the
    argmax of the logits computed one step earlier (the buffer starts with the prompt's)."""
    cache = model.new_cache(len(prompt) + n + 1)
    stale = model.prefill(prompt, cache)
    out = [int(np.argmax(stale))]
    for _ in range(n - 1):
        fresh = model.decode(out[-1], cache)
        out.append(int(np.argmax(stale)))        # the buffer still holds the last step's logits
        stale = fresh
    return out
# ---------------------------------------------------------------------------------------------------


def with_gains(cfg, tensors: dict) -> dict:
    """Random-weight stand-ins have all-ones gains (nothing to fold): give them gains around 1."""
    if not all(np.all(as_f32(v) == 1.0) for k, v in tensors.items() if k.endswith("norm.weight")):
        return tensors
    rng = np.random.default_rng(15)
    print("(the stand-in's norm gains are all ones: drawn around 1 here, so folding has work to do)")
    return {k: (1 + 0.2 * rng.standard_normal(v.shape)).astype(np.float32) if k.endswith("norm.weight") else v
            for k, v in tensors.items()}


def residual_streams(model, ids: list[int]) -> dict[str, np.ndarray]:
    """The residual stream x entering each norm of a prompt's forward pass.   -> name: [T, dim]"""
    cache = model.new_cache(len(ids))
    cos, sin = rope_tables(np.arange(len(ids)), model.inv_freq)
    x, out = as_f32(model.embed[np.asarray(ids)]), {}
    for i, layer in enumerate(model.layers):
        out[f"layer {i} attention"] = x
        x = x + model.attend(x, layer, i, cache, cos, sin)
        out[f"layer {i} MLP"] = x
        x = x + model.ffn(x, layer)
    out["final norm"] = x
    return out


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def fold_section(cfg, tensors, orig, ids):
    """Prop. 1 on one matrix and on the whole model."""
    layer, g = orig.layers[0], as_f32(orig.layers[0].attn_norm)
    x = residual_streams(orig, ids)["layer 0 attention"]                        # [T, dim]
    wq_star = fold_rmsnorm_into_linear(g, layer.wq)
    one = np.abs(linear(rmsnorm(x, np.ones_like(g), cfg.norm_eps), wq_star)
                 - linear(rmsnorm(x, g, cfg.norm_eps), layer.wq)).max()
    cfg_t, tied, report_t = fold_checkpoint(cfg, tensors)
    cfg_u, untied, report_u = fold_checkpoint(cfg, tensors, untie=True)
    ref = orig.prefill(ids, orig.new_cache(len(ids)), all_logits=True)       # [T, vocab]
    rows = [["layer 0 q_proj, one matrix", "rmsnorm(x, g) @ Wq.T vs rmsnorm(x, 1) @ Wq*.T", f"{one:.2e}", "", ""]]
    models = {}
    for name, c, t, r in (("tied head: final norm kept", cfg_t, tied, report_t),
                          ("--untie: final norm folded", cfg_u, untied, report_u)):
        m = Transformer(c, t)
        got = m.prefill(ids, m.new_cache(len(ids)), all_logits=True)
        rows.append([f"whole model, {name}", "HF-named checkpoint, all-ones norms", f"{np.abs(got - ref).max():.2e}",
                     len(r.folded), f"{r.extra_bytes / 1e6:.1f}"])
        models[name] = (c, t)
    print_table("Lesson 15 — Prop. 1: fold the gains (max |folded - original| logits, fp32)",
                ["what", "how", "max |folded - original|", "norms folded", "extra MB"], rows)
    print(f"kept: {report_t.kept.get('model.norm.weight', 'nothing')}")
    return models["--untie: final norm folded"], ref


def defer_section(cfg, untied, orig, ids, ref):
    """Prop. 2: the same numbers with the scale after the matmul; errors in fp32 and fp16."""
    fn = Transformer(*untied, flashnorm=True)
    streams = residual_streams(orig, ids)
    x = streams[f"layer {cfg.n_layers - 1} MLP"]                                 # [T, dim], deep: large values
    w = fn.layers[-1].w_gate                                                    # folded  [ffn, dim]
    exact = rmsnorm(x.astype(np.float64), np.ones(cfg.dim), cfg.norm_eps) @ as_f32(w).astype(np.float64).T
    s32 = inv_rms(x, cfg.norm_eps)                                              # [T, 1]
    x16, w16 = x.astype(np.float16), as_f32(w).astype(np.float16)
    norm16 = (x * s32).astype(np.float16)
    raw = x @ as_f32(w).T                                                      # [T, ffn]  un-normalized
    rows = [["standard: normalize, then x·W*", "fp32", f"{rel(rmsnorm(x, np.ones(cfg.dim), cfg.norm_eps) @ as_f32(w).T, exact):.1e}"],
            ["deferred: x·W*, then · 1/RMS(x)", "fp32", f"{rel(raw * s32, exact):.1e}"],
            ["standard", "fp16 inputs and output", f"{rel(norm16 @ w16.T, exact):.1e}"],
            ["deferred, scale applied in fp32", "fp16 inputs and output, fp32 scale",
             f"{rel((x16 @ w16.T).astype(np.float32) * s32, exact):.1e}"]]
    print_table(f"Prop. 2: defer the normalization (the gate projection of the last layer's MLP input, "
                f"|x| up to {np.abs(x).max():.0f}); error relative to fp64", ["path", "precision", "max rel error"], rows)
    print(f"fp16 headroom: the largest un-normalized |x·W*| is {np.abs(raw).max():.1f} (normalized: "
          f"{np.abs(exact).max():.2f}); fp16 ends at 65504, so a residual stream {65504 / np.abs(raw).max():.0f}x "
          f"larger\noverflows before the scale. Hence the scale in fp32, on fp32 accumulators (as the GPU kernels do).")
    mlp = rel(deferred_swiglu(x, fn.layers[-1], cfg.ffn_dim, cfg.norm_eps),
              fn.mlp_block(rmsnorm(x, fn.layers[-1].mlp_norm, cfg.norm_eps), fn.layers[-1]))
    got = fn.prefill(ids, fn.new_cache(len(ids)), all_logits=True)
    print(f"SwiGLU with the gate scaled before SiLU and the up path's scale after the down projection: "
          f"max rel |deferred - standard| {mlp:.1e}.\nWhole model, Transformer(flashnorm=True) vs the original: "
          f"max |Δ logits| {np.abs(got - ref).max():.2e} over {len(ids)} positions.")
    return fn


def prop3_section():
    """A norm after a normalized projection: the inner 1/RMS cancels (RMS(c·a) = c·RMS(a))."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((8, 256)) * 4).astype(np.float64)
    w = rng.standard_normal((128, 256)) / 16
    g = 1 + 0.2 * rng.standard_normal(128)
    rows = []
    for eps in (0.0, 1e-6, 1e-2):
        twice = rmsnorm(rmsnorm(x, np.ones(256), eps) @ w.T, g, eps)
        once = rmsnorm(x @ w.T, g, eps)
        rows.append([f"{eps:g}", f"{np.abs(twice - once).max():.2e}"])
    print_table("Prop. 3: RMSNorm(RMSNorm(x)·W) vs RMSNorm(x·W) on random data (fp64)",
                ["eps", "max |difference|"], rows)
    print("Exact for eps = 0; eps is not scaled with x, so with eps > 0 the inner norm leaves a trace that\n"
          "grows with eps relative to mean(x²). Llama has no norm right after a projection, so the engine\n"
          "does not use this one (MLA's latent norm after kv_a_proj is the case the paper names).")


# NEW: Prop. 3 on a real architecture ----------------------------------------------------------------
def gemma_prop3_section(small: bool):
    """Gemma 3 (and Qwen3) norm each head of q and k right after q_proj/k_proj, whose input is already
    RMSNorm(x): the input's 1/RMS(x) is one number per token, so the per-head norm cancels it (Prop. 3).
    Shown with the engine's own Transformer.qkv on random weights of gemma-3-1b's layer shape."""
    from minillm.model.config import PRESETS
    from minillm.tools.bench import random_model
    shape = PRESETS["gemma-3-1b"].config
    cfg = shape.replace(n_layers=1, vocab_size=256, layer_windows=None, sliding_window=None)
    model = random_model(cfg, seed=15)                                  # dim 1152, 4 q heads, 1 KV head, hd 256
    layer, T, hd = model.layers[0], 4 if small else 16, cfg.head_dim
    cos, sin = np.ones((T, hd // 2), np.float32), np.zeros((T, hd // 2), np.float32)   # position 0: no rotation
    rows = []
    for scale in (1.0, 34.0, 1e-3):                    # 34 ~ sqrt(1152): Gemma's scaled embeddings
        x = (np.random.default_rng(7).standard_normal((T, cfg.dim)) * scale).astype(np.float32)
        q, k, v = model.qkv(x, layer, cos, sin)                                     # the engine: norm, q_proj, q_norm
        gained = x * as_f32(layer.attn_norm)                                        # the input norm's gain, no 1/RMS
        q_once = rmsnorm(linear(gained, layer.wq).reshape(T, cfg.n_heads, hd), layer.q_norm, cfg.norm_eps)
        k_once = rmsnorm(linear(gained, layer.wk).reshape(T, cfg.n_kv_heads, hd), layer.k_norm, cfg.norm_eps)
        v_once = linear(gained, layer.wv).reshape(T, cfg.n_kv_heads, hd)
        rows.append([f"{scale:g}", f"{np.abs(q - q_once).max():.1e}", f"{np.abs(k - k_once).max():.1e}",
                     f"{np.abs(v - v_once).max() / np.abs(v).max():.1e}"])
    print_table(f"Prop. 3 on a Gemma-3 shape (dim {cfg.dim}, {cfg.n_heads} q heads of {hd}, eps {cfg.norm_eps:g}): "
                "the engine's q, k, v vs the same without the input norm's 1/RMS(x)",
                ["x scale", "max |q - q without 1/RMS|", "max |k - ...|", "v: relative difference"], rows)
    print("q and k do not need the input's 1/RMS(x): QK-norm right after the projection cancels it (up to eps,\n"
          "which only shows when mean(x²) nears it). v has no norm after it, so v still needs the scale: a\n"
          "FlashNorm for Gemma would defer 1/RMS(x) onto v alone and drop it from q and k.")


def stand_in_head(untied) -> Transformer:
    """Random stand-in weights decode one "hub" token forever, and a step-late copy of a constant looks
    the same. So the race demos get a stand-in whose next token is a fixed shuffle of the current one:
    the embedding scaled up (it dominates the residual stream) and the head = the shuffled embedding."""
    cfg, tensors = untied
    embed = as_f32(tensors["model.embed_tokens.weight"]) * 50.0                # [vocab, dim]
    shuffle = np.random.default_rng(16).permutation(cfg.vocab_size)
    print("\n(stand-in weights: the race demos use an embedding x50 and a head = the shuffled embedding, so\n"
          "greedy decoding walks a fixed shuffle of the vocabulary instead of repeating one token)")
    return Transformer(cfg, {**tensors, "model.embed_tokens.weight": embed, "lm_head.weight": embed[shuffle]},
                       flashnorm=True)


def cpu_replay(llm, fn, ids, n):
    fixed, late = greedy(fn, ids, n), greedy_one_step_late(fn, ids, n)
    tok = llm.tokenizer
    print_table("The model that talked one step late — CPU replay of what the race computes "
                "(at each step the argmax of the previous step's logits)",
                ["", "greedy continuation"], [["fixed", repr(tok.decode(fixed))], ["one step late", repr(tok.decode(late))]])
    return fixed, late


def main():
    small = quick()
    llm = lesson_model()
    cfg = llm.config
    ids = llm.prompt_ids(PROMPT, chat=False)[:12 if small else 32]
    n_new = 8 if small else 24
    tensors = with_gains(cfg, hf_tensors(llm.model))
    orig = Transformer(cfg, tensors)
    untied, ref = fold_section(cfg, tensors, orig, ids)
    fn = defer_section(cfg, untied, orig, ids, ref)
    prop3_section()
    gemma_prop3_section(small)
    race = stand_in_head(untied) if llm.name.startswith("random:") else fn
    cpu_replay(llm, race, ids, n_new)
    state: dict = {}
    failed = run_gpu_parts([
        ("the race: the LM head on two streams, explicit join vs implicit join with the matmul stream busy",
         lambda: race_part(llm, race, ids, n_new, state)),
        ("why unit tests and perplexity did not catch it", lambda: missed_part(state, ids, small)),
        ("micro-benchmark: unfused vs two-stream vs fused, µs per layer (SmolLM2 shape; all shapes: "
         "python -m minillm.cuda.dev.flashnorm)",
         lambda: print_benchmark(benchmark(presets=("smollm2-135m",), quick=small), "float16", print_table)),
        ("a CUDA graph capture of the implicit-join step", lambda: capture_part(state)),
        ("the whole decode step with FlashNorm at every norm site: production v4 vs fused vs deferred (SmolLM2 "
         "shape; with Mistral-7B's: python -m minillm.cuda.dev.flashnorm --e2e)", lambda: e2e_part(small))])
    if failed:
        sys.exit(f"GPU parts failed: {', '.join(failed)}")


# ---- the GPU: two streams, the join, and the race -------------------------------------------------

# NEW: the bug, on purpose. It lives here, never in the engine. -------------------------------------
class ImplicitJoin(TwoStreamNorm):
    """The scale waits for the RMS stream only: 'the matmul was launched first, it must be done'."""

    def join(self, main):
        main.wait_event(self.rms_done)
# ---------------------------------------------------------------------------------------------------


def race_part(llm, race, ids, n_new, state):
    """Greedy decoding three ways on the GPU: explicit join, implicit join + spin, one-step-late replay."""
    gpu = state["gpu"] = FlashNormGPUTransformer.from_cpu(race, dtype="float16")
    fixed = greedy(gpu, ids, n_new)
    replay = greedy_one_step_late(gpu, ids, n_new)
    explicit, raced = gpu.two_stream, ImplicitJoin(gpu.k)
    raced.delay_ns = 300_000                       # a spin kernel keeps the matmul stream busy for 300 µs
    state["raced"] = raced
    cache = gpu.new_cache(len(ids) + n_new + 1)
    out = [int(np.argmax(gpu.prefill(ids, cache)))]   # prefill as the engine does it ...
    gpu.two_stream = raced                         # ... then decode with the implicit join, matmul stream busy
    try:
        for _ in range(n_new - 1):
            out.append(int(np.argmax(gpu.decode(out[-1], cache))))
    finally:
        gpu.two_stream = explicit
    tok = llm.tokenizer
    print_table("The race on the GPU (fp16, LM head on two streams): greedy continuation",
                ["path", "tokens"], [["explicit join", repr(tok.decode(fixed))],
                                     ["implicit join + spin on the matmul stream", repr(tok.decode(out))],
                                     ["one-step-late replay (explicit join)", repr(tok.decode(replay))]])
    print(f"implicit join == one step late, token for token: {out == replay}; == fixed: {out == fixed}")


def missed_part(state, ids, small):
    """One call on an idle GPU (a unit test), and the perplexity path, both with the bug on."""
    import cupy as cp
    gpu, raced = state["gpu"], state["raced"]
    x = cp.asarray(np.random.default_rng(0).standard_normal((1, gpu.config.dim)).astype(np.float32) * 3)
    want = cp.empty((1, gpu.config.vocab_size), cp.float32)
    gpu.two_stream(x, gpu.lm_head, cp.empty_like(want), cp.empty(1, cp.float32), want, gpu.config.norm_eps)
    unit, trials, passed = ImplicitJoin(gpu.k), 5 if small else 20, 0
    for _ in range(trials):
        y_raw = cp.full_like(want, cp.nan)                  # a stale read shows up as NaN
        got = cp.empty_like(want)
        unit(x, gpu.lm_head, y_raw, cp.empty(1, cp.float32), got, gpu.config.norm_eps)
        cp.cuda.Device().synchronize()
        passed += bool(cp.allclose(got, want))
    ppl = np.abs(all_logits(gpu, raced, ids) - all_logits(gpu, gpu.two_stream, ids)).max()
    print_table("why unit tests and perplexity did not catch it",
                ["check", "result"],
                [["unit-test style: implicit join, idle GPU, no spin, one call", f"{passed} of {trials} runs correct"],
                 ["perplexity path (prefill, all positions) with the bug switched on",
                  f"max |raced - fixed| logits {ppl:.1e}"]])
    print("A unit test calls the op once on an idle GPU: by the time Python has launched the RMS kernel and\n"
          "the scale, the projection is usually finished, so the missing wait goes unnoticed (a race: it may\n"
          "pass a thousand times). Perplexity scores teacher-forced logits from prefill, which never uses the\n"
          "decode step's two streams. Only decode under load, with the matmul stream behind, reads the stale\n"
          "buffer, and then the output is fluent text one step late, not garbage: easy to miss by eye too.")


def all_logits(gpu, join, ids) -> np.ndarray:
    """Logits of every prompt position (what perplexity scores), with `join` as the model's two-stream op."""
    explicit, gpu.two_stream = gpu.two_stream, join
    try:
        return gpu.prefill(ids, gpu.new_cache(len(ids)), all_logits=True)
    finally:
        gpu.two_stream = explicit


def e2e_part(small):
    """Every norm site deferred (two streams forked and joined inside the captured graph, or one stream) or
    fused into the GEMVs, against the engine's step; logits checked before anything is timed."""
    n_new = 16 if small else 128
    print_e2e(e2e(presets=("smollm2-135m",), n_new=n_new, repeats=1 if small else 3), "float16", n_new, print_table)
    print("Same bytes for every variant: the weights are read once a token either way. What differs is the\n"
          "launches and the waits between them: fused keeps v4's five launches a layer and drops the gain\n"
          "reads; deferred adds a 1/RMS kernel, a scale and the separate RoPE/KV or SwiGLU step at each site,\n"
          "and the table shows how much of that the second stream hides.")


def capture_part(state):
    """A CUDA graph capture rejects a side stream that never rejoins: graphs would have caught the bug."""
    import cupy as cp
    gpu = state["gpu"]
    unjoined, stream = ImplicitJoin(gpu.k), cp.cuda.Stream(non_blocking=True)
    x = cp.ones((1, gpu.config.dim), cp.float32)
    out = cp.empty((1, gpu.config.vocab_size), cp.float32)
    scratch = (cp.empty_like(out), cp.empty(1, cp.float32))
    cp.cuda.Device().synchronize()
    verdict = "captured (the driver did not object)"
    try:
        with stream:
            stream.begin_capture()
            try:
                unjoined(x, gpu.lm_head, scratch[0], scratch[1], out, gpu.config.norm_eps)
            finally:
                stream.end_capture()
        cp.cuda.Device().synchronize()
    except Exception as e:  # noqa: BLE001 - refusing is the point of the demonstration
        verdict = f"refused: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    print(f"capturing the implicit-join step as a CUDA graph: {verdict}")


if __name__ == "__main__":
    main()
