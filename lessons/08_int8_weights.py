"""Lesson 08 — int8 weights: a quarter of fp32's bytes per weight, what it costs in quality and in CPU speed.

Lesson 03 showed that decode reads every weight once per token, so its speed is bandwidth ÷ bytes of
weights. Fewer bytes per weight is the lever: int8 stores each weight in one byte, with one fp32
scale per output row (symmetric: scale = max|row| / 127, q = round(w / scale), w ≈ q · scale). We
quantize one real SmolLM2 matrix by hand, then the whole model (`minillm.checkpoints.quantize.quantize_checkpoint`,
what `minillm.load(..., quant="int8")` does), and measure bytes, perplexity and decode speed.

A caveat about this model: SmolLM2's weights come from a Q4_1 GGUF, i.e. they already sit on a
4-bit grid (groups of 32, 16 levels each). int8 quantizes that grid again, finely (lesson 09).

Run: python lessons/08_int8_weights.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 03 (decode pays for bytes)",
    ],
    "objectives": [
        "quantize a weight matrix to int8 per row and bound its error by scale/2",
        "measure the perplexity cost and the decode speed of int8 weights on this CPU",
        "explain why fewer bytes pay at decode only if dequantization is cheap",
    ],
    "study_time": "45 min, plus 20 min for exercise 08 (int8 per row)",
    "check_questions": [
        "Why is the rounding error of a per-row int8 code at most half its scale?",
        "Why can int8 be slower than fp32 on one matrix in cache yet as fast over the whole model?",
    ],
    "try_this": [
        "minillm generate --quant int8 \"The capital of France is\"",
        "compare your tok/s with the two reference lines",
    ],
}
import os
import sys
from pathlib import Path

# One BLAS thread: on a shared 2-core machine, BLAS threads fight other work for the cores and
# decode timings swing 10x; one thread makes fp32 and int8 comparable (set it yourself to override).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.course import hf_tensors, lesson_model, print_table, quick, save_plot
from minillm.tools.evaluate import eval_text, perplexity
from minillm.llm import LLM
from minillm.model.transformer import Transformer
from minillm.tools.planner import GPUS, weight_bytes
from minillm.course.measure import Spread, beside_reference, check, interleaved, load_average, load_line
from minillm.checkpoints.quantize import quantize_checkpoint
from minillm.model.quant import Int8Weight, quantize_int8


# NEW: int8 per output row, written out (the engine's quantize_int8 is these three lines) -----------
def int8_per_row(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] -> codes int8 [out, in], scales fp32 [out]; w ≈ codes · scales[:, None]."""
    scales = np.abs(w).max(axis=1) / 127.0                                   # [out]
    q = np.clip(np.rint(w / np.where(scales > 0, scales, 1.0)[:, None]), -127, 127)
    return q.astype(np.int8), scales.astype(np.float32)
# ---------------------------------------------------------------------------------------------------


def model_bytes(tensors: dict) -> tuple[int, int]:
    """(bytes of the quantizable layer matrices, bytes of everything) of a checkpoint's tensors."""
    unique = {id(a): a for a in tensors.values()}                            # a tied LM head is the embedding
    total = sum(a.nbytes for a in unique.values())
    layer = sum(a.nbytes for k, a in tensors.items() if ".layers." in k and k.endswith((".weight", ".qweight", ".scales"))
                and "norm" not in k)
    return layer, total


def decode_steps(models: dict[str, LLM], prompt: list[int], rounds: int) -> dict[str, Spread]:
    """Seconds of one decode step of each model after the same prompt; the models take turns
    (course/measure.py), so other work on the machine slows both alike."""
    caches = {label: m.model.new_cache(len(prompt) + rounds + 2) for label, m in models.items()}
    for label, m in models.items():
        m.model.prefill(prompt, caches[label])
    return interleaved({label: lambda m=m, label=label: m.model.decode(prompt[-1], caches[label])
                        for label, m in models.items()}, rounds)


def one_token_matmul(w: np.ndarray, q: Int8Weight, rounds: int) -> dict[str, Spread]:
    """Seconds for x @ Wᵀ of one token, the matrix hot in cache: fp32 GEMV, int8 widening alone (codes times
    scales), and the engine's int8 matmul (codes widened to fp32, the GEMV, the scale on each output)."""
    x = np.random.default_rng(0).standard_normal((1, w.shape[1])).astype(np.float32)
    return interleaved({"fp32 GEMV (BLAS)": lambda: x @ w.T,
                        "int8 -> fp32 widening alone": lambda: q.dequantize_rows(0, q.shape[0]),
                        "int8: widen + fp32 GEMV, scale on the outputs (engine)": lambda: q.matmul(x)}, rounds)


def main():
    small = quick()
    llm = lesson_model()
    cfg, tensors = llm.config, hf_tensors(llm.model)

    # 1. One real matrix: the first layer's MLP up-projection.
    name = "model.layers.0.mlp.up_proj.weight"
    w = np.asarray(tensors[name], dtype=np.float32)                          # [1536, 576]
    q, scales = int8_per_row(w)
    engine = quantize_int8(w)
    assert np.array_equal(q, engine.qweight) and np.allclose(scales, engine.scales)
    err = np.abs(q * scales[:, None] - w)                                    # [out, in]
    matrix_rows = [[f"row {r}", f"{np.abs(w[r]).max():.4f}", f"{scales[r]:.3e}", f"{err[r].max():.3e}",
                    f"{scales[r] / 2:.3e}", "yes" if err[r].max() <= scales[r] / 2 * (1 + 1e-5) else "NO"]
                   for r in (0, 1, int(np.argmax(scales)))]
    within = bool(np.all(err <= scales[:, None] / 2 * (1 + 1e-5)))
    rel_rms = float(np.sqrt((err ** 2).mean() / (w ** 2).mean()))
    # The Q4_1 source: how many distinct values a group of 32 consecutive weights holds (at most 16).
    distinct = max(len(np.unique(g)) for g in w[:64].reshape(-1, 32))

    # 2. The whole model: every layer matrix to int8 (embedding, LM head and norms stay fp32).
    int8_cfg, int8_tensors = quantize_checkpoint(cfg, tensors, "int8")
    int8 = LLM(int8_cfg, Transformer(int8_cfg, int8_tensors), llm.tokenizer, name="int8")
    (fp_layer, fp_total), (q_layer, q_total) = model_bytes(tensors), model_bytes(int8_tensors)

    text = eval_text(600 if small else 4000)
    context, n_tokens = (32, 48) if small else (256, 512)
    ppl_fp, ppl_q = (perplexity(m, text, context=context, max_tokens=n_tokens) for m in (llm, int8))
    prompt = llm.prompt_ids(text, chat=False)[:16]
    load_start = load_average()
    steps = decode_steps({"fp32": llm, "int8": int8}, prompt, 3 if small else 16)
    tok_s = {label: spread.per() for label, spread in steps.items()}
    us = one_token_matmul(w, engine, 5 if small else 50)

    # 3. The same bytes on a GPU: decode reads all weights once per token (a ceiling, not a measurement).
    h100 = GPUS["H100-80GB-SXM"]
    gpu_rows = [[dt, f"{weight_bytes(cfg, dt) / 1e6:.0f}", f"{h100.bandwidth / weight_bytes(cfg, dt):,.0f}"]
                for dt in ("fp32", "bf16", "int8")]

    print_table(f"Lesson 08 — int8 per row on one real matrix: {name} {list(w.shape)}",
                ["row", "max |w|", "scale = max|w|/127", "max |error|", "scale / 2", "error <= scale/2"],
                matrix_rows)
    print(f"every one of {w.size:,} weights within scale/2 of its row: {within}; relative RMS error {rel_rms:.4f}; "
          f"{w.nbytes:,} bytes fp32 -> {q.nbytes + scales.nbytes:,} int8 + scales ({(q.nbytes + scales.nbytes) / w.nbytes:.1%}).")
    print(f"Q4_1 source: a group of 32 consecutive weights holds at most {distinct} distinct values (4 bits: 16).")
    print_table(f"the whole model: fp32 vs int8 weights ({ppl_fp.n_tokens} tokens of eval_text, windows of {context})",
                ["weights", "layer matrices MB", "whole model MB", "perplexity", "Δ perplexity",
                 "decode tok/s, median (min-max)"],
                [["fp32", f"{fp_layer / 1e6:.1f}", f"{fp_total / 1e6:.1f}", f"{ppl_fp.ppl:.3f}", "",
                  steps["fp32"].rate()],
                 ["int8", f"{q_layer / 1e6:.1f}", f"{q_total / 1e6:.1f}", f"{ppl_q.ppl:.3f}",
                  f"{100 * (ppl_q.ppl / ppl_fp.ppl - 1):+.2f}%", steps["int8"].rate()]])
    # the project's own figures for this model (lessons/BENCHMARKS.md, one BLAS thread), to set yours beside
    print(beside_reference("cpu.decode.smollm2.fp32.narrow-run", tok_s["fp32"]))
    print(beside_reference("cpu.decode.smollm2.int8", tok_s["int8"]))
    print(beside_reference("cpu.perplexity.smollm2.int8", 100 * (ppl_q.ppl / ppl_fp.ppl - 1)))
    print(f"decode steps: the two models took turns for {len(steps['fp32'].samples)} rounds; {load_line(load_start)}")
    check("over the whole model int8 decodes about as fast as fp32 (decode pays for bytes, and widening is "
          "cheap next to streaming the weights)", tok_s["int8"] > 0.7 * tok_s["fp32"],
          f"int8 {tok_s['int8']:.1f} tok/s vs fp32 {tok_s['fp32']:.1f} ({tok_s['int8'] / tok_s['fp32']:.2f}x)")
    print(f"The embedding / tied LM head ({cfg.vocab_size:,} x {cfg.dim}) stays fp32: "
          f"{tensors['model.embed_tokens.weight'].nbytes / 1e6:.0f} MB of both totals.")
    print_table(f"one matrix alone, hot in cache: x @ Wᵀ for one token, {list(w.shape)}, µs: median (min-max) of "
                f"{len(next(iter(us.values())).samples)} interleaved rounds",
                ["step", "µs"], [[label, spread.format(1e6, 0)] for label, spread in us.items()])
    gemv, widen = (us[k] for k in list(us)[:2])
    check("in cache, widening int8 to fp32 costs more than the fp32 GEMV itself (NumPy has no int8 GEMV)",
          widen.median > gemv.median, f"widening {widen.format(1e6, 0)} µs vs GEMV {gemv.format(1e6, 0)} µs")
    ratio = tok_s["int8"] / tok_s["fp32"]
    print("NumPy has no int8 matrix-vector product: the engine widens a block of rows to fp32 and runs the fp32\n"
          "GEMV anyway (the row's scale multiplies its one output, not each weight). With the matrix already in\n"
          f"cache that is {us[list(us)[2]].median / gemv.median:.1f}x the fp32 GEMV. In the whole model the fp32 weights ({fp_layer / 1e6:.0f} MB) "
          "stream from\nDRAM at 4 bytes a weight, while int8 streams 1 byte and widens into a block that stays in "
          "cache:\ndecode is memory-bound (lesson 03), and here int8 decoded "
          + (f"{ratio:.2f}x as fast as fp32 (table above)." if ratio >= 1 else
             f"at {ratio:.2f}x fp32's speed: the widening\ncost more than the bytes saved (table above)."))
    print("A GPU kernel widens in registers: nothing wider than int8 crosses the memory bus, and decode pays\n"
          "for bytes per token:")
    print_table("ceiling of SmolLM2 decode on one H100 (3.35 TB/s ÷ weight bytes per token; planner.weight_bytes)",
                ["weights", "MB read per token", "tok/s ceiling"], gpu_rows)

    def draw(ax):
        ax.hist((err / scales[:, None]).ravel(), bins=60)
        ax.set_xlabel("|error| / scale of its row"), ax.set_ylabel("weights")
        ax.set_title(f"Lesson 08: int8 rounding error of {name.split('.', 2)[2]}, all within scale/2")
    save_plot("08_int8_error.png", draw)


if __name__ == "__main__":
    main()
