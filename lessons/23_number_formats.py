"""Lesson 23 — Low-bit number formats: fp8, NF4 and MXFP4 beside int8 and int4.

Read it after lessons 08 and 09 (int8, int4). Decode reads every weight once a token, so the bits a
weight takes set decode's speed and whether a model fits at all: GPT-OSS-120B is ~240 GB in bf16,
~120 GB in fp8 and ~65 GB in MXFP4, which is what puts it on one 80 GB GPU. int8/int4 put a row or
group on an evenly spaced grid; the formats of this lesson use *float* grids, dense near zero where
most weights are, sparse far out where few are:

  fp8 E4M3   1 sign, 4 exponent, 3 mantissa bits (largest 448), one fp32 scale per output row
  NF4        16 values at the quantiles of a normal distribution, one absmax per block of 64 (QLoRA)
  MXFP4      FP4 E2M1 elements (±0, .5, 1, 1.5, 2, 3, 4, 6), one power-of-two E8M0 scale per 32 (OCP MX)

The float types are ml_dtypes' (NumPy dtypes with correct rounding); the packing, scales and matmuls
are minillm.model.formats. This lesson draws the grids side by side, measures each format's error on a
real SmolLM2 matrix (random weights of its shape when SmolLM2 is not pulled), and measures bits per
weight against perplexity. Last, the 240 -> 120 -> 65 GB walk-through: the planner's bytes for the real
GPT-OSS-120B config.json (minillm/tools/data) in bf16, fp8 and MXFP4 experts (as it ships), checked
byte for byte on a small random GPT-OSS written in each format (the MXFP4 one then loads and runs).
Exercise 23 encodes one MXFP4 block.

Run: python lessons/23_number_formats.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lessons 08 and 09 (int8, int4)",
    ],
    "objectives": [
        "compare the value grids of int4, int8, E2M1, NF4, E4M3 and E5M2",
        "measure each format's error on a real matrix and its perplexity change",
        "encode an MXFP4 block: one power-of-two scale and 32 E2M1 codes",
        "account for GPT-OSS-120B's 240 -> 120 -> 65 GB in bytes per parameter, checked on written checkpoints",
    ],
    "study_time": "50 min, plus 25 min for exercise 23 (an MXFP4 block)",
    "check_questions": [
        "Why does a float grid suit weights that cluster near zero better than a uniform one?",
        "What does MXFP4's shared E8M0 scale cost in bits per weight?",
    ],
    "try_this": [
        "minillm generate --quant nf4 and --quant mxfp4 on the same prompt",
        "compare the bits-per-weight column with lesson 09's",
    ],
}
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # stable timings on a shared machine (lesson 08)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

import minillm
from minillm import threads
from minillm.backend import as_f32, f32_to_bf16
from minillm.checkpoints.hf_layouts import pack_gpt_oss_experts
from minillm.checkpoints.hf_quantized import translate_config
from minillm.checkpoints.weights import write_safetensors
from minillm.checkpoints.quantize import input_importance
from minillm.course.measure import beside_reference, load_line
from minillm.course import hf_tensors, lesson_model, print_table, quick, save_plot
from minillm.llm import LLM
from minillm.model import formats
from minillm.model.formats import float_grid, nf4_values
from minillm.model.quant import is_layer_matrix, quantization_entry, quantize_int4, quantize_int8
from minillm.model.quantized import quantize
from minillm.model.transformer import Transformer
from minillm.model.config import ModelConfig
from minillm.tools import planner

QUICK = quick()


# NEW: the grids, side by side ----------------------------------------------------------------------
def grids() -> dict[str, np.ndarray]:
    """Each format's values on [-1, 1] (scaled by its largest), the grid a scale then stretches."""
    e4m3, e2m1 = float_grid("e4m3"), float_grid("e2m1")
    return {"int4 (asymmetric, 16 levels)": np.linspace(-1, 1, 16),
            "int8 (255 levels)": np.arange(-127, 128) / 127,
            "E2M1 (MXFP4's element)": e2m1 / e2m1.max(),
            "NF4": nf4_values(),
            "E4M3 (fp8)": e4m3 / e4m3.max(),
            "E5M2 (fp8)": float_grid("e5m2") / float_grid("e5m2").max()}


def show_grids():
    rows = []
    for name, g in grids().items():
        positive = g[g > 0]
        near_zero = positive.min()
        rows.append([name, len(g), f"{near_zero:.2g}", f"{(positive < 0.1).sum()}",
                     " ".join(f"{v:.3g}" for v in positive[-4:])])
    print_table("Lesson 23 — the value grids, each scaled so its largest value is 1",
                ["format", "values", "smallest > 0", "values in (0, 0.1)", "the four largest"], rows)
    print("  float grids double their spacing every power of two: relative error stays constant; int grids")
    print("  keep one step: fine far out, coarse near zero, where a normal-ish weight row has most of its mass")

    def draw(ax):
        for y, (name, g) in enumerate(grids().items()):
            shown = g if len(g) <= 64 else g[np.abs(g) <= 1]
            ax.plot(shown, np.full(len(shown), y), "|", markersize=12)
        ax.set_yticks(range(len(grids())), list(grids()))
        ax.set_xlabel("value / the format's largest")
    save_plot("23_value_grids.png", draw)


# NEW: the error of each format on one real matrix -----------------------------------------------------
def quantizers() -> dict:
    return {"int8 (per row)": quantize_int8,
            "int4 g128 (min/max)": lambda w: quantize_int4(w, 128),
            "int4 g32 (min/max)": lambda w: quantize_int4(w, 32),
            "fp8 E4M3 (per row)": lambda w: formats.quantize_fp8(w, "e4m3"),
            "fp8 E5M2 (per row)": lambda w: formats.quantize_fp8(w, "e5m2"),
            "NF4 (absmax / 64)": formats.quantize_nf4,
            "MXFP4 (E8M0 / 32)": formats.quantize_mxfp4}


def matrix_errors(llm):
    layer = llm.model.layers[len(llm.model.layers) // 2]
    w = np.asarray(layer.w_down, dtype=np.float32)                           # [dim, ffn]
    if QUICK:
        w = w[:64]
    x = np.random.default_rng(0).standard_normal((8, w.shape[1])).astype(np.float32)
    rows = []
    for name, quantize in quantizers().items():
        t0 = time.perf_counter()
        q = quantize(w)
        seconds = time.perf_counter() - t0
        d = q.dequantize()
        rel = np.linalg.norm(d - w) / np.linalg.norm(w)
        out = np.linalg.norm(x @ d.T - x @ w.T) / np.linalg.norm(x @ w.T)
        rows.append([name, f"{8 * q.nbytes / w.size:.2f}", f"{100 * rel:.2f}%", f"{100 * out:.2f}%",
                     f"{np.abs(d - w).max():.2e}", f"{seconds * 1e3:.0f}"])
    print_table(f"error per format on layer {len(llm.model.layers) // 2}'s down projection {list(w.shape)} "
                f"({llm.name})", ["format", "bits/weight", "‖Ŵ - W‖ / ‖W‖", "output error (random x)",
                                  "max |Ŵ - W|", "quantize ms"], rows)
    print(f"quantize ms: one run each; {load_line()}")


def quantized(llm, tensors: dict, quant: str, group: int, importance: dict) -> LLM:
    """The model minillm.load(name, quant=quant, group_size=group) builds (quantize_checkpoint's loop:
    every layer matrix through model.quantized.quantize), from the weights already in memory.

    One shortcut: an int4 matrix that its min/max grid already gives back exactly keeps that grid
    without the seconds of search, which would keep it anyway (nothing beats an error of 0; lesson 09)."""
    out = {}
    for name, a in tensors.items():
        if not is_layer_matrix(name):
            out[name] = a
            continue
        q = quantize_int4(a, group) if quant == "int4" else None
        if q is None or not np.array_equal(q.dequantize(), np.asarray(a, dtype=np.float32)):
            q = quantize(a, quant, group, importance.get(name))
        out.update(q.tensors(name.removesuffix(".weight")))
    config = llm.config.replace(quantization=quantization_entry(quant, group))
    return LLM(config, Transformer(config, out), llm.tokenizer, name=f"{llm.name} {quant}")


# NEW: bits per weight vs perplexity ------------------------------------------------------------------
def stored_bits(llm) -> float:
    """Bits per weight as the layer matrices are stored: codes, scales and mins (and the padding of a row
    to whole groups: SmolLM2's 576-wide rows are 640 codes wide at g128) over their out x in weights."""
    bits = weights = 0
    for layer in llm.model.layers:
        for w in layer.matrices():
            if len(w.shape) != 2:
                continue                                     # the norms
            stored = w.tensors("w") if hasattr(w, "tensors") else {"w": w}
            bits += 8 * sum(a.nbytes for a in stored.values())
            weights += w.shape[0] * w.shape[1]
    return bits / weights


def bits_vs_perplexity(llm):
    from minillm.tools.evaluate import eval_text, perplexity
    text = eval_text(400 if QUICK else 6000)
    n_tokens = None if QUICK else 256          # one window of 256: 255 scored tokens a format
    methods = [(None, 128), ("mxfp4", 128)] if QUICK else [(None, 128), ("int8", 128), ("fp8", 128),
                                                           ("int4", 32), ("int4", 128), ("nf4", 128), ("mxfp4", 128)]
    tensors = hf_tensors(llm.model)
    # int4's calibration (input_importance, what load(quant="int4") runs on 2048), once for both group sizes
    calibration = 1024
    importance = input_importance(llm.config, tensors, calibration) if any(q == "int4" for q, _ in methods) else {}
    threads.fix(threads.cores())   # int4's grid search on every core; forward passes keep one BLAS thread
    rows, points, base = [], [], None
    for quant, group in methods:
        model = llm if quant is None else quantized(llm, tensors, quant, group, importance)
        r = perplexity(model, text, context=128 if QUICK else 256, max_tokens=n_tokens)
        base = base or r.ppl
        name = "fp32" if quant is None else (f"int4 g{group}" if quant == "int4" else quant)
        bits = stored_bits(model)                          # measured, not bits_per_weight's formula for one row
        rows.append([name, f"{bits:.2f}", f"{r.ppl:.3f}", f"{100 * (r.ppl / base - 1):+.2f}%", r.n_tokens])
        points.append((bits, r.ppl, name))
    print_table(f"bits per weight vs perplexity ({llm.name}, the layer matrices quantized; embedding and head "
                "as stored)", ["format", "bits/weight", "perplexity", "change", "tokens"], rows)
    changes = {row[0]: 100 * (float(row[2]) / base - 1) for row in rows}
    for name, key in (("int8", "cpu.perplexity.smollm2.int8"), ("int4 g128", "cpu.perplexity.smollm2.int4")):
        if name in changes:                          # the project's own figures (lessons/BENCHMARKS.md) beside yours
            print("  " + beside_reference(key, changes[name]))
    print("  SmolLM2's 'fp32' is its Q4_1 GGUF dequantized: int4 g32 is that very grid (exact), every other")
    print("  format rounds an already-4-bit grid a second time, so 4-bit formats look worse here than on bf16 weights")
    if importance:
        print(f"  int4's grids are searched against the activations of {calibration} random tokens (load's default: 2048)")

    def draw(ax):
        for bits, ppl, name in points:
            ax.scatter(bits, ppl)
            ax.annotate(name, (bits, ppl))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bits per weight")
        ax.set_ylabel("perplexity")
    save_plot("23_bits_vs_perplexity.png", draw)


# NEW: GPT-OSS-120B's 240 -> 120 -> 65 GB, from its config.json, checked on a small checkpoint ------------
def gpt_oss_sizes():
    """The planner's weight bytes for the real GPT-OSS-120B config in bf16, fp8 and MXFP4 experts (as it
    ships), then the same three formats written as checkpoints of a small random GPT-OSS of the same
    structure: the planner's arithmetic must give each file's tensor bytes exactly."""
    real = planner.PLANNER_ONLY["gpt-oss-120b"]
    small_json = json.loads((Path(planner.__file__).parent / "data" / "gpt-oss-120b.config.json").read_text())
    small_json |= {"hidden_size": 64, "intermediate_size": 64, "head_dim": 16, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "num_local_experts": 8, "num_hidden_layers": 2,
                   "layer_types": ["sliding_attention", "full_attention"], "vocab_size": 320}
    small = ModelConfig.from_hf(translate_config(small_json))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files = write_gpt_oss_checkpoints(small, small_json, Path(tmp))
        for fmt, label in (("bf16", "bf16"), ("fp8", "fp8 E4M3, every matrix"), ("mxfp4", "MXFP4 experts, rest bf16")):
            planned, written = planner.weight_bytes(small, fmt), tensor_bytes(files[fmt])
            rows.append([label, f"{planner.weight_bytes(real, fmt) / 1e9:.1f}",
                         f"{planner.weight_bytes(real, fmt) / real.n_params:.3f}",
                         f"{written:,}", f"{planned:,}", f"{written / small.n_params:.3f}"])
        shipped = minillm.load(str(files["mxfp4"].parent))                # the MXFP4 one runs, 4-bit experts kept
        exact = minillm.load(str(files["bf16"].parent))
        ids = list(range(1, 17))
        drift = np.abs(shipped.logits(ids) - exact.logits(ids)).max() / np.abs(exact.logits(ids)).max()
    print_table(f"GPT-OSS-120B ({real.n_params / 1e9:.2f} B parameters) by weight format: the planner on its "
                f"config.json, checked on a {small.n_params:,}-parameter GPT-OSS written in each format",
                ["format", "120B GB", "bytes/param", "small file bytes", "planner bytes", "bytes/param"], rows)
    print("  bf16: 2 bytes a parameter. fp8: 1 byte plus a 4-byte scale a row. MXFP4: half a byte plus one E8M0")
    print("  byte per 32 for the experts, which hold 98% of the parameters; attention, router, embedding and")
    print("  head stay bf16, so 4.25 bits a weight becomes ~4.5 overall. The MXFP4 file loads as shipped and runs:")
    print(f"  its logits differ from the bf16 file's by {100 * drift:.1f}% of the largest (random weights, 2 layers).")
    print("  The small model's bytes/param sit higher: its bf16 embedding and head are a larger share of it. The fp8")
    print("  file is there for its bytes (minillm loads GPT-OSS in bf16 or as shipped, MXFP4 experts).")


def write_gpt_oss_checkpoints(c: ModelConfig, config_json: dict, root: Path) -> dict[str, Path]:
    """A random GPT-OSS of config `c` as GPT-OSS ships it (HF names, experts stacked), in bf16, in fp8
    (every layer matrix E4M3 with a scale a row; minillm's fp8 layout) and with MXFP4 experts."""
    rng = np.random.default_rng(0)
    floats = {name: f32_to_bf16(0.1 * rng.standard_normal(shape).astype(np.float32))
              for name, shape in gpt_oss_shapes(c).items()}
    fp8 = {}
    for name, a in floats.items():
        matrices = [as_f32(a)] if name.endswith("proj.weight") else \
            [as_f32(w).T for w in a] if name.endswith(("gate_up_proj", "down_proj")) else None
        if matrices is None:
            fp8[name] = a
            continue
        for i, w in enumerate(matrices):                                   # [out, in] each
            q = formats.quantize_fp8(np.ascontiguousarray(w))
            fp8 |= q.tensors(f"{name.removesuffix('.weight')}.{i}")
    files = {}
    for fmt, tensors in (("bf16", floats), ("fp8", fp8), ("mxfp4", pack_gpt_oss_experts(floats))):
        (root / fmt).mkdir()
        write_safetensors(root / fmt / "model.safetensors", tensors)
        config = config_json if fmt == "mxfp4" else {k: v for k, v in config_json.items() if k != "quantization_config"}
        (root / fmt / "config.json").write_text(json.dumps(config))
        files[fmt] = root / fmt / "model.safetensors"
    return files


def gpt_oss_shapes(c: ModelConfig) -> dict[str, tuple]:
    """GPT-OSS's tensors as its checkpoints name and shape them: the experts stacked, gate/up interleaved."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.dim), "lm_head.weight": (c.vocab_size, c.dim),
              "model.norm.weight": (c.dim,)}
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        for part, out, inp in (("q", q, c.dim), ("k", kv, c.dim), ("v", kv, c.dim), ("o", c.dim, q)):
            shapes |= {f"{p}self_attn.{part}_proj.weight": (out, inp), f"{p}self_attn.{part}_proj.bias": (out,)}
        shapes |= {p + "input_layernorm.weight": (c.dim,), p + "post_attention_layernorm.weight": (c.dim,),
                   p + "self_attn.sinks": (c.n_heads,), p + "mlp.router.weight": (c.n_experts, c.dim),
                   p + "mlp.router.bias": (c.n_experts,),
                   p + "mlp.experts.gate_up_proj": (c.n_experts, c.dim, 2 * c.moe_ffn_dim),
                   p + "mlp.experts.gate_up_proj_bias": (c.n_experts, 2 * c.moe_ffn_dim),
                   p + "mlp.experts.down_proj": (c.n_experts, c.moe_ffn_dim, c.dim),
                   p + "mlp.experts.down_proj_bias": (c.n_experts, c.dim)}
    return shapes


def tensor_bytes(path: Path) -> int:
    """A safetensors file's tensor bytes: its size less the 8-byte length and the JSON header."""
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return path.stat().st_size - 8 - header


if __name__ == "__main__":
    show_grids()
    llm = lesson_model()
    matrix_errors(llm)
    if llm.name.startswith("random:"):
        print("bits per weight vs perplexity skipped: random weights have no perplexity worth comparing (pull smollm2-135m)")
    else:
        bits_vs_perplexity(llm)
    gpt_oss_sizes()
