"""The small kernels of a layer: kernels/rmsnorm.cu, rope.cu, swiglu.cu, embed.cu (embed, cast).

Each check against its NumPy reference (the CPU model's own layers: rmsnorm, apply_rope, silu) on
random inputs; `python -m minillm.cuda.dev.elementwise` runs them in fp16 and bf16. No sweep: these
launches are a few µs each, their cost is the launch (lesson 13), not their bytes.
"""
from __future__ import annotations

import sys
from typing import Callable

import numpy as np

from minillm.backend import as_f32
from minillm.cuda.dev.common import (F32_TOL, TOL, _cp, _host, _narrow_dt, _sync, finish, narrow, poisoned, rel_err,
                                     require_gpu, run_cases)
from minillm.cuda.kernels import Kernels
from minillm.model.layers import apply_rope, rmsnorm, rope_inv_freq, rope_tables, silu


def check_rmsnorm(k: Kernels, T: int, dim: int, to_narrow: bool, seed: int = 0):
    cp, rng = _cp(), np.random.default_rng(seed)
    x = rng.standard_normal((T, dim)).astype(np.float32) * 3
    g = (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
    out = poisoned((T, dim), _narrow_dt(k.dtype) if to_narrow else np.float32)
    k.rmsnorm(cp.asarray(x), cp.asarray(g), out, 1e-5)
    _sync()
    want = rmsnorm(x, g, 1e-5)
    return rel_err(_host(out), want), (TOL[k.dtype] if to_narrow else F32_TOL)


def check_rope(k: Kernels, T: int, n_heads: int, n_kv: int, hd: int, pos0: int, seed: int = 0):
    cp, rng = _cp(), np.random.default_rng(seed)
    width = (n_heads + 2 * n_kv) * hd
    qkv = rng.standard_normal((T, width)).astype(np.float32)
    inv_freq = rope_inv_freq(hd, 10000.0)
    d_qkv, pos = cp.asarray(qkv), cp.asarray(np.array([pos0], np.int32))
    k.rope(d_qkv, T, n_heads + n_kv, hd, pos, cp.asarray(inv_freq))
    _sync()
    cos, sin = rope_tables(np.arange(pos0, pos0 + T), inv_freq)
    rotated = apply_rope(qkv[:, :(n_heads + n_kv) * hd].reshape(T, n_heads + n_kv, hd), cos, sin)
    want = np.concatenate([rotated.reshape(T, -1), qkv[:, (n_heads + n_kv) * hd:]], axis=1)
    return rel_err(_host(d_qkv), want), 1e-5 * max(1, pos0) ** 0.5


def check_swiglu(k: Kernels, T: int, ffn: int, to_narrow: bool, seed: int = 0):
    cp, rng = _cp(), np.random.default_rng(seed)
    gu = (rng.standard_normal((T, 2 * ffn)) * 3).astype(np.float32)
    out = poisoned((T, ffn), _narrow_dt(k.dtype) if to_narrow else np.float32)
    k.swiglu(cp.asarray(gu), out)
    _sync()
    want = silu(gu[:, :ffn]) * gu[:, ffn:]
    return rel_err(_host(out), want), (TOL[k.dtype] if to_narrow else F32_TOL)


def check_embed_cast(k: Kernels, vocab: int, dim: int, seed: int = 0):
    cp, rng = _cp(), np.random.default_rng(seed)
    table = narrow(rng.standard_normal((vocab, dim)), k.dtype)
    tokens = rng.integers(0, vocab, 7).astype(np.int32)
    out = poisoned((7, dim), np.float32)
    k.embed(cp.asarray(tokens), cp.asarray(table), out)
    x = rng.standard_normal((5, dim)).astype(np.float32)
    narrowed = poisoned((5, dim), _narrow_dt(k.dtype))
    k.cast(cp.asarray(x), narrowed)
    _sync()
    err_embed = rel_err(_host(out), as_f32(table[tokens]))
    err_cast = rel_err(cp.asnumpy(narrowed).view(np.uint16), narrow(x, k.dtype).view(np.uint16))
    return max(err_embed, err_cast), 0.0                            # both exact (cast: bit for bit)


def cases(k: Kernels) -> list[tuple[str, Callable]]:
    """rmsnorm, RoPE, SwiGLU, embedding and cast:
    (label, check) pairs for the selfcheck; each check -> (error, tolerance)."""
    return [
            ("rmsnorm -> fp32", lambda: check_rmsnorm(k, 3, 4096, False)),
            ("rmsnorm -> 16-bit", lambda: check_rmsnorm(k, 3, 576, True)),
            ("rope 32+8 heads hd 128 pos 4000", lambda: check_rope(k, 1, 32, 8, 128, 4000)),
            ("rope T=7 hd 16", lambda: check_rope(k, 7, 4, 4, 16, 3)),
            ("swiglu -> fp32", lambda: check_swiglu(k, 1, 14336, False)),
            ("swiglu -> 16-bit", lambda: check_swiglu(k, 4, 1536, True)),
            ("embed + cast", lambda: check_embed_cast(k, 300, 72)),
    ]


def main(argv=None) -> int:
    """`python -m minillm.cuda.dev.elementwise`: every check of this family in fp16 and bf16."""
    if not require_gpu("elementwise"):
        return 2
    run_cases(cases)
    return finish("elementwise")


if __name__ == "__main__":
    sys.exit(main())
