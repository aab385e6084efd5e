"""Exercises 11-13, the GPU by arithmetic: the bytes that cross the bus, the order of a block's fp32
sum, the kernel launches per decoded token. Each has its cases, its check and its reference."""
from __future__ import annotations

import numpy as np

from minillm.course.cases import Case, CaseFailed, case_rng, expect_unchanged
from minillm.course.gpu_parts import record_decode_launches


# 11: what crosses the bus between host and GPU -------------------------------------------------------

def transfer_bytes_reference(config, weight_bytes: int = 2) -> tuple[int, int, int]:
    """(upload, up per token, down per token): the bytes the engine's GPU path moves.

    GPUTransformer.from_cpu sends every matrix at `weight_bytes` and the norm gains as fp32 (a tied
    LM head is the embedding, sent once: ModelConfig.n_params counts it once); decode sets the step
    buffer [token, position] (two int32) and fetches the fp32 logits. The KV cache and activations are
    made on the device. Lesson 11 checks the upload against the arrays a GPUTransformer holds."""
    norms = (2 * config.n_layers + 1) * config.dim                        # gain values, fp32 on the device
    upload = (config.n_params - norms) * weight_bytes + norms * 4
    return upload, 2 * 4, config.vocab_size * 4


def _transfer_cases() -> list[Case]:
    from minillm.model.config import PRESETS, ModelConfig
    preset = lambda name: PRESETS[name].config
    mqa = ModelConfig(vocab_size=1000, dim=64, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=160)
    return [Case("SmolLM2-135M in fp16 (its LM head is tied to the embedding)",
                 dict(config=preset("smollm2-135m"), weight_bytes=2)),
            Case("Mistral-7B in fp16 (an untied LM head)", dict(config=preset("mistral-7b"), weight_bytes=2)),
            Case("Llama-3.2-1B in bf16 (tied, vocab 128256)", dict(config=preset("llama-3.2-1b"), weight_bytes=2)),
            Case("a tiny MQA model (1 KV head, untied), fp16", dict(config=mqa, weight_bytes=2)),
            Case("Llama-2-7B with fp32 weights (weight_bytes 4)", dict(config=preset("llama-2-7b"), weight_bytes=4))]


def _random_configs(seed: int, n: int, tag: int) -> list:
    """Small random GQA models (tied or not): fresh shapes for the hidden cases of 11 and 13."""
    from minillm.model.config import ModelConfig
    rng = np.random.default_rng([seed, tag])
    configs = []
    for _ in range(n):
        n_kv = int(rng.integers(1, 5))
        n_heads = n_kv * int(rng.integers(1, 5))
        head_dim = 8 * int(rng.integers(1, 9))
        configs.append(ModelConfig(vocab_size=int(rng.integers(100, 50_000)), dim=n_heads * head_dim,
                                   n_layers=int(rng.integers(1, 40)), n_heads=n_heads, n_kv_heads=n_kv,
                                   ffn_dim=16 * int(rng.integers(1, 200)), head_dim=head_dim,
                                   tie_embeddings=bool(rng.integers(0, 2))))
    return configs


def _transfer_hidden(seed: int) -> list[Case]:
    rng = np.random.default_rng([seed, 11])
    return [Case(f"a random model: {c.n_layers} layers, dim {c.dim}, vocab {c.vocab_size}, "
                 f"{'tied' if c.tie_embeddings else 'untied'}", dict(config=c, weight_bytes=int(rng.choice([1, 2, 4]))))
            for c in _random_configs(seed, 5, 11)]


def _check_transfer(fn, case: Case) -> str:
    cfg, wb = case.inputs["config"], case.inputs["weight_bytes"]
    got = fn(cfg, wb)
    if not (isinstance(got, tuple) and len(got) == 3):
        raise CaseFailed(f"returned {type(got).__name__}, expected a tuple (upload, up_per_token, down_per_token)")
    try:
        upload, up, down = (int(v) for v in got)
    except (TypeError, ValueError):
        raise CaseFailed(f"returned {got!r}: expected three whole numbers of bytes") from None
    want_upload, want_up, want_down = transfer_bytes_reference(cfg, wb)
    norms, head = (2 * cfg.n_layers + 1) * cfg.dim, cfg.vocab_size * cfg.dim
    if upload != want_upload:
        hints = {want_upload + norms * (wb - 4): "the RMSNorm gains stay fp32 on the device (4 bytes a value), "
                                                 "whatever weight_bytes the matrices use",
                 want_upload - norms * 4: "the norm gains are sent too: two per layer and the final one, dim "
                                          "fp32 values each",
                 want_upload + cfg.kv_bytes_per_token(wb) * cfg.max_seq_len: "the KV cache is made on the device "
                                                                             "(cp.zeros): it never crosses the bus"}
        if cfg.tie_embeddings:
            hints[want_upload + head * wb] = "a tied LM head IS the embedding: one array, sent once"
        else:
            hints[want_upload - head * wb] = "an untied LM head is a matrix of its own: vocab × dim more weights"
        hints.pop(want_upload, None)
        raise CaseFailed(f"upload {upload:,} bytes, expected {want_upload:,}"
                         + (f": {hints[upload]}" if upload in hints else ""))
    if up != want_up:
        hint = {4: ": the position goes up with the token (GPUTransformer.decode sets step = [token, position])",
                16: ": two int32 values (4 bytes each), not int64"}.get(up, "")
        raise CaseFailed(f"up per token {up} bytes, expected {want_up}{hint}")
    if down != want_down:
        hint = ": the logits come back in fp32 (4 bytes each)" if down == cfg.vocab_size * 2 else (
            ": the host samples the next token, so it needs every logit (one id would come back only if "
            "sampling ran on the device)" if down in (4, 8) else "")
        raise CaseFailed(f"down per token {down:,} bytes, expected {want_down:,}{hint}")
    return f"upload {upload / 1e6:,.1f} MB once; per token {up} B up, {down:,} B down"


# 12: the order of a block's fp32 sum -----------------------------------------------------------------

def block_sum_reference(values: np.ndarray, n_threads: int = 256) -> np.ndarray:
    """Each row of values [rows, n] summed in fp32 in exactly the order of kernels/common.cuh's block_sum
    as rmsnorm.cu calls it: one block of n_threads (a multiple of 32, at most 1024) per row.  -> [rows]

    Lesson 12 checks this emulation against the GPU bit for bit."""
    v = np.asarray(values, dtype=np.float32)
    rows, n = v.shape
    acc = np.zeros((rows, n_threads), np.float32)              # one register per thread
    for start in range(0, n, n_threads):                       # thread t adds t, t + n_threads, ...
        chunk = v[:, start:start + n_threads]
        acc[:, :chunk.shape[1]] += chunk                       # threads past the row's end add nothing
    partial = _xor_shuffle_sum(acc.reshape(rows, n_threads // 32, 32))[..., 0]    # [rows, n_warps]
    return _warps_reduced(partial)


def _xor_shuffle_sum(lanes: np.ndarray) -> np.ndarray:
    """warp_sum over the last axis (32 lanes): five rounds of v += __shfl_xor_sync(v, o), o = 16 .. 1."""
    lane = np.arange(32)
    for o in (16, 8, 4, 2, 1):
        lanes = lanes + lanes[..., lane ^ o]                   # lane l adds lane l ^ o; all lanes at once
    return lanes


def _warps_reduced(partials: np.ndarray) -> np.ndarray:
    """Warp 0's second round over the per-warp totals [rows, n_warps]; its lanes past the last warp hold 0."""
    lanes = np.zeros((partials.shape[0], 32), np.float32)
    lanes[:, :partials.shape[1]] = partials
    return _xor_shuffle_sum(lanes)[:, 0]


def _block_sum_variants(v: np.ndarray, n_threads: int) -> dict[str, np.ndarray]:
    """Other orders of the same fp32 sum, each under the hint that names it (to explain a wrong answer)."""
    rows, n = v.shape
    sequential = np.zeros(rows, np.float32)
    for i in range(n):
        sequential = sequential + v[:, i]
    per = -(-n // n_threads)                                   # values per thread, rounded up
    padded = np.zeros((rows, n_threads * per), np.float32)
    padded[:, :n] = v
    contiguous = np.zeros((rows, n_threads), np.float32)
    for j in range(per):                                       # thread t adds t·per, t·per + 1, ...
        contiguous = contiguous + padded.reshape(rows, n_threads, per)[:, :, j]
    strided = np.zeros((rows, n_threads), np.float32)
    for j in range(per):                                       # the kernel's order within each thread
        strided = strided + padded.reshape(rows, per, n_threads)[:, j]
    partials = _xor_shuffle_sum(strided.reshape(rows, -1, 32))[..., 0]
    in_a_loop = np.zeros(rows, np.float32)
    for w in range(partials.shape[1]):
        in_a_loop = in_a_loop + partials[:, w]
    return {"NumPy's own order (pairwise summation), not the block's": v.sum(axis=1, dtype=np.float32),
            "one thread adding the row left to right (kernel v1's order), not the block's": sequential,
            "thread t adds a contiguous chunk; in the kernel thread t adds values t, t + n_threads, ... "
            "(a warp reads 32 neighbours at once: coalesced)":
                _warps_reduced(_xor_shuffle_sum(contiguous.reshape(rows, -1, 32))[..., 0]),
            "the per-warp totals are added in a loop; in the kernel warp 0 reduces them with the same xor "
            "tree (its lanes past the last warp hold 0)": in_a_loop}


def _block_sum_cases() -> list[Case]:
    rng = case_rng(12)

    def case(name, rows, n, n_threads, values=None):
        v = values if values is not None else rng.standard_normal((rows, n)).astype(np.float32)
        return Case(name, dict(values=v, n_threads=n_threads))
    squares = ((rng.standard_normal((16, 4096)) * 3) ** 2).astype(np.float32)
    mixed = (rng.standard_normal((32, 1000)) * np.where(rng.random((32, 1000)) < 0.1, 1e4, 1e-3)).astype(np.float32)
    return [case("one warp: 32 threads, 32 values a row (only the shuffle tree)", 8, 32, 32),
            case("Mistral's dim: the squares of 4096 activations over 256 threads (rmsnorm.cu)", 16, 4096, 256,
                 squares),
            case("SmolLM2's dim 576 over 256 threads: threads 0-63 add 3 values, the others 2", 16, 576, 256),
            case("fewer values than threads: 100 over 256 (idle threads hold 0)", 8, 100, 256),
            case("1024 threads (32 warps) over 14336 values: warp 0 reduces a full warp of totals", 8, 14336, 1024),
            case("magnitudes 1e-3 and 1e4 mixed, 128 threads: the order decides the last bits", 32, 1000, 128, mixed)]


def _check_block_sum(fn, case: Case) -> str:
    v, n_threads = case.inputs["values"], case.inputs["n_threads"]
    v_in = v.copy()
    got = fn(v_in, n_threads)
    expect_unchanged("values", v, v_in)
    want = block_sum_reference(v, n_threads)
    if not isinstance(got, np.ndarray) or got.shape != want.shape:
        raise CaseFailed(f"returned {getattr(got, 'shape', type(got).__name__)}, expected a float32 array of "
                         f"shape {list(want.shape)} (one sum per row)")
    if got.dtype != np.float32:
        raise CaseFailed(f"returned {got.dtype}: the kernel adds in float32, and the bits depend on it")
    exact = v.astype(np.float64).sum(axis=1)
    off = np.abs(got - exact) > 1e-5 * np.abs(v).astype(np.float64).sum(axis=1) + 1e-30
    if off.any():
        r = int(np.argmax(off))
        raise CaseFailed(f"row {r}: {float(got[r]):.7g} is not the row's sum ({exact[r]:.7g} in float64)")
    differ = got.view(np.uint32) != want.view(np.uint32)
    if differ.any():
        for hint, other in _block_sum_variants(v, n_threads).items():
            if np.array_equal(got.view(np.uint32), other.view(np.uint32)):
                raise CaseFailed(f"the right sums in another order: {hint}")
        r = int(np.argmax(differ))
        raise CaseFailed(f"{int(differ.sum())} of {len(want)} rows differ in the last bits, e.g. row {r}: "
                         f"{float(got[r])!r} vs the block's {float(want[r])!r}: right to fp32 precision, "
                         f"added in another order (see the docstring's three steps)")
    return f"{len(want)} row sums, bit-identical to the block's order"


# 13: kernel launches per decoded token ---------------------------------------------------------------

def decode_launches_reference(config, gemv_version: int, fuse_norm: bool) -> int:
    """Kernel launches per decoded token, counted by running the engine's decode step
    (gpu_parts.record_decode_launches)."""
    return len(record_decode_launches(config, gemv_version, fuse_norm))


def _launch_cases() -> list[Case]:
    from minillm.model.config import PRESETS, ModelConfig
    smol, mistral = PRESETS["smollm2-135m"].config, PRESETS["mistral-7b"].config
    wide = ModelConfig(vocab_size=1000, dim=16384, n_layers=2, n_heads=128, n_kv_heads=8, ffn_dim=2048)
    tiny = ModelConfig(vocab_size=512, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=128)

    def case(name, config, version, fuse):
        return Case(name, dict(config=config, gemv_version=version, fuse_norm=fuse))
    return [case("SmolLM2-135M, gemv v4, norms fused (the engine's default)", smol, 4, True),
            case("Mistral-7B, gemv v4, norms fused", mistral, 4, True),
            case("Mistral-7B, gemv v4, separate RMSNorm launches (fuse_norm off)", mistral, 4, False),
            case("Mistral-7B, gemv v2, nothing fused (the first version)", mistral, 2, False),
            case("SmolLM2-135M, gemv v2 with the norm fused into the GEMV (v3)", smol, 2, True),
            case("a 16384-wide model, gemv v2 + fuse_norm: v3 holds x in shared memory", wide, 2, True),
            case("gemv v1, 3 layers: the same launches as v2", tiny, 1, False)]


def _launch_hidden(seed: int) -> list[Case]:
    rng = np.random.default_rng([seed, 13])
    return [Case(f"a random model: {c.n_layers} layers, dim {c.dim}, gemv v{v}, fuse_norm {bool(f)}",
                 dict(config=c, gemv_version=v, fuse_norm=bool(f)))
            for c in _random_configs(seed, 5, 13)
            for v, f in [(int(rng.choice([1, 2, 4])), int(rng.integers(0, 2)))]]


def _check_launches(fn, case: Case) -> str:
    import dataclasses

    from minillm.cuda.dev.lab import MAX_FUSED_NORM
    cfg, version, fuse = case.inputs["config"], case.inputs["gemv_version"], case.inputs["fuse_norm"]
    got = fn(cfg, version, fuse)
    if isinstance(got, bool) or not isinstance(got, (int, np.integer)):
        raise CaseFailed(f"returned {got!r}, expected a whole number of launches")
    recorded = record_decode_launches(cfg, version, fuse)
    want = len(recorded)
    if got == want:
        return f"{want} launches ({', '.join(sorted({name.split()[0] for name in recorded}))})"
    if version < 4 and fuse and cfg.dim > MAX_FUSED_NORM:
        narrow = dataclasses.replace(cfg, dim=8 * (MAX_FUSED_NORM // 8))
        if got == decode_launches_reference(narrow, version, fuse):
            raise CaseFailed(f"{got}, expected {want}: below gemv v4, fuse_norm uses gemv.cu v3, which keeps x in "
                             f"shared memory and fuses only when dim <= MAX_FUSED_NORM ({MAX_FUSED_NORM}); at dim "
                             f"{cfg.dim} every RMSNorm stays its own launch (LabTransformer._fused, minillm/cuda/dev/lab.py)")
    outside = record_decode_launches(dataclasses.replace(cfg, n_layers=0), version, fuse)
    one = record_decode_launches(dataclasses.replace(cfg, n_layers=1), version, fuse)
    per_layer = len(one) - len(outside)
    first = next(i for i in range(len(outside) + 1) if one[:i] + one[i + per_layer:] == outside)
    layer = one[first:first + per_layer]
    if (got - len(outside)) % cfg.n_layers == 0:
        raise CaseFailed(f"{got}, expected {want}: each of the {cfg.n_layers} layers launches {per_layer} kernels "
                         f"({', '.join(layer)}); your count implies {(got - len(outside)) // cfg.n_layers}")
    raise CaseFailed(f"{got}, expected {want}: outside the layers the step launches {len(outside)} "
                     f"({', '.join(outside)}), and each layer {per_layer}")
