"""Lesson 09 — int4 in groups: 16 levels per weight, a scale and a min per group, two weights per byte.

Lesson 08's int8 kept one scale per row: fine with 255 levels, hopeless with 16, because one large
weight would leave the rest of its row one or two levels. int4 therefore gives every group of g
consecutive weights of a row its own grid, and makes it asymmetric (from the group's min to its max,
scale = (max - min) / 15) so none of the 16 levels is wasted on a side of zero the group does not
reach. Smaller groups fit better and cost more: a fp16 scale and min are 32 bits per group, i.e.
+32/g bits per weight. We measure that trade on SmolLM2 (`minillm.model.quant.quantize_int4`), compare
it with a symmetric grid, and look at how two codes share one byte.

New in this lesson's second half: the min/max grid (what exercise 09 asks you to write) is only
the starting point. Two observations improve it without changing a single stored byte's meaning:
  1. Clipping: a grid a little narrower than [min, max] rounds the other 127 weights of a group
     more finely; the one weight outside pays its distance to the grid's end.
  2. Not every weight's error costs the same. A linear layer's output error is Σ_j Δw_j · x_j, so
     weight j's error is multiplied by input j, and in SmolLM2 a few input channels carry
     activations thousands of times larger than the rest. Weighting each squared error by
     a_j = E[x_j²] (measured by running random token ids through the model:
     `checkpoints.quantize.input_importance`) tells the search which weights to get right.
`quant.search_grid` tries 17 grids per group, refits each by weighted least squares and polishes
the best (Lloyd rounds); the engine (`quantize_checkpoint`, `load(quant="int4")`) uses it.

SmolLM2's weights come from a Q4_1 GGUF: already int4, asymmetric, in groups of 32. int4 with
g = 32 is that very grid, so it gives the weights back exactly; larger groups round them again.

Run: python lessons/09_int4_groupwise.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 08 (int8 per row)",
    ],
    "objectives": [
        "pack two 4-bit codes in a byte and quantize in groups with a scale and a minimum",
        "count bits per weight including the fp16 scale and minimum of each group",
        "measure how group size trades error and perplexity for bytes",
    ],
    "study_time": "50 min, plus 25 min for exercise 09 (int4 in groups)",
    "check_questions": [
        "How many bits per weight does int4 with groups of 64 cost, scales and minima included?",
        "Why does asymmetric (scale + min) beat symmetric (scale only) at 16 levels?",
    ],
    "try_this": [
        "add a group size of 16 to GROUP_SIZES and predict its bits per weight first",
        "minillm generate --quant int4 and compare the answer with fp32",
    ],
}
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # stable timings on a shared machine (lesson 08)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm import threads
from minillm.course.measure import beside_reference, load_line
from minillm.course import hf_tensors, lesson_model, print_table, quick, save_plot
from minillm.tools.evaluate import eval_text, perplexity
from minillm.llm import LLM
from minillm.model.transformer import Transformer
from minillm.checkpoints.quantize import input_importance
from minillm.model.quant import (GROUP_SIZES, LAYER_MATRICES, pack_int4, quantization_entry, quantize_int4,
                                 unpack_int4)


# The symmetric int4 grid, for comparison: q in -7 .. 7, scale = max|w| / 7 per group ----------------
def int4_symmetric(w: np.ndarray, group_size: int) -> np.ndarray:
    """w [out, in] -> the dequantized weights, fp32 [out, in] (the last group padded, as the engine does)."""
    out_dim, in_dim = w.shape
    padded = np.pad(w, ((0, 0), (0, -in_dim % group_size)), mode="edge")   # [out, in_padded]
    groups = padded.reshape(out_dim, -1, group_size)                        # [out, groups, g]
    scale = np.abs(groups).max(axis=-1, keepdims=True) / 7.0                # [out, groups, 1]
    q = np.clip(np.rint(groups / np.where(scale > 0, scale, 1.0)), -7, 7)   # 15 of the 16 codes
    return (q * scale).reshape(out_dim, -1)[:, :in_dim]
# ---------------------------------------------------------------------------------------------------


def rel_rms(approx: np.ndarray, w: np.ndarray, importance: np.ndarray | None = None) -> float:
    """sqrt(Σ a·err² / Σ a·w²): the relative error, each input column weighted by a (uniform when None)."""
    a = 1.0 if importance is None else importance[None, :]
    return float(np.sqrt((a * (approx - w) ** 2).sum() / (a * w ** 2).sum()))


def is_layer_matrix(name: str) -> bool:
    return name.startswith("model.layers.") and name.removesuffix(".weight").split(".", 3)[3] in LAYER_MATRICES


def symmetric_tensors(tensors: dict, group_size: int) -> dict:
    """Every layer matrix replaced by its symmetric-int4 approximation, kept in fp32 ("fake quantized":
    the same numbers a real symmetric-int4 kernel would compute with, without writing one)."""
    return {name: int4_symmetric(np.asarray(a, dtype=np.float32), group_size).astype(np.float32)
            if is_layer_matrix(name) else a for name, a in tensors.items()}


# NEW: the same checkpoint quantized with either grid (what quantize_checkpoint does, grid chosen) ------
def int4_checkpoint(cfg, tensors: dict, group_size: int, importance: dict | None):
    """importance None: min/max grids; else the searched grids, each matrix weighted by its inputs."""
    out = {}
    for name, a in tensors.items():
        if is_layer_matrix(name):
            q = quantize_int4(a, group_size, search=importance is not None,
                              importance=None if importance is None else importance[name])
            out.update(q.tensors(name.removesuffix(".weight")))
        else:
            out[name] = a
    return cfg.replace(quantization=quantization_entry("int4", group_size)), out
# ---------------------------------------------------------------------------------------------------


def main():
    small = quick()
    llm = lesson_model()
    cfg, tensors = llm.config, hf_tensors(llm.model)

    # 1. Packing, on a tiny example: eight codes, four bytes.
    codes = np.array([[3, 12, 0, 15, 7, 8, 1, 10]], dtype=np.uint8)
    packed = pack_int4(codes)
    assert np.array_equal(unpack_int4(packed), codes)
    pack_rows = [[j, int(codes[0, 2 * j]), int(codes[0, 2 * j + 1]),
                  f"{int(b) >> 4:04b}|{int(b) & 15:04b}", f"0x{int(b):02x}"] for j, b in enumerate(packed[0])]

    # 2. Which input columns matter (NEW): mean squares of every matrix's inputs over random tokens.
    calibration_tokens = 256 if small else 1024
    start = time.perf_counter()
    importance = input_importance(cfg, tensors, n_tokens=calibration_tokens)
    calibration_s = time.perf_counter() - start
    importance_rows = []
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight",
                 f"model.layers.{cfg.n_layers - 1}.mlp.down_proj.weight"):
        a = np.sort(importance[name])[::-1]
        importance_rows.append([name.removeprefix("model."), f"{a[0] / np.median(a):,.0f}×",
                                f"{a[:8].sum() / a.sum():.0%}"])

    # 3. One real matrix: min/max vs searched vs symmetric, and bytes, per group size.
    name = "model.layers.0.mlp.up_proj.weight"
    w = np.asarray(tensors[name], dtype=np.float32)                          # [1536, 576]
    a = importance[name]
    matrix_rows = []
    for g in GROUP_SIZES:
        q, s = quantize_int4(w, g), quantize_int4(w, g, search=True, importance=a)
        matrix_rows.append([g, f"{rel_rms(q.dequantize(), w):.4f}", f"{rel_rms(s.dequantize(), w):.4f}",
                            f"{rel_rms(int4_symmetric(w, g), w):.4f}", f"{rel_rms(q.dequantize(), w, a):.4f}",
                            f"{rel_rms(s.dequantize(), w, a):.4f}", f"{8 * q.nbytes / w.size:.3f}",
                            f"{q.nbytes:,}", f"{q.nbytes / w.nbytes:.1%}"])

    # 4. The whole model at each group size: bytes and perplexity, min/max grids vs searched grids.
    text = eval_text(600 if small else 4000)
    context, n_tokens = (32, 48) if small else (256, 256)
    sizes = GROUP_SIZES[-1:] if small else GROUP_SIZES
    base = perplexity(llm, text, context=context, max_tokens=n_tokens)
    layer_fp32 = sum(np.asarray(tensors[f"model.layers.{i}.{m}.weight"]).nbytes
                     for i in range(cfg.n_layers) for m in LAYER_MATRICES)
    model_rows = [["fp32", "", "", f"{layer_fp32 / 1e6:.1f}", "32", f"{base.ppl:.3f}", "", ""]]
    # The grid search is elementwise NumPy, run in row blocks on threads.parallel_map's threads: give it
    # every core. BLAS stays on one thread, set again before each forward pass (threads.for_rows).
    threads.fix(threads.cores())
    ppl, bits, exact = {}, {}, []
    for g in sizes:
        for grid, imp in (("min/max", None), ("searched", importance)):
            if grid == "searched" and g in exact:   # nothing to search for: min/max is the file's own grid
                continue
            start = time.perf_counter()
            qcfg, qt = int4_checkpoint(cfg, tensors, g, imp)
            seconds = time.perf_counter() - start
            nbytes = sum(a.nbytes for k, a in qt.items() if k.endswith((".qweight", ".scales", ".mins")))
            r = perplexity(LLM(qcfg, Transformer(qcfg, qt), llm.tokenizer), text, context=context, max_tokens=n_tokens)
            ppl[g, grid] = r.ppl
            bits[g, grid] = 8 * nbytes / (layer_fp32 / 4)                 # measured: codes, scales, mins, padding
            if abs(r.ppl / base.ppl - 1) < 1e-4:     # the weights came back as they were: an exact grid
                exact.append(g)
            model_rows.append(["int4 asymmetric", grid, g, f"{nbytes / 1e6:.1f}",
                               f"{bits[g, grid]:.3f}", f"{r.ppl:.3f}",
                               f"{100 * (r.ppl / base.ppl - 1):+.1f}%", f"{seconds:.1f}"])
    g_sym = sizes[-1]
    r = perplexity(LLM(cfg, Transformer(cfg, symmetric_tensors(tensors, g_sym)), llm.tokenizer), text,
                   context=context, max_tokens=n_tokens)
    sym_bytes = sum(rows * -(-cols // g_sym) * (g_sym // 2 + 2)                # codes + one fp16 scale a group
                    for i in range(cfg.n_layers) for m in LAYER_MATRICES
                    for rows, cols in [np.shape(tensors[f"model.layers.{i}.{m}.weight"])])
    model_rows.append(["int4 symmetric", "max|w|", g_sym, f"{sym_bytes / 1e6:.1f}",
                       f"{8 * sym_bytes / (layer_fp32 / 4):.3f}", f"{r.ppl:.3f}",
                       f"{100 * (r.ppl / base.ppl - 1):+.1f}%", ""])

    print_table("Lesson 09 — packing two 4-bit codes in a byte (minillm.model.quant.pack_int4): element 2j low, 2j+1 high",
                ["byte j", "element 2j (low)", "element 2j+1 (high)", "bits high|low", "hex"], pack_rows)
    print_table(f"which inputs matter: mean square a_j = E[x_j²] of each input column "
                f"({calibration_tokens} random tokens, {calibration_s:.1f} s)",
                ["matrix", "largest a_j / median", "top 8 columns' share of Σa"], importance_rows)
    print_table(f"one real matrix, {name} {list(w.shape)}: relative RMS error by grid and group size",
                ["group", "min/max", "searched", "symmetric", "min/max, a-weighted", "searched, a-weighted",
                 "bits/weight", "bytes", "of fp32"], matrix_rows)
    print(f"bits/weight = 4 + 32/g: every group adds a fp16 scale and a fp16 min (symmetric: scale only, 4 + 16/g);\n"
          f"g = 128 costs more than g = 64 here because a row of {w.shape[1]} pads to {-(-w.shape[1] // 128) * 128} "
          f"(the last group is 64 real weights + 64 copies).\n"
          "g = 32 reproduces this matrix exactly (error 0): the Q4_1 file it came from stored it on this very grid,\n"
          "and the search keeps min/max's grid wherever nothing beats it. The search minimizes the a-weighted\n"
          "error, not the plain one: it gives up a little plain error to get the costly columns right.")
    print_table(f"the whole model: layer matrices as int4 ({base.n_tokens} tokens of eval_text, windows of {context})",
                ["weights", "grid", "group", "layer matrices MB", "bits/weight", "perplexity", "Δ perplexity",
                 "quantize s"], model_rows)
    print("Same bytes, same layout, same kernel: only the (scale, min) of each group differ between the min/max\n"
          "and searched rows. Symmetric is fake-quantized (dequantized to fp32: the same numbers a kernel would\n"
          "use, not the same bytes). The Δs at g = 64/128 stay large because they round a grid that was already\n"
          "4-bit (groups of 32) a second time; only g = 32 lands on it.")
    if (128, "min/max") in ppl:   # the project's own figure (int4 g128, lessons/BENCHMARKS.md) beside yours
        print(beside_reference("cpu.perplexity.smollm2.int4", 100 * (ppl[128, "min/max"] / base.ppl - 1)))
    print(f"quantize s and the calibration time depend on the machine's load: {load_line()}")
    if exact:
        print(f"Not searched at g = {', '.join(map(str, exact))}: min/max already gives the model back (Δ +0.0%), and the\n"
              "search keeps min/max's grid wherever nothing beats it (the one-matrix table: error 0 for both).")

    def draw(ax):
        for grid, style in (("min/max", "o--"), ("searched", "o-")):
            measured = [g for g in sizes if (g, grid) in ppl]
            xs = [bits[g, grid] for g in measured]                       # the table's bits/weight, padding included
            ys = [100 * (ppl[g, grid] / base.ppl - 1) for g in measured]
            ax.plot(xs, ys, style, label=grid)
            for x, y, g in zip(xs, ys, measured):
                ax.annotate(f"g={g}", (x, y), textcoords="offset points", xytext=(5, 5))
        ax.set_xlabel("bits per weight (codes + fp16 scale and min, as in the table)"), ax.set_ylabel("Δ perplexity vs fp32 (%)")
        ax.set_title("Lesson 09: int4 group size and grid, bytes against quality (SmolLM2)")
        ax.legend(), ax.grid(alpha=0.3)
    save_plot("09_int4_groups.png", draw)


if __name__ == "__main__":
    main()
