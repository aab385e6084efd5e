"""Where a quantized decode GEMV's time goes, and variants of its staging, prefetch and occupancy: gemv_quant.cu
v2 against compiles of its own source with one thing changed.

Each variant is the kernel's source text (variant_source: a part edited out) compiled with some of its
#defines changed, launched by the same launcher (its functions swapped into a copy of Kernels):

    no staging   x is not staged in shared memory (every block's read of x, its fp16 scaling and the barrier
                 gone; the products run on whatever shared memory holds): the cost of staging
    no math      each chunk's products replaced by an XOR of its loaded words (the loads stay): the cost of
                 the arithmetic
    neither      both: what is left is the launch, the weight stream, the reductions and the epilogue
    16 warps     Q_WARPS 16, Q_MIN_BLOCKS 1: the same warps an SM in half the blocks, so x is staged half as
                 often (132 times a GEMV instead of 264), each block's staging shared by twice the threads
    batched      Q_STAGE_BATCH 4: each thread loads 64 values of x (4 int8 or 2 int4 chunks) before converting
                 any, instead of one chunk's L2 round trip after the other
    16 + batched both
    no prefetch  the first row pair's L2 prefetch before the staging left out
    3 blocks     Q_MIN_BLOCKS 3 with int8's steps halved (Q_U8 4: 72 registers instead of 114, no spills):
                 24 warps an SM instead of 16
    3 blocks qkv only  the same build for the q|k|v GEMV alone (its launches 3 blocks an SM, the others as v2):
                 its 3072 Mistral-7B row pairs are 384 blocks, one round of the 396 slots 3 blocks an SM give,
                 where 2 an SM give 192 blocks two rounds of 2 pairs a warp (a quarter of 264 slots idle). Since
                 2026-12-02 int8's shipped build (gemv_quant.cu's _3b kernels): here it measures int4 (int8
                 against the 2-blocks build: dev.ab --set qkv_one_round=False). The per-matrix table times plain
                 y = W·x, which stays v2's here: "3 blocks" shows the qkv shape
    int4 U=8     Q_U4 8: twice int4's chunks a lane in flight, half the dependent steps (down: 3.5 -> 1.75)
    int4 4 blocks  Q_U4 2, Q_MIN_BLOCKS 4 (64 registers): 32 warps an SM, the same bytes in flight
                 (int8 spills at 64 registers: read its int4 rows only)
    prefetch rows  Q_PREFETCH_CHUNKS 0: the first pair's whole rows prefetched into L2 before the staging (v2
                 until 2026-12-02; now a row's first 128 chunks: int8 down's first round of whole rows, 60 MB,
                 is more than the 50 MB L2); "prefetch 256" its first 256 chunks

The first three are wrong by design (timing only); the others compute what v2 computes and are checked
against NumPy first (qmma's cases: every epilogue, odd widths, Mistral-7B's matrices). `python -m
minillm.cuda.dev.qfloor [--decode]`: those checks, µs a launch in a CUDA graph per Mistral-7B matrix
(qmma.matrix_us), then (--decode) batch-1 decode tok/s of a random Mistral-7B with each. Importing this module
does not import CuPy (tests/test_qfloor.py compiles the variants with nvcc on the CPU).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import re
import sys

SOURCE = "gemv_quant"
STAGE = "float ss = F::template stage<NORM>(x, gain, in, n_chunks, smem);"
# the products of one int8 chunk (two rows) and of one int4 chunk, as written in Int8RowsH / Int4RowsH::dot
INT8_MATH = (r"const uint4\* x4 = reinterpret_cast<const uint4\*>\(xh \+ i \* XW\);\s*uint4 x0 = x4\[0\], x1 = x4\[1\];"
             r".*?b = fmaf\(f16x2_sum\(pb\), down, b\);")
INT4_MATH = (r"const uint4\* x4 = reinterpret_cast<const uint4\*>\(xh \+ i \* XW\);\s*unsigned int pa = 0u, pb = 0u;"
             r"\s*uint4 xq = x4\[0\];.*?fmaf\(F16::to_float\(m_b\[u\]\), X, acc_b\)\);")
XOR = "unsigned int pa = va[u].x ^ va[u].y ^ va[u].z ^ va[u].w, pb = vb[u].x ^ vb[u].y ^ vb[u].z ^ vb[u].w;\n"
ONE = "__uint_as_float((p{r} & 0x007fffffu) | 0x3f800000u)"          # a float in [1, 2) from the words' bits
INT8_XOR = XOR + f"a += {ONE.format(r='a')}; b += {ONE.format(r='b')};"
INT4_XOR = XOR + (f"acc_a += {ONE.format(r='a')} + F16::to_float(s_a[u]) + F16::to_float(m_a[u]);\n"
                  f"acc_b += {ONE.format(r='b')} + F16::to_float(s_b[u]) + F16::to_float(m_b[u]);")
FIRST_PREFETCH = "prefetch_pair<EPI, F::CHUNK_SUMS>(first, pairs, rows, ep.hd, qw, n_chunks, scales, mins, n_groups);"
WIDE = {"Q_WARPS": 16, "Q_MIN_BLOCKS": 1}
BATCHED = {"Q_STAGE_BATCH": 4}
# label -> (edits for variant_source, #defines); all but the first three compute what v2 computes
VARIANTS = {"no staging": (dict(no_stage=True), {}), "no math": (dict(no_math=True), {}),
            "neither": (dict(no_stage=True, no_math=True), {}), "16 warps": ({}, WIDE),
            "batched": ({}, BATCHED), "16 + batched": ({}, {**WIDE, **BATCHED}),
            "no prefetch": (dict(no_prefetch=True), {}), "3 blocks": ({}, {"Q_MIN_BLOCKS": 3, "Q_U8": 4}),
            "3 blocks qkv only": ({}, {"Q_MIN_BLOCKS": 3, "Q_U8": 4}),
            "int4 U=8": ({}, {"Q_U4": 8}), "int4 4 blocks": ({}, {"Q_U4": 2, "Q_MIN_BLOCKS": 4}),
            "prefetch rows": ({}, {"Q_PREFETCH_CHUNKS": 0}), "prefetch 256": ({}, {"Q_PREFETCH_CHUNKS": 256})}
EXACT = [label for label in VARIANTS if label not in ("no staging", "no math", "neither")]
ONLY = {"3 blocks qkv only": "qkv"}     # label -> the kernels (names containing it) the variant swaps; others: all


def _replace_once(text: str, pattern: str, new: str, regex: bool = False) -> str:
    """text with `pattern` replaced by `new`; the pattern must occur exactly once (or the kernel changed)."""
    found = len(re.findall(pattern, text, re.S)) if regex else text.count(pattern)
    if found != 1:
        raise ValueError(f"gemv_quant.cu no longer has exactly one {pattern[:60]!r} ({found}): update qfloor.py")
    return re.sub(pattern, lambda _: new, text, flags=re.S) if regex else text.replace(pattern, new)


def variant_source(no_stage: bool = False, no_math: bool = False, no_prefetch: bool = False) -> str:
    """gemv_quant.cu (includes pasted) with x's staging skipped and/or the products replaced by an XOR of the
    loaded words, and/or without the first row pair's L2 prefetch."""
    from minillm.cuda.kernels import kernel_source
    text = kernel_source(SOURCE)
    if no_prefetch:
        text = _replace_once(text, FIRST_PREFETCH, "/* no prefetch before the staging */")
    if no_stage:
        text = _replace_once(text, STAGE, "float ss = 1.0f;")
    if no_math:
        text = _replace_once(text, INT8_MATH, INT8_XOR, regex=True)
        text = _replace_once(text, INT4_MATH, INT4_XOR, regex=True)
    return text


def compile_options(defines: dict) -> tuple:
    """NVRTC / nvcc options for a variant: C++17 and its -D NAME=VALUE."""
    return ("--std=c++17",) + tuple(f"-D{name}={value}" for name, value in defines.items())


QUANT_KERNELS = re.compile(r"gemv_(rmsnorm_)?(swiglu_|qkv_)?int[48](_3b)?$")  # Kernels.fn's v2 quantized GEMVs


class Swapped:
    """Kernels k with its v2 quantized GEMVs from another compile of gemv_quant.cu (`source`, `defines`),
    launched with its Q_WARPS warps a block (the launcher's QWARPS, set around each call) and Q_MIN_BLOCKS
    blocks an SM. Every other attribute is k's, its calls made under the same setting (so dev.gemv's checks
    run on it as on a Kernels). only: swap just the kernels whose names contain it, the others launch as in k."""

    def __init__(self, k, source: str, defines: dict, only: str | None = None):
        import cupy as cp
        from minillm.cuda import kernels
        self._kernels = kernels
        self.warps = defines.get("Q_WARPS", kernels.QWARPS)
        mod = cp.RawModule(code=source, options=compile_options(defines))
        swapped = copy.copy(k.with_settings(
            quant_blocks_per_sm=defines.get("Q_MIN_BLOCKS", kernels.QUANT_BLOCKS_PER_SM)))
        swapped.fn = dict(k.fn)
        for name in swapped.fn:
            if QUANT_KERNELS.match(name) and (only is None or only in name):
                f = swapped.fn[name] = mod.get_function(f"{name}_{kernels.suffix(k.dtype)}")
                f.max_dynamic_shared_size_bytes = k.max_quant_smem
        self.k = swapped if only is None else _routed(k, swapped, only)

    def __enter__(self):
        self._saved, self._kernels.QWARPS = self._kernels.QWARPS, self.warps

    def __exit__(self, *exc):
        self._kernels.QWARPS = self._saved

    def __getattr__(self, name):
        if name == "k":                                  # not set yet: no recursion through self.k
            raise AttributeError(name)
        attr = getattr(self.k, name)
        if not callable(attr):
            return attr

        def under_setting(*args, **kwargs):
            with self:
                return attr(*args, **kwargs)
        return under_setting


def _routed(k, swapped, only: str):
    """A copy of Kernels k whose quantized GEMVs named with `only` launch as `swapped` does (its functions and
    grid); the rest as k."""
    from minillm.cuda.kernels import Kernels
    routed = copy.copy(k)
    routed.fn = dict(k.fn)

    def launch(name, *args, **kwargs):                  # Kernels._quant's arguments
        return Kernels._quant(swapped if only in name else routed, name, *args, **kwargs)
    routed._quant = launch
    return routed


def versions(k, labels=None) -> dict:
    """{label: Kernels or Swapped}: v2 and each variant (those named in `labels`, or all)."""
    out = {"v2": k}
    for label, (edits, defines) in VARIANTS.items():
        if labels is None or label in labels:
            out[label] = Swapped(k, variant_source(**edits), defines, ONLY.get(label))
    return out


def cases(kinds: dict) -> list:
    """(label, check) pairs for the variants that compute what v2 computes: qmma's v2-shaped cases (its U = 4
    ones are v3's own)."""
    from minillm.cuda.dev import qmma
    checks = dict(qmma._cases())
    return [(f"{v} {label}", lambda v=v, label=label: checks[label](kinds[v]))
            for v in EXACT if v in kinds for label in qmma.CASE_LABELS if "U=4" not in label]


def timings(kinds: dict) -> list[list]:
    """Each Mistral-7B matrix, int8 and int4, under each version: µs a launch in a CUDA graph (% of copy)."""
    from minillm.cuda.dev import qmma
    from minillm.cuda.dev.common import plain_table
    from minillm.cuda.timing import copy_bandwidth
    bw = copy_bandwidth(1 << 30)
    table = []
    for method in ("int8", "int4"):
        for name, (rows, n_in) in qmma._mistral_shapes().items():
            us, nbytes = qmma.matrix_us(kinds, method, rows, n_in)
            table.append([method, name, f"{nbytes / 1e6:.1f}", f"{nbytes / bw * 1e6:.1f}"]
                         + [f"{us[v]:.1f} ({nbytes / (us[v] * 1e-6) / bw:.0%})" for v in kinds])
    plain_table(f"µs a launch in a CUDA graph (% of the {bw / 1e12:.2f} TB/s copy); 'bytes' = at the copy rate",
                ["method", "matrix", "MB", "bytes µs"] + list(kinds), table)
    return table


def decode(kinds: dict, n_new: int = 128, prompt_len: int = 16, rounds: int = 3) -> list[list]:
    """Batch-1 decode tok/s of a random Mistral-7B (int8, int4) with the CUDA graph under each version: the
    median of `rounds` alternating rounds (the same-run A/B)."""
    from minillm.cuda.dev import qmma
    from minillm.cuda.dev.common import TARGETS, alternating_medians, plain_table
    from minillm.cuda.timing import decode_tok_s
    table = []
    for method, gpu, cache, prompt in qmma.quantized_mistrals(prompt_len, n_new):
        models = {}
        for label, kv in kinds.items():
            model = copy.copy(gpu)                        # its own decode graph (the graph key holds the model)
            model.k = kv.k if isinstance(kv, Swapped) else kv
            models[label] = (model, kv if isinstance(kv, Swapped) else contextlib.nullcontext())

        def measure(pair):
            model, setting = pair
            with setting:
                return decode_tok_s(model, cache, prompt, n_new)[0]
        tps = alternating_medians(models, measure, rounds)
        table.append([method, TARGETS[method]] + [f"{tps[label]:.1f} ({tps[label] / tps['v2']:.3f}x)" for label in kinds])
    plain_table(f"decode tok/s, random Mistral-7B, batch 1, {n_new} new tokens, CUDA graph, median of {rounds} "
                f"alternating rounds (vs v2)", ["method", "H200 target"] + list(kinds), table)
    return table


def main(argv=None) -> int:
    from minillm.cuda.dev.common import finish, guarded, require_gpu, verdict
    from minillm.cuda.kernels import Kernels
    ap = argparse.ArgumentParser(prog="python -m minillm.cuda.dev.qfloor", description=__doc__.split("\n")[0])
    ap.add_argument("--decode", action="store_true", help="also decode tok/s of a random Mistral-7B with each")
    ap.add_argument("--rounds", type=int, default=3, help="--decode: alternating rounds (median)")
    ap.add_argument("--variants", help="comma-separated labels to measure (default: all): " + ", ".join(VARIANTS))
    args = ap.parse_args(argv)
    labels = None if args.variants is None else [v.strip() for v in args.variants.split(",")]
    unknown = sorted(set(labels or ()) - set(VARIANTS))
    if unknown:
        print(f"qfloor: no variant {', '.join(unknown)} (there are: {', '.join(VARIANTS)})", file=sys.stderr)
        return 2
    if not require_gpu("qfloor"):
        return 2
    kinds = versions(Kernels("float16"), labels)
    for label, check in cases(kinds):
        def one(label=label, check=check):
            err, tol = check()
            verdict(label, err <= tol, f"err {err:.2e}  tol {tol:.1e}")
        guarded(label, one)
    timings(kinds)
    if args.decode:
        decode(kinds, rounds=args.rounds)
    return finish("qfloor")


if __name__ == "__main__":
    sys.exit(main())
