"""Lesson 09 — int4 in groups: 16 levels per weight, a scale and a min per group, two weights per byte.

Lesson 08's int8 kept one scale per row: fine with 255 levels, hopeless with 16, because one large
weight would leave the rest of its row one or two levels. int4 therefore gives every group of g
consecutive weights of a row its own grid, and makes it asymmetric (from the group's min to its max,
scale = (max - min) / 15) so none of the 16 levels is wasted on a side of zero the group does not
reach. Smaller groups fit better and cost more: a fp16 scale and min are 32 bits per group, i.e.
+32/g bits per weight. We measure that trade on SmolLM2 (`minillm.quant.quantize_int4`), compare
it with a symmetric grid, and look at how two codes share one byte.

SmolLM2's weights come from a Q4_1 GGUF: already int4, asymmetric, in groups of 32. int4 with
g = 32 is that very grid, so it gives the weights back exactly; larger groups round them again.

Run: python lessons/09_int4_groupwise.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
import os
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # stable timings on a shared machine (lesson 08)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.course import hf_tensors, lesson_model, print_table, quick, save_plot
from minillm.evaluate import eval_text, perplexity
from minillm.llm import LLM
from minillm.model import Transformer
from minillm.quant import GROUP_SIZES, LAYER_MATRICES, pack_int4, quantize_checkpoint, quantize_int4, unpack_int4


# NEW: the symmetric int4 grid, for comparison: q in -7 .. 7, scale = max|w| / 7 per group ----------
def int4_symmetric(w: np.ndarray, group_size: int) -> np.ndarray:
    """w [out, in] -> the dequantized weights, fp32 [out, in] (the last group padded, as the engine does)."""
    out_dim, in_dim = w.shape
    padded = np.pad(w, ((0, 0), (0, -in_dim % group_size)), mode="edge")   # [out, in_padded]
    groups = padded.reshape(out_dim, -1, group_size)                        # [out, groups, g]
    scale = np.abs(groups).max(axis=-1, keepdims=True) / 7.0                # [out, groups, 1]
    q = np.clip(np.rint(groups / np.where(scale > 0, scale, 1.0)), -7, 7)   # 15 of the 16 codes
    return (q * scale).reshape(out_dim, -1)[:, :in_dim]
# ---------------------------------------------------------------------------------------------------


def rel_rms(approx: np.ndarray, w: np.ndarray) -> float:
    return float(np.sqrt(((approx - w) ** 2).mean() / (w ** 2).mean()))


def symmetric_tensors(tensors: dict, group_size: int) -> dict:
    """Every layer matrix replaced by its symmetric-int4 approximation, kept in fp32 ("fake quantized":
    the same numbers a real symmetric-int4 kernel would compute with, without writing one)."""
    out = dict(tensors)
    for name, a in tensors.items():
        if name.startswith("model.layers.") and name.removesuffix(".weight").split(".", 3)[3] in LAYER_MATRICES:
            out[name] = int4_symmetric(np.asarray(a, dtype=np.float32), group_size).astype(np.float32)
    return out


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

    # 2. One real matrix: asymmetric vs symmetric error, and bytes, per group size.
    name = "model.layers.0.mlp.up_proj.weight"
    w = np.asarray(tensors[name], dtype=np.float32)                          # [1536, 576]
    matrix_rows = []
    for g in GROUP_SIZES:
        q = quantize_int4(w, g)
        matrix_rows.append([g, f"{rel_rms(q.dequantize(), w):.4f}", f"{rel_rms(int4_symmetric(w, g), w):.4f}",
                            f"{np.abs(q.dequantize() - w).max():.2e}", f"{8 * q.nbytes / w.size:.3f}",
                            f"{q.nbytes:,}", f"{q.nbytes / w.nbytes:.1%}"])

    # 3. The whole model at each group size: bytes and perplexity.
    text = eval_text(600 if small else 4000)
    context, n_tokens = (32, 48) if small else (256, 512)
    sizes = GROUP_SIZES[::2] if small else GROUP_SIZES
    base = perplexity(llm, text, context=context, max_tokens=n_tokens)
    layer_fp32 = sum(np.asarray(tensors[f"model.layers.{i}.{m}.weight"]).nbytes
                     for i in range(cfg.n_layers) for m in LAYER_MATRICES)
    model_rows = [["fp32", "", f"{layer_fp32 / 1e6:.1f}", "32", f"{base.ppl:.3f}", ""]]
    ppl = {}
    for g in sizes:
        qcfg, qt = quantize_checkpoint(cfg, tensors, "int4", g)
        nbytes = sum(a.nbytes for k, a in qt.items() if k.endswith((".qweight", ".scales", ".mins")))
        r = perplexity(LLM(qcfg, Transformer(qcfg, qt), llm.tokenizer), text, context=context, max_tokens=n_tokens)
        ppl[g] = r.ppl
        model_rows.append([f"int4 asymmetric", g, f"{nbytes / 1e6:.1f}", f"{8 * nbytes / (layer_fp32 / 4):.3f}",
                           f"{r.ppl:.3f}", f"{100 * (r.ppl / base.ppl - 1):+.1f}%"])
    g_sym = sizes[-1]
    r = perplexity(LLM(cfg, Transformer(cfg, symmetric_tensors(tensors, g_sym)), llm.tokenizer), text,
                   context=context, max_tokens=n_tokens)
    sym_bytes = sum(rows * -(-cols // g_sym) * (g_sym // 2 + 2)                # codes + one fp16 scale a group
                    for i in range(cfg.n_layers) for m in LAYER_MATRICES
                    for rows, cols in [np.shape(tensors[f"model.layers.{i}.{m}.weight"])])
    model_rows.append(["int4 symmetric", g_sym, f"{sym_bytes / 1e6:.1f}",
                       f"{8 * sym_bytes / (layer_fp32 / 4):.3f}", f"{r.ppl:.3f}", f"{100 * (r.ppl / base.ppl - 1):+.1f}%"])

    print_table("Lesson 09 — packing two 4-bit codes in a byte (minillm.quant.pack_int4): element 2j low, 2j+1 high",
                ["byte j", "element 2j (low)", "element 2j+1 (high)", "bits high|low", "hex"], pack_rows)
    print_table(f"one real matrix, {name} {list(w.shape)}: relative RMS error by grid and group size",
                ["group", "asymmetric", "symmetric", "max |error| asym", "bits/weight", "bytes", "of fp32"],
                matrix_rows)
    print(f"bits/weight = 4 + 32/g: every group adds a fp16 scale and a fp16 min (symmetric: scale only, 4 + 16/g);\n"
          f"g = 128 costs more than g = 64 here because a row of {w.shape[1]} pads to {-(-w.shape[1] // 128) * 128} "
          f"(the last group is 64 real weights + 64 copies).\n"
          "g = 32 reproduces this matrix exactly (error 0): the Q4_1 file it came from stored it on this very grid.")
    print_table(f"the whole model: layer matrices as int4 ({base.n_tokens} tokens of eval_text, windows of {context})",
                ["weights", "group", "layer matrices MB", "bits/weight", "perplexity", "Δ perplexity"], model_rows)
    print("Symmetric is fake-quantized (dequantized to fp32: the same numbers a kernel would use, not the same\n"
          "bytes). These Δs are large because g = 64/128 round a grid that was already 4-bit (groups of 32) a second\n"
          "time; only g = 32 lands on it. Asymmetric beats symmetric at equal group size on every row above.")

    def draw(ax):
        xs = [4 + 32 / g for g in ppl]
        ax.plot(xs, [100 * (p / base.ppl - 1) for p in ppl.values()], "o-")
        for x, g in zip(xs, ppl):
            ax.annotate(f"g={g}", (x, 100 * (ppl[g] / base.ppl - 1)), textcoords="offset points", xytext=(5, 5))
        ax.set_xlabel("bits per weight (codes + fp16 scale and min)"), ax.set_ylabel("Δ perplexity vs fp32 (%)")
        ax.set_title("Lesson 09: int4 group size, bytes against quality (SmolLM2)")
        ax.grid(alpha=0.3)
    save_plot("09_int4_groups.png", draw)


if __name__ == "__main__":
    main()
