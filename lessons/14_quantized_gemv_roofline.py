"""Lesson 14 — quantized GEMV kernels and the roofline: int8 and int4 weights, dequantized in registers.

Decode at batch 1 reads every weight once per token and does two FLOPs with it, so it sits at the far
left of the roofline: ~1 FLOP per byte in fp16, where an H200 (4.25 TB/s copy, ~990 TFLOP/s of fp16
tensor math) is idle 99.9% of its arithmetic time. The only lever is bytes: int8 (lesson 08) halves
them, int4 in groups of 128 (lesson 09) cuts them to 0.53 bytes a weight. Lessons 08 and 09 showed
that NumPy cannot cash that in: it widens the codes to fp32 in memory first. A GPU kernel can, if it
widens them in registers, right after a 16-byte load, cheaply enough that the arithmetic keeps up with
the memory: at 4 TB/s, int4 is 8·10¹² weights a second, a quarter of the H200's instruction issue rate.

kernels/gemv_quant.cu does it with two tricks this lesson reproduces in NumPy: a 4-bit (or 8-bit) code
OR-ed under the exponent bits of the fp16 number 1024 reads as 1024 + code, and one f16x2 subtract (or
fused multiply-add) turns two of them into exact small floats at once; and the int4 group's min costs
one FMA per 32 weights, since Σ (q·s + m)·x = s·Σ q·x + m·Σ x. Then we count bytes per token for each
format, and, on a GPU, measure fp16/int8/int4 GEMVs on Mistral-7B's matrices and whole-model decode,
and put the measured points on the H200 roofline (lessons/out/14_roofline.png).

Run: python lessons/14_quantized_gemv_roofline.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 03 (the roofline)",
        "lessons 08-09 (int8, int4)",
        "lesson 13 (launches)",
    ],
    "objectives": [
        "compute bytes per token and roofline tok/s for fp16, int8 and int4",
        "count the instructions per weight a kernel may spend under the memory stream",
        "reproduce the kernel's magic-number dequantization in NumPy, exactly",
    ],
    "study_time": "60 min, plus 30 min for exercise 14 (int4 as 32-bit words)",
    "check_questions": [
        "Where does batch-1 decode sit on the roofline, and what is its only lever?",
        "Why does int4 pay only if the codes become floats in registers in two or three instructions?",
    ],
    "try_this": [
        "python -m minillm.cuda.dev.qfloor on a GPU",
        "compare your GPU's tok/s with the reference figures (lessons/BENCHMARKS.md)",
    ],
}
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.model.config import PRESETS
from minillm.course import print_table, quick, run_gpu_parts, save_plot
from minillm.model.quant import quantize_int4, quantize_int8, unpack_int4

# Quoted from lessons/BENCHMARKS.md (H200, 2026-11-29) for the CPU-only estimate; the GPU parts measure.
QUOTED_COPY_BW = 4.25e12          # bytes/s, device-to-device copy (read + write)
H200_TENSOR_FP16 = 989e12         # FLOP/s, dense fp16 tensor cores (datasheet)
H200_FP32 = 67e12                 # FLOP/s, fp32 FMA on the CUDA cores (datasheet)
H200_ISSUE = 132 * 4 * 32 * 1.98e9    # thread-instructions/s: 132 SMs x 4 schedulers x 32 lanes x 1.98 GHz
# Instructions per weight in the inner loops (count them in kernels/gemv.cu and gemv_quant.cu v2, the one
# the decode step runs; x is staged in fp16, the products run two at a time in f16x2, and each 16-byte
# chunk's partial sum is widened to fp32 once):
#   fp16: widen (cvt) + FMA = 2;  int8: per 4 weights 1 XOR + 2 byte-permutes + 2 f16x2 subtracts + 2 HFMA2
#   = 7;  int4: per 8 weights 1 shift + 4 LOP3s + 4 f16x2 ops + 4 HFMA2 = 13
INSTR_PER_WEIGHT = {"fp16": 2.0, "int8": 7 / 4, "int4-g128": 13 / 8}
# ... and what the compiler made of them: the main loop of gemv_quant.cu v2's SASS (cuobjdump, sm_90, H200
# machine 2026-11-29) over the weights it handles: branches, addresses, x loads and the group's scale on top
# (v1, fp32 products with one widening per weight, took 1065/256 and 1330/256)
SASS_INSTR_PER_WEIGHT = {"int8": 715 / 256, "int4-g128": 752 / 256}
RESULTS = {}                      # what the GPU parts measured, for the plot
TMA_SETTINGS = {"quant_version": 4, "wide_tma": True}   # the lab's dev/kernels/gemv_quant_tma.cu, every format


# ---- bytes per token ------------------------------------------------------------------------------
def layer_matrix_params(cfg) -> list[tuple[int, int]]:
    hd = cfg.head_dim
    return [((cfg.n_heads + 2 * cfg.n_kv_heads) * hd, cfg.dim), (cfg.dim, cfg.n_heads * hd),
            (2 * cfg.ffn_dim, cfg.dim), (cfg.dim, cfg.ffn_dim)]


def bytes_per_token(cfg, fmt: str) -> int:
    """Weights one decode step reads: layer matrices as stored, the fp16 LM head, fp32 norms (what
    GPUTransformer.weight_bytes counts; the KV cache comes on top and is small at short contexts)."""
    total = 0
    for rows, cols in layer_matrix_params(cfg):
        if fmt == "fp16":
            total += 2 * rows * cols
        elif fmt == "int8":
            total += rows * (-(-cols // 16) * 16) + 4 * rows                    # codes + an fp32 scale a row
        else:
            g = int(fmt.split("-g")[1])
            groups = -(-cols // g)
            total += rows * groups * g // 2 + 2 * 2 * rows * groups              # codes + fp16 scale and min
    return cfg.n_layers * (total + 2 * 4 * cfg.dim) + 2 * cfg.vocab_size * cfg.dim + 4 * cfg.dim


# NEW: the kernel's dequantization, in NumPy -------------------------------------------------------
def f16x2(words: np.ndarray) -> np.ndarray:
    """uint32 words -> their two fp16 halves as float32, [..., 2] (low half first, as the GPU sees them)."""
    return words.astype("<u4").view(np.float16).reshape(*words.shape, 2).astype(np.float32)


def int4_codes_by_magic(words: np.ndarray) -> np.ndarray:
    """uint32 [rows, n] (8 codes a word, nibble i = element i) -> codes [rows, 8n] as float32, the way
    gemv_quant.cu's dot8_i4 makes them: OR 0x6400 (fp16 1024) over a masked nibble, then subtract 1024
    (low nibbles) or scale by 1/16 and subtract 64 (high nibbles, which read 1024 + 16·code)."""
    magic = np.uint32(0x64006400)
    out = np.empty((*words.shape, 8), np.float32)
    for shift, (lo, hi) in ((0, (0, 1)), (8, (2, 3))):                         # the kernel's w >>= 8
        w = words >> np.uint32(shift)
        n_lo = f16x2((w & np.uint32(0x000F000F)) | magic) - 1024.0             # (n0, n4) or (n2, n6)
        n_hi = f16x2((w & np.uint32(0x00F000F0)) | magic) / 16.0 - 64.0        # (n1, n5) or (n3, n7)
        out[..., lo], out[..., lo + 4] = n_lo[..., 0], n_lo[..., 1]
        out[..., hi], out[..., hi + 4] = n_hi[..., 0], n_hi[..., 1]
    return out.reshape(words.shape[0], -1)


def int8_codes_by_magic(words: np.ndarray) -> np.ndarray:
    """uint32 [rows, n] (4 int8 codes a word) -> codes [rows, 4n] as float32, like dot4_i8: flip each
    sign bit (b + 128), put the byte under 0x64 (fp16 1024 + byte), subtract 1152."""
    u = words ^ np.uint32(0x80808080)
    bytes_ = [(u >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)]
    b02 = f16x2(bytes_[0] | (np.uint32(0x64) << 8) | (bytes_[2] << 16) | (np.uint32(0x64) << 24)) - 1152.0
    b13 = f16x2(bytes_[1] | (np.uint32(0x64) << 8) | (bytes_[3] << 16) | (np.uint32(0x64) << 24)) - 1152.0
    return np.stack([b02[..., 0], b13[..., 0], b02[..., 1], b13[..., 1]], axis=-1).reshape(words.shape[0], -1)
# ---------------------------------------------------------------------------------------------------


def check_magic(rows: int, cols: int) -> list[list]:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    q4 = quantize_int4(w, 128)
    got4 = int4_codes_by_magic(q4.qweight.view("<u4"))
    q8 = quantize_int8(w)
    got8 = int8_codes_by_magic(q8.qweight.view("<u4"))
    # the min folded out of the sum: s·Σq·x + m·Σx over each group equals Σ (q·s + m)·x
    x = rng.standard_normal(q4.qweight.shape[1] * 2).astype(np.float64)
    x[cols:] = 0.0                                                             # padded columns meet x = 0
    g = q4.group_size
    codes = unpack_int4(q4.qweight).astype(np.float64).reshape(rows, -1, g)
    folded = (q4.scales * (codes * x.reshape(-1, g)).sum(-1) + q4.mins * x.reshape(-1, g).sum(-1)).sum(-1)
    direct = q4.dequantize().astype(np.float64) @ x[:cols]
    return [["int4: magic-number codes vs unpack_int4", f"{np.abs(got4 - unpack_int4(q4.qweight)).max():.0f}",
             f"{got4.size:,} codes"],
            ["int8: magic-number codes vs the int8 codes", f"{np.abs(got8 - q8.qweight).max():.0f}",
             f"{got8.size:,} codes"],
            ["int4: s·Σq·x + m·Σx vs Σ(q·s+m)·x (relative)",
             f"{np.abs(folded - direct).max() / np.abs(direct).max():.1e}", f"{rows} rows, groups of {g}"]]


# ---- on a GPU ---------------------------------------------------------------------------------------
def gpu_gemvs(cfg) -> None:
    from minillm.cuda.dev.gemv import gemv_points
    from minillm.cuda.timing import copy_bandwidth, device_name
    RESULTS["gpu"] = device_name()                 # the plot's title names the card it measured
    bw = RESULTS["copy_bw"] = copy_bandwidth(1 << 30)
    print(f"device-to-device copy: {bw / 1e12:.2f} TB/s (read + write), the memory roof")
    points = RESULTS["gemv"] = gemv_points(cfg, ("float16", "int8", "int4"))
    rows = []
    for fmt, name, (r, c), nbytes, us in points:
        rows.append([{"float16": "fp16"}.get(fmt, fmt), name, f"{r}x{c}", f"{nbytes / 1e6:.1f}", f"{us:.1f}",
                     f"{nbytes / us / 1e3:.0f}", f"{100 * nbytes / (us * 1e-6) / bw:.0f}%",
                     f"{2 * r * c / nbytes:.2f}"])
    print_table("one GEMV y = W·x (no fusion), in a CUDA graph over copies that do not fit in L2",
                ["format", "matrix", "shape", "MB", "µs", "GB/s", "% copy", "FLOP/byte"], rows)
    # the same matrices with the weights streamed into shared memory by the TMA (the lab's gemv_quant_tma.cu)
    tma = RESULTS["gemv_tma"] = gemv_points(cfg, ("float16", "int8", "int4"), settings=TMA_SETTINGS)
    rows = []
    for (fmt, name, (r, c), nbytes, us), (_, _, _, _, us_tma) in zip(points, tma):
        rows.append([{"float16": "fp16"}.get(fmt, fmt), name, f"{us:.1f}", f"{us_tma:.1f}",
                     f"{100 * nbytes / (us * 1e-6) / bw:.0f}%", f"{100 * nbytes / (us_tma * 1e-6) / bw:.0f}%"])
    print_table("the same GEMVs, weights streamed by the TMA (a producer warp, a ring of stages; not the default)",
                ["format", "matrix", "µs", "µs, TMA", "% copy", "% copy, TMA"], rows)


def gpu_models(cfg, n_new: int) -> None:
    """Decode tok/s of each format with the engine's step, and with the step as it was before programmatic
    dependent launch (settings.pdl off: each kernel waits for the last one to drain before it starts)."""
    import cupy as cp
    from minillm.cuda.timing import decode_tok_s
    from minillm.cuda.dev.lab import LabTransformer
    from minillm.cuda.gpu_model import GPUTransformer
    bw = RESULTS.get("copy_bw", QUOTED_COPY_BW)
    rows, RESULTS["model"], RESULTS["model_before"] = [], [], []
    for fmt, quant in (("fp16", None), ("int8", "int8"), ("int4-g128", "int4")):
        gpu = GPUTransformer.random(cfg, "float16", seed=0, quant=quant)
        cache = gpu.new_cache(n_new + 32)
        before, _ = decode_tok_s(gpu.with_settings(pdl=False), cache, np.arange(1, 17), n_new)
        tps, _ = decode_tok_s(gpu, cache, np.arange(1, 17), n_new)         # greedy, the CUDA graph
        streamed, _ = decode_tok_s(LabTransformer.of(gpu, **TMA_SETTINGS), cache, np.arange(1, 17), n_new)
        nbytes = gpu.weight_bytes
        RESULTS["model"].append((fmt, nbytes, tps))
        RESULTS["model_before"].append((fmt, nbytes, before))
        RESULTS.setdefault("model_tma", []).append((fmt, nbytes, streamed))
        rows.append([fmt, f"{nbytes / 1e9:.3f}", f"{before:.1f}", f"{tps:.1f}", f"{tps / before:.2f}x",
                     f"{nbytes * tps / 1e9:.0f}", f"{100 * nbytes * tps / bw:.0f}%", f"{bw / nbytes:.0f}",
                     f"{streamed:.1f}"])
        del gpu, cache
        cp.get_default_memory_pool().free_all_blocks()
    print_table(f"whole-model decode, batch 1, CUDA graph, {n_new} tokens after 16 (random weights); 'no PDL': "
                "each kernel waits for the one before to drain",
                ["weights", "GB/token", "tok/s no PDL", "tok/s", "PDL gain", "GB/s", "% copy", "roofline tok/s",
                 "tok/s, TMA GEMVs"], rows)


def draw_roofline(ax, cfg) -> None:
    bw = RESULTS.get("copy_bw", QUOTED_COPY_BW)
    x = np.logspace(-1, 3.5, 200)
    ax.loglog(x, np.minimum(bw * x, H200_TENSOR_FP16) / 1e12, "k-", lw=1.5,
              label=f"roof: {bw / 1e12:.2f} TB/s copy, {H200_TENSOR_FP16 / 1e12:.0f} TFLOP/s fp16 tensor")
    ax.loglog(x, np.minimum(bw * x, H200_FP32) / 1e12, "k:", lw=1, label=f"fp32 CUDA cores, {H200_FP32 / 1e12:.0f} TFLOP/s")
    colors = {"float16": "tab:blue", "fp16": "tab:blue", "int8": "tab:orange", "int4": "tab:green",
              "int4-g128": "tab:green"}
    for fmt, name, (r, c), nbytes, us in RESULTS.get("gemv", []):
        ax.plot(2 * r * c / nbytes, 2 * r * c / (us * 1e-6) / 1e12, "o", color=colors[fmt], ms=5, alpha=0.8)
    for fmt, name, (r, c), nbytes, us in RESULTS.get("gemv_tma", []):          # the TMA-streamed kernels: hollow
        ax.plot(2 * r * c / nbytes, 2 * r * c / (us * 1e-6) / 1e12, "s", mfc="none", color=colors[fmt], ms=6)
    params = sum(r * c for r, c in layer_matrix_params(cfg)) * cfg.n_layers + cfg.vocab_size * cfg.dim
    for fmt, nbytes, tps in RESULTS.get("model_before", []):           # the previous step: hollow
        ax.plot(2 * params / nbytes, 2 * params * tps / 1e12, "*", mfc="none", color=colors[fmt], ms=14,
                label=f"{fmt} decode without PDL: {tps:.0f} tok/s")
    for fmt, nbytes, tps in RESULTS.get("model", []):
        ax.plot(2 * params / nbytes, 2 * params * tps / 1e12, "*", color=colors[fmt], ms=14, mec="k",
                label=f"{fmt} decode: {tps:.0f} tok/s")
    if "model" not in RESULTS:                                 # no GPU: where each format would sit
        for fmt in ("fp16", "int8", "int4-g128"):
            nbytes = bytes_per_token(cfg, fmt)
            ax.plot(2 * params / nbytes, 2 * params * bw / nbytes / 1e12, "*", mfc="none", color=colors[fmt],
                    ms=14, label=f"{fmt} decode at the roof (not measured: no GPU)")
    if RESULTS.get("gemv_tma"):
        ax.plot([], [], "s", mfc="none", color="gray", label="GEMVs with the weights streamed by the TMA (not kept)")
    for fmt in ("float16", "int8", "int4"):
        if any(p[0] == fmt for p in RESULTS.get("gemv", [])):
            ax.plot([], [], "o", color=colors[fmt], label=f"{'fp16' if fmt == 'float16' else fmt} GEMVs (4 matrices)")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of weights read)")
    ax.set_ylabel("TFLOP/s")
    measured_on = RESULTS.get("gpu", "H200 (quoted bandwidth, nothing measured)")
    ax.set_title(f"{measured_on} roofline: batch-1 decode, Mistral-7B shape")
    ax.set_xlim(0.1, 3000)
    ax.grid(True, which="both", alpha=0.2)
    ax.legend(fontsize=7, loc="upper left")


def main():
    small = quick()
    cfg = PRESETS["mistral-7b"].config
    fmts = ["fp16", "int8", "int4-g128", "int4-g32"]
    rows = []
    for fmt in fmts:
        nbytes = bytes_per_token(cfg, fmt)
        weights_s = QUOTED_COPY_BW / nbytes * cfg.n_params
        key = "int4-g128" if fmt.startswith("int4") else fmt
        instr, sass = INSTR_PER_WEIGHT[key], SASS_INSTR_PER_WEIGHT.get(key)
        rows.append([fmt, f"{8 * nbytes / cfg.n_params:.2f}", f"{nbytes / 1e9:.2f}", f"{QUOTED_COPY_BW / nbytes:.0f}",
                     f"{weights_s / 1e12:.1f}", f"{instr:.2f}", f"{100 * weights_s * instr / H200_ISSUE:.0f}%",
                     f"{sass:.1f}" if sass else "-", f"{100 * weights_s * sass / H200_ISSUE:.0f}%" if sass else "-"])
    print_table(f"Lesson 14 — bytes/token and the roofline, Mistral-7B shape ({cfg.n_params / 1e9:.2f} B parameters, "
                f"LM head fp16), at the quoted H200 copy bandwidth {QUOTED_COPY_BW / 1e12:.2f} TB/s",
                ["weights", "bits/weight", "GB/token", "roofline tok/s", "Tweights/s", "instr/weight",
                 "% of issue rate", "SASS instr/weight", "% (SASS)"], rows)
    print("'% of issue rate' is the arithmetic the kernel must fit under the memory stream at the roof: int4\n"
          "streams a weight per ~4 instruction slots of the whole chip. The first kernel (v1: one fp16->fp32\n"
          "widening and one fp32 FMA per weight) compiled to ~5 per weight: more than the roof allows, so it\n"
          "was bound by instruction issue. v2 multiplies in f16x2 (two weights an instruction) and widens once\n"
          "per 16-byte chunk: ~3 per weight compiled (the SASS columns), under the roof. What keeps int4 below\n"
          "its roofline now is the small matrices' fixed cost per launch (~8-12 us: launch, staging x, one\n"
          "memory round trip) and loads that still wait for the arithmetic (lessons/BENCHMARKS.md).\n"
          "What was tried after v2 (programmatic dependent launch, L2 prefetches, int8's q|k|v grid in one\n"
          "round, the weights streamed into shared memory by the TMA) and what each measured is the project's\n"
          "history: lessons/BENCHMARKS_HISTORY.md. The engine ships gemv_quant.cu v2 and gemv.cu v4; the GPU\n"
          "parts below also run the TMA version from the laboratory (minillm/cuda/dev/lab.py) beside them.")

    print_table("the kernel's dequantization, reproduced in NumPy (0 = exact)", ["check", "max |difference|", "over"],
                check_magic(8 if small else 64, 576 if small else 4096))

    gpu_cfg = PRESETS["smollm2-135m"].config if small else cfg
    failed = run_gpu_parts([
        ("fp16 / int8 / int4 GEMV on each layer matrix: µs, GB/s, % of copy bandwidth",
         lambda: gpu_gemvs(gpu_cfg)),
        ("whole-model decode tok/s: fp16 vs int8 vs int4 (random weights, CUDA graph)",
         lambda: gpu_models(gpu_cfg, 16 if small else 128)),
    ])
    if small and "gemv" in RESULTS:
        print("quick run: the GPU parts used SmolLM2's shape; run without MINILLM_LESSON_QUICK for Mistral-7B")
    save_plot("14_roofline.png", lambda ax: draw_roofline(ax, gpu_cfg))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
