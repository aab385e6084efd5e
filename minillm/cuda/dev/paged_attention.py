"""kernels/paged_attention.cu: the batching engine's three paged kernels, their NumPy references and checks.

    rope_at_positions     RoPE on the q and k heads of each packed row, at that row's own position
    paged_kv_write(_int8) each row's new key and value into its pool slot (int8: codes + a scale per vector)
    paged_attention(_int8) each row's queries against its sequence's keys, read through its block table
    paged_attention_g{G}  the same, a GQA group's G query heads served by one read of each K/V row

The references below compute what the kernels compute, one row at a time and in fp32, from the same
arrays the kernels read; tests/test_gpu_engine.py holds the kernels to them on random mixed batches.
`python -m minillm.cuda.dev.paged_attention` checks the kernels on the GPU; `--prefill` times one layer of a
prefill step at the Mistral-7B shape, the group kernel against paged_prefill_attention_mma (prefill_attention_mma.cu:
every chunk on the tensor cores, K/V through the block tables; gpu_batched.py's prefill="mma").
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from minillm.backend import to_dtype
from minillm.model.kv_cache import quantize_vectors
from minillm.model.layers import apply_rope, rope_tables


def rope_at_positions_reference(qkv: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, n_heads: int,
                                n_kv_heads: int, head_dim: int) -> None:
    """rope_at_positions: rotate the first n_heads + n_kv_heads heads of each row of qkv [N, width] in place."""
    cos, sin = rope_tables(np.asarray(positions), np.asarray(inv_freq))                   # [N, hd/2] each
    width = (n_heads + n_kv_heads) * head_dim
    heads = qkv[:, :width].reshape(len(qkv), n_heads + n_kv_heads, head_dim)              # [N, H + n_kv, hd]
    qkv[:, :width] = apply_rope(heads, cos, sin).reshape(len(qkv), width)


def paged_kv_write_reference(qkv: np.ndarray, slots: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray,
                             n_heads: int, n_kv_heads: int, head_dim: int, dtype: str = "float16",
                             scales=None) -> None:
    """paged_kv_write: each row's k and v heads into its flat slot of one layer's pool [blocks, bs, n_kv, hd],
    narrowed to `dtype`; with scales = (k_scale, v_scale) [blocks, bs, n_kv] the int8 pool's codes and
    scales (kv_cache.quantize_vectors: the CPU pools' format)."""
    nq, nkv = n_heads * head_dim, n_kv_heads * head_dim
    for pool, new, scale in zip((k_pool, v_pool), (qkv[:, nq:nq + nkv], qkv[:, nq + nkv:nq + 2 * nkv]),
                                scales or (None, None)):
        flat = pool.reshape(-1, n_kv_heads, head_dim)                                     # [blocks * bs, n_kv, hd] view
        rows = new.reshape(-1, n_kv_heads, head_dim)
        if scale is None:
            flat[slots] = to_dtype(np.asarray(rows, np.float32), dtype)
        else:
            flat[slots], scale.reshape(-1, n_kv_heads)[slots] = quantize_vectors(rows)


def paged_attention_reference(qkv: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, block_tables: np.ndarray,
                              seq_of_row: np.ndarray, positions: np.ndarray, n_heads: int,
                              window: int | None = None, scales=None) -> np.ndarray:
    """What paged_attention.cu computes: each row's queries (the first n_heads heads of its qkv row)
    against its sequence's keys [lo, p], gathered through the block table; scales = (k_scale, v_scale):
    the pools hold int8 codes (code · scale).  -> [N, n_heads * hd] fp32"""
    if scales is not None:
        k_pool, v_pool = (p.astype(np.float32) * s[..., None] for p, s in zip((k_pool, v_pool), scales))
    _, block_size, n_kv, hd = k_pool.shape
    group = n_heads // n_kv
    out = np.empty((qkv.shape[0], n_heads * hd), np.float32)
    for t in range(qkv.shape[0]):
        p = int(positions[t])
        lo = max(0, p - window + 1) if window else 0
        keys = np.arange(lo, p + 1)
        blocks = np.asarray(block_tables[seq_of_row[t]])[keys // block_size]
        K = to_dtype(k_pool[blocks, keys % block_size], "float32")[:, np.arange(n_heads) // group]  # [L, H, hd]
        V = to_dtype(v_pool[blocks, keys % block_size], "float32")[:, np.arange(n_heads) // group]  # [L, H, hd]
        q = qkv[t, :n_heads * hd].reshape(n_heads, hd)                                            # [H, hd]
        scores = np.einsum("lhd,hd->hl", K, q) / math.sqrt(hd)                                    # [H, L]
        w = np.exp(scores - scores.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        out[t] = np.einsum("hl,lhd->hd", w, V).reshape(-1)
    return out


def paged_attention_group_reference(qkv: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray,
                                    block_tables: np.ndarray, seq_of_row: np.ndarray, positions: np.ndarray,
                                    n_heads: int, window: int | None = None, scales=None) -> np.ndarray:
    """What paged_attention_g{G} computes, organized as it is: per (row, KV head), one gather of that head's
    keys and values [L, hd] serving the group's G adjacent query heads (a [G, L] score matrix). Equal to
    paged_attention_reference (tests/test_gpu_engine.py checks it), which gathers per query head.
    -> [N, n_heads * hd] fp32"""
    if scales is not None:
        k_pool, v_pool = (p.astype(np.float32) * s[..., None] for p, s in zip((k_pool, v_pool), scales))
    _, block_size, n_kv, hd = k_pool.shape
    G = n_heads // n_kv
    out = np.empty((qkv.shape[0], n_heads * hd), np.float32)
    for t in range(qkv.shape[0]):
        p = int(positions[t])
        keys = np.arange(max(0, p - window + 1) if window else 0, p + 1)
        blocks = np.asarray(block_tables[seq_of_row[t]])[keys // block_size]
        for kvh in range(n_kv):
            K = to_dtype(k_pool[blocks, keys % block_size, kvh], "float32")                 # [L, hd], read once
            V = to_dtype(v_pool[blocks, keys % block_size, kvh], "float32")
            q = qkv[t, kvh * G * hd:(kvh + 1) * G * hd].reshape(G, hd)                      # [G, hd]
            scores = q @ K.T / math.sqrt(hd)                                                # [G, L]
            w = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[t, kvh * G * hd:(kvh + 1) * G * hd] = ((w / w.sum(axis=1, keepdims=True)) @ V).reshape(-1)
    return out


# ---- the check ------------------------------------------------------------------------------------
def lab_ops(gpu, pool=None, attention: str = "group", prefill: str = "mma"):
    """forward.DeviceOps with its paged kernels chosen, to compare them: attention "head" (the per-query-head
    fallback) or "group" (shipped wherever the group size is compiled); prefill "paged" (the paged kernels for
    prompt chunks too) or "mma" (shipped for 16-bit pools at head_dim 64 and 128)."""
    from minillm.cuda.forward import DeviceOps
    from minillm.cuda.kernels import module, suffix
    ops = DeviceOps(gpu, pool)
    if attention == "head" and ops.group:
        mod, sfx = module("paged_attention"), suffix(gpu.dtype)
        ops.group = None
        ops.fn["attention"] = mod.get_function(f"paged_attention_{sfx}")
        ops.fn["attention_int8"] = mod.get_function("paged_attention_int8")
    if prefill == "paged":
        ops.fn.pop("prefill", None)
    return ops


def check_paged(dtype: str = "float16", window: int = 0, int8: bool = False, seed: int = 0,
                attention: str = "head") -> tuple[float, float]:
    """The three paged kernels on a mixed batch (two decodes and a prefill chunk, block tables scattered over
    the pool, earlier positions random), each output NaN-poisoned first, against the references above.
    -> (largest error relative to each reference's largest value, tolerance)"""
    import cupy as cp
    from minillm.cuda.dev.common import TOL, narrow, rel_err
    from minillm.cuda.dev.model import random_cpu_model, small_config
    from minillm.cuda.gpu_batched import DevicePagedKV, batch_meta
    from minillm.cuda.gpu_model import GPUTransformer
    from minillm.engine.batched import SeqChunk
    c = small_config("gqa", sliding_window=window or None, max_seq_len=256)
    gpu = GPUTransformer.from_cpu(random_cpu_model(c, dtype, seed), dtype)
    rng = np.random.default_rng(seed)
    tables = rng.permutation(24).reshape(3, 8).tolist()                    # 3 sequences, blocks of 4
    chunks = [SeqChunk([1], 21, tables[0]), SeqChunk([2], 13, tables[1]), SeqChunk([3, 4, 5, 6], 5, tables[2])]
    pool = DevicePagedKV(c, 24, 4, "int8" if int8 else dtype)
    for a in (pool.k, pool.v):                                             # earlier positions' K/V
        a[0] = cp.asarray(rng.integers(-127, 128, a[0].shape).astype(np.int8) if int8
                          else narrow(rng.standard_normal(a[0].shape), dtype))
    if int8:
        for a in (pool.k_scale, pool.v_scale):
            a[0] = cp.asarray((0.01 + rng.random(a[0].shape) / 20).astype(np.float32))
    meta_h, meta_d = batch_meta(chunks, 4, np.asarray), batch_meta(chunks, 4, cp.asarray)
    qkv_h = rng.standard_normal((len(meta_h.tokens), gpu.qkv_width)).astype(np.float32)
    qkv_d, dev = cp.asarray(qkv_h), lab_ops(gpu, pool, attention=attention, prefill="paged")
    cp.cuda.Device().synchronize()                                         # the copies ran on the default stream
    with gpu.stream:
        dev.rope(qkv_d, meta_d)
        gpu.stream.synchronize()
        rope_at_positions_reference(qkv_h, meta_h.positions, cp.asnumpy(gpu.inv_freq), c.n_heads, c.n_kv_heads,
                                    c.head_dim)
        err = rel_err(cp.asnumpy(qkv_d), qkv_h)
        qkv_h = cp.asnumpy(qkv_d)                                          # the rest reads what the device has
        want = {name: cp.asnumpy(getattr(pool, name)[0]) for name in ("k", "v", "k_scale", "v_scale")
                if hasattr(pool, name)}
        scales = (want["k_scale"], want["v_scale"]) if int8 else None
        paged_kv_write_reference(qkv_h, meta_h.slots, want["k"], want["v"], c.n_heads, c.n_kv_heads, c.head_dim,
                                 dtype, scales)
        out = cp.full((len(qkv_h), c.n_heads * c.head_dim), cp.nan, cp.float32)
        dev.kv_write(0, qkv_d, meta_d)
        dev.attention(0, qkv_d, meta_d, out=out)
        gpu.stream.synchronize()
    for name, a in want.items():
        err = max(err, rel_err(to_dtype(cp.asnumpy(getattr(pool, name)[0]), "float32") if a.dtype == np.uint16
                               else cp.asnumpy(getattr(pool, name)[0]).astype(np.float32),
                               to_dtype(a, "float32") if a.dtype == np.uint16 else a.astype(np.float32)))
    reference = paged_attention_group_reference if attention == "group" else paged_attention_reference
    ref = reference(qkv_h, want["k"], want["v"], meta_h.block_tables, meta_h.seq_of_row, meta_h.positions,
                    c.n_heads, window, scales)
    return max(err, rel_err(cp.asnumpy(out), ref)), TOL[dtype]


def prefill_timing(chunks_per_step: int = 16, prompt: int = 128, reps: int = 20) -> list[list]:
    """One Mistral-7B layer's attention for two prefill steps (chunks_per_step prompts of `prompt` tokens from
    position 0; the same prompts' next `prompt` tokens, the first ones already in the pool): µs of the group
    kernel and of the tensor-core one, and how far apart their outputs are (relative to the largest)."""
    import cupy as cp
    from minillm.cuda.dev.common import TOL, plain_table, rel_err, say, verdict
    from minillm.cuda.timing import time_gpu
    from minillm.cuda.gpu_batched import DevicePagedKV, batch_meta
    from minillm.cuda.gpu_model import GPUTransformer
    from minillm.engine.batched import SeqChunk
    from minillm.model.config import PRESETS
    c = PRESETS["mistral-7b"].config
    gpu = GPUTransformer.random(dataclasses.replace(c, n_layers=1), "float16", seed=0)    # one layer is enough
    per_seq = -(-2 * prompt // 16)
    pool = DevicePagedKV(gpu.config, chunks_per_step * per_seq, 16, "float16")
    k, v, _ = pool.layer(0)
    k[...] = cp.random.standard_normal(k.shape, dtype=cp.float32).astype(cp.float16)
    v[...] = cp.random.standard_normal(v.shape, dtype=cp.float32).astype(cp.float16)
    rng = np.random.default_rng(0)
    tables = rng.permutation(chunks_per_step * per_seq).reshape(chunks_per_step, per_seq).tolist()
    ops = {kind: lab_ops(gpu, pool, prefill=kind) for kind in ("paged", "mma")}
    rows = []
    for name, start in (("prompts from 0", 0), ("their next chunks", prompt)):
        chunks = [SeqChunk([1] * prompt, start, tables[b]) for b in range(chunks_per_step)]
        meta = batch_meta(chunks, 16, cp.asarray)
        qkv = cp.random.standard_normal((chunks_per_step * prompt, gpu.qkv_width), dtype=cp.float32)
        us, outs = {}, {}
        with gpu.stream:
            for kind, dev in ops.items():
                out = cp.full((len(qkv), gpu.q_width), cp.nan, cp.float32)
                us[kind] = time_gpu(lambda: dev.attend(qkv, k, v, meta, out=out), reps) * 1e3
                outs[kind] = cp.asnumpy(out)
        err = rel_err(outs["mma"], outs["paged"])
        verdict(f"prefill {name}: mma == paged", err <= TOL["float16"], f"err {err:.2e}  tol {TOL['float16']:.0e}")
        rows.append([name, f"{chunks_per_step} x {prompt}", f"{us['paged']:.1f}", f"{us['mma']:.1f}",
                     f"{us['paged'] / us['mma']:.1f}x"])
    plain_table("one Mistral-7B layer's attention in a prefill step (µs)",
                ["step", "chunks x tokens", "group kernel", "tensor cores", "speedup"], rows)
    say(f"x {c.n_layers} layers: {float(rows[0][2]) * c.n_layers / 1e3:.1f} -> "
        f"{float(rows[0][3]) * c.n_layers / 1e3:.1f} ms a step")
    return rows


def main() -> int:
    """`python -m minillm.cuda.dev.paged_attention [--prefill]`: the paged kernels, 16-bit and int8 pools,
    windowed or not; --prefill: prefill_timing (after the checks)."""
    import sys
    from minillm.cuda.dev.common import SHORT, finish, guarded, require_gpu, verdict
    if not require_gpu("paged_attention"):
        return 2
    for dtype, int8 in (("float16", False), ("bfloat16", False), ("float16", True)):
        for window, attention in ((0, "head"), (6, "head"), (0, "group"), (6, "group")):
            label = (f"{SHORT[dtype]} paged rope + kv write + attention ({attention}){' int8 pool' if int8 else ''} "
                     f"window {window}")

            def one(dtype=dtype, int8=int8, window=window, attention=attention, label=label):
                err, tol = check_paged(dtype, window, int8, attention=attention)
                verdict(label, err <= tol, f"err {err:.2e}  tol {tol:.1e}")
            guarded(label, one)
    if "--prefill" in sys.argv[1:]:
        guarded("prefill timing", prefill_timing)
    return finish("paged_attention")


if __name__ == "__main__":
    import sys
    sys.exit(main())
