"""Batched execution on the GPU: batched.py's forward pass with the weights, the pool and attention on the device.

The same plan as minillm.engine.batched: every sequence's new tokens (prompt chunks and single decode tokens)
packed into one matrix [N, dim], so each projection and the MLP is one cuBLAS GEMM over all N rows
(a decode step of B sequences reads each weight once, not B times: batching's whole gain), and only
attention is per sequence. Here attention is one launch per layer for the whole batch too:
kernels/paged_attention.cu gives every query row its sequence's block table and its position.

    weights      GPUTransformer's own (fused wqkv and gate|up, 16-bit, fp32 norms): nothing re-uploaded
    pool         DevicePagedKV: k, v [layers, blocks, block_size, n_kv_heads, hd], 16-bit, on the device;
                 or int8 codes with a scale per position and KV head (k_scale, v_scale [layers, blocks,
                 block_size, n_kv_heads] fp32), paged_kv.PagedKVCache's int8 format
    activations  the residual stream fp32; GEMM inputs narrowed to 16 bits, fp32 accumulation (as prefill)
    host         packing, block tables, the scheduler and the sampler stay on the host; one upload of
                 the batch's int32 metadata and one download of the logits [B, vocab] fp32 per step

Every device step goes through an `ops` object: `DeviceOps` launches the kernels; `HostOps` is the
NumPy reference of each one (the kernels' tests use it) and runs this very forward pass on the CPU, so
the plumbing (shapes, slots, tables, positions) is checked without a GPU.

Not here yet: a paged attention kernel that serves a whole GQA group from
one block (v1 re-reads each K/V row once per query head, from L2); CUDA graphs (a step's ~11 launches a
layer run eagerly: with 64 sequences a step is bound by the GEMMs' weight reads, not by the launches).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np

from minillm.backend import to_dtype
from minillm.engine.batched import SeqChunk, pack
from minillm.model.layers import apply_rope, rmsnorm, rope_inv_freq, rope_tables, silu
from minillm.model.kv_cache import int8_kv_bytes_per_token, quantize_vectors
from minillm.engine.paged_kv import DEFAULT_BLOCK_SIZE, PagedKVCache
from minillm.cuda.gpu_model import GPULayer

PA_WARPS, PA_MAX_HD = 4, 256            # as #defined in paged_attention.cu


def _cp():
    import cupy
    return cupy


class DevicePagedKV(PagedKVCache):
    """The paged pool on the device (xp = cupy) or, for the NumPy twin, on the host (xp = numpy). dtype:
    the model's 16 bits ("float16", or "bfloat16" as uint16 bits), or "int8": codes and a fp32 scale per
    position and KV head (half the bytes at hd 128). Same layout and `slots` as PagedKVCache."""

    def __init__(self, config, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, dtype: str = "float16",
                 xp=None):
        xp = xp or _cp()
        shape = (config.n_layers, num_blocks, block_size, config.n_kv_heads, config.head_dim)
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        storage = {"float16": xp.float16, "bfloat16": xp.uint16, "int8": xp.int8}[dtype]
        self.k = xp.zeros(shape, dtype=storage)          # [layers, blocks, bs, n_kv, hd]
        self.v = xp.zeros(shape, dtype=storage)
        if dtype == "int8":
            self.k_scale = xp.zeros(shape[:4], dtype=xp.float32)       # [layers, blocks, bs, n_kv]
            self.v_scale = xp.zeros(shape[:4], dtype=xp.float32)
        if xp is not np:     # the fill ran on the current stream; the model's stream does not wait for it
            xp.cuda.Device().synchronize()

    @staticmethod
    def bytes_per_block_for(config, block_size: int, dtype: str = "float16") -> int:
        """Keys + values of one block, every layer (2 bytes a value, or 1 and a 4-byte scale a vector for
        int8): to size a pool before allocating it."""
        return block_size * (int8_kv_bytes_per_token(config) if dtype == "int8" else config.kv_bytes_per_token(2))

    @property
    def nbytes(self) -> int:
        scales = self.k_scale.nbytes + self.v_scale.nbytes if self.dtype == "int8" else 0
        return self.k.nbytes + self.v.nbytes + scales

    def layer(self, i: int) -> tuple:
        """One layer's pool for the kernels: (k, v, scales), scales = (k_scale, v_scale) or None (16-bit)."""
        return self.k[i], self.v[i], ((self.k_scale[i], self.v_scale[i]) if self.dtype == "int8" else None)

    def write(self, *args, **kw):
        raise NotImplementedError("the device pool is written by paged_kv_write (GPUBatchedRunner)")

    def read(self, layer: int, block_table, length: int, first_block: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """PagedKVCache.read on the host in fp32 (tests, debugging): positions first_block * block_size ..
        length - 1.   -> k, v: [n_kv, n, hd]"""
        blocks = np.asarray(block_table[first_block:math.ceil(length / self.block_size)], dtype=np.int64)
        n = length - first_block * self.block_size
        k, v, scales = self.layer(layer)
        out = []
        for pool, scale in zip((k, v), scales or (None, None)):
            x = _host(pool[blocks.tolist()])                            # [nb, bs, n_kv, hd]  the gather
            x = x.reshape(-1, *x.shape[2:])[:n]                         # [n, n_kv, hd]
            if scale is None:
                x = to_dtype(x, "float32")
            else:                                                       # code · scale
                x = x.astype(np.float32) * _host(scale[blocks.tolist()]).reshape(-1, x.shape[1])[:n, :, None]
            out.append(x.transpose(1, 0, 2))                            # [n_kv, n, hd]
        return out[0], out[1]


def _host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else a


@dataclass
class BatchMeta:
    """What the kernels need to know about a packed batch, as int32 (one upload for all of it)."""
    tokens: object          # [N]   token ids
    positions: object       # [N]   absolute position of each row
    slots: object           # [N]   flat pool slot (block * block_size + offset) each row's K/V goes to
    seq_of_row: object      # [N]   which chunk (row of block_tables) each row belongs to
    last_rows: object       # [B]   each chunk's last row (its next-token logits)
    block_tables: object    # [B, max_blocks]  padded with 0 past each sequence's last block


def batch_meta(chunks: list[SeqChunk], block_size: int, upload) -> BatchMeta:
    """Pack the chunks on the host (batched.pack) and upload the int32 metadata in one copy."""
    tokens, positions, last_rows = pack(chunks)                                          # [N], [N], [B]
    lengths = [len(c.token_ids) for c in chunks]
    table_len = [math.ceil(c.end / block_size) for c in chunks]                          # blocks in use
    tables = np.zeros((len(chunks), max(table_len)), dtype=np.int32)                     # [B, max_blocks]
    for b, (c, n) in enumerate(zip(chunks, table_len)):
        tables[b, :n] = c.block_table[:n]
    seq_of_row = np.repeat(np.arange(len(chunks)), lengths)                             # [N]
    slots = tables[seq_of_row, positions // block_size].astype(np.int64) * block_size + positions % block_size
    parts = [tokens, positions, slots, seq_of_row, last_rows, tables.reshape(-1)]
    flat = upload(np.concatenate(parts).astype(np.int32))
    views, start = [], 0
    for p in parts:
        views.append(flat[start:start + len(p)])
        start += len(p)
    return BatchMeta(*views[:5], views[5].reshape(tables.shape))


class GPUBatchedRunner:
    """Runs a GPUTransformer's weights over many sequences at once, their KV in a DevicePagedKV.
    Same contract as batched.BatchedRunner: forward(chunks) -> logits [B, vocab] fp32 on the host."""

    def __init__(self, model, pool: DevicePagedKV, ops=None):
        c = model.config
        if c.head_dim > PA_MAX_HD or c.n_heads % c.n_kv_heads:
            raise ValueError(f"paged attention needs head_dim <= {PA_MAX_HD} and n_heads % n_kv_heads == 0")
        self.model, self.pool = model, pool
        self.ops = ops or DeviceOps(model)

    def forward(self, chunks: list[SeqChunk], all_logits: bool = False) -> np.ndarray:
        """Run every chunk; -> logits [len(chunks), vocab] at each chunk's last token (all_logits:
        [N, vocab], every token, in chunk order). Host fp32."""
        m, ops, pool = self.model, self.ops, self.pool
        with ops.stream():
            meta = batch_meta(chunks, pool.block_size, ops.upload)
            x = ops.embed(meta.tokens)                                                    # [N, dim] fp32
            for i, layer in enumerate(m.layers):
                h = ops.rmsnorm(x, layer.attn_norm)                                       # [N, dim] 16-bit
                qkv = ops.gemm(h, layer.wqkv)                                             # [N, qkv_width] fp32
                ops.rope(qkv, meta.positions)                                             # q and k heads, in place
                k_pool, v_pool, scales = pool.layer(i)                                    # scales: the int8 pool's
                ops.kv_write(qkv, meta.slots, k_pool, v_pool, scales)                     # new K/V into their slots
                attn = ops.attention(qkv, k_pool, v_pool, meta, scales=scales)            # [N, n_heads * hd] fp32
                ops.gemm(ops.cast(attn), layer.wo, out=x, accumulate=True)                # x += o_proj(attn)
                h = ops.rmsnorm(x, layer.mlp_norm)                                        # [N, dim] 16-bit
                gu = ops.gemm(h, layer.wgu)                                               # [N, 2 * ffn] fp32
                ops.gemm(ops.swiglu(gu), layer.wdown, out=x, accumulate=True)             # x += down(act)
            if not all_logits:
                x = x[meta.last_rows]                                                     # [B, dim]
            return ops.head(x)                                                            # [B or N, vocab] host


class DeviceOps:
    """The forward pass's steps as launches on the model's stream: minillm.cuda.kernels for what the
    single-sequence path already has, paged_attention.cu for the three paged steps, cuBLAS for GEMMs."""

    def __init__(self, model):
        from minillm.cuda.kernels import module, suffix
        from minillm.cuda.gpu_kv_cache import device_dtype
        cp = _cp()
        self.xp, self.model, self.k = cp, model, model.k
        self.narrow = device_dtype(model.dtype)
        sfx = suffix(model.dtype)
        mod = module("paged_attention")
        self.fn = {"attention": mod.get_function(f"paged_attention_{sfx}"),
                   "kv_write": mod.get_function(f"paged_kv_write_{sfx}"),
                   "attention_int8": mod.get_function("paged_attention_int8"),      # over the int8 pool
                   "kv_write_int8": mod.get_function("paged_kv_write_int8"),
                   "rope": mod.get_function("rope_at_positions")}

    def stream(self):
        return self.model.stream

    def upload(self, a: np.ndarray):
        return self.xp.asarray(a)

    def embed(self, tokens):
        x = self.xp.empty((tokens.shape[0], self.model.config.dim), self.xp.float32)
        self.k.embed(tokens, self.model.embed, x)
        return x

    def rmsnorm(self, x, gain):
        out = self.xp.empty(x.shape, self.narrow)
        self.k.rmsnorm(x, gain, out, self.model.config.norm_eps)
        return out

    def gemm(self, a, w, out=None, accumulate: bool = False):
        """out [N, rows] fp32 (+)= a [N, in] 16-bit @ w [rows, in]ᵀ (GPUTransformer.gemm: cuBLAS, fp32 accumulate)"""
        if out is None:
            out = self.xp.empty((a.shape[0], w.shape[0]), self.xp.float32)
        self.model.gemm(a, w, out, accumulate)
        return out

    def rope(self, qkv, positions) -> None:
        c = self.model.config
        self.fn["rope"]((qkv.shape[0], c.n_heads + c.n_kv_heads), (c.head_dim // 2,),
                        (qkv, np.int32(qkv.shape[1]), np.int32(c.head_dim), positions, self.model.inv_freq))

    def kv_write(self, qkv, slots, k_pool, v_pool, scales=None) -> None:
        """Each row's new key and value into its slot; scales = (k_scale, v_scale): the int8 pool (quantized)."""
        c = self.model.config
        head = (qkv, np.int32(qkv.shape[1]), np.int32(c.n_heads), np.int32(c.n_kv_heads), np.int32(c.head_dim),
                slots, k_pool, v_pool)
        if scales is None:
            self.fn["kv_write"]((qkv.shape[0], c.n_kv_heads), (min(c.head_dim, 256),), head)
        else:                                            # a warp for the key, one for the value
            self.fn["kv_write_int8"]((qkv.shape[0], c.n_kv_heads), (64,), head + tuple(scales))

    def attention(self, qkv, k_pool, v_pool, meta: BatchMeta, out=None, scales=None):
        """The queries of qkv [N, width] against their sequences' keys in one layer's pool -> [N, n_heads * hd]
        scales = (k_scale, v_scale): k_pool, v_pool are the int8 pool's codes."""
        c, hd = self.model.config, self.model.config.head_dim
        N = qkv.shape[0]
        if out is None:
            out = self.xp.empty((N, c.n_heads * hd), self.xp.float32)
        pools = (k_pool, v_pool) + (tuple(scales) if scales is not None else ())
        self.fn["attention" if scales is None else "attention_int8"](
            (N, c.n_heads), (32 * PA_WARPS,),
            (qkv, np.int32(qkv.shape[1])) + pools + (np.int32(k_pool.shape[1]), np.int32(c.n_heads),
                                                     np.int32(c.n_kv_heads), np.int32(hd), meta.block_tables,
                                                     np.int32(meta.block_tables.shape[1]), meta.seq_of_row,
                                                     meta.positions, np.int32(c.sliding_window or 0),
                                                     np.float32(1.0 / math.sqrt(hd)), out))
        return out

    def cast(self, x):
        out = self.xp.empty(x.shape, self.narrow)
        self.k.cast(x, out)
        return out

    def swiglu(self, gu):
        out = self.xp.empty((gu.shape[0], gu.shape[1] // 2), self.narrow)
        self.k.swiglu(gu, out)
        return out

    def head(self, x) -> np.ndarray:
        """Final norm + LM head, then the one device-to-host copy of the step."""
        logits = self.gemm(self.rmsnorm(x, self.model.final_norm), self.model.lm_head)   # [rows, vocab] fp32
        host = logits.get()
        self.model.stream.synchronize()
        return host


# ---- the NumPy twin: each kernel's reference, and a host stand-in for GPUTransformer -------------------

@dataclass
class HostModel:
    """GPUTransformer's weights as host arrays (16-bit matrices, fp32 norms), for HostOps."""
    config: object
    layers: list
    embed: np.ndarray
    final_norm: np.ndarray
    lm_head: np.ndarray
    inv_freq: np.ndarray
    dtype: str = "float16"

    @classmethod
    def from_cpu(cls, model, dtype: str = "float16") -> "HostModel":
        """What GPUTransformer.from_cpu uploads, kept on the host (plain, unquantized weights only)."""
        narrow = lambda *parts: to_dtype(np.concatenate([to_dtype(np.asarray(p), "float32") for p in parts]), dtype)
        f32 = lambda a: to_dtype(np.asarray(a), "float32")
        layers = [GPULayer(f32(L.attn_norm), narrow(L.wq, L.wk, L.wv), narrow(L.wo), f32(L.mlp_norm),
                           narrow(L.w_gate, L.w_up), narrow(L.w_down)) for L in model.layers]
        c = model.config
        return cls(c, layers, narrow(model.embed), f32(model.final_norm), narrow(model.lm_head),
                   rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling), dtype)


def paged_attention_reference(qkv: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, block_tables: np.ndarray,
                              seq_of_row: np.ndarray, positions: np.ndarray, n_heads: int,
                              window: int | None = None) -> np.ndarray:
    """What paged_attention.cu computes: each row's queries (the first n_heads heads of its qkv row)
    against its sequence's keys [lo, p], gathered through the block table.  -> [N, n_heads * hd] fp32"""
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


class HostOps:
    """DeviceOps in NumPy, step for step (16-bit where the device narrows, fp32 elsewhere)."""
    xp = np

    def __init__(self, model: HostModel):
        self.model = model
        c = model.config
        self.narrow = lambda a: to_dtype(np.asarray(a, np.float32), model.dtype)
        self.wide = lambda a: to_dtype(a, "float32")
        self.n_rot, self.hd = c.n_heads + c.n_kv_heads, c.head_dim

    def stream(self):
        return contextlib.nullcontext()

    def upload(self, a: np.ndarray) -> np.ndarray:
        return a

    def embed(self, tokens):
        return self.wide(self.model.embed[tokens])                                        # [N, dim]

    def rmsnorm(self, x, gain):
        return self.narrow(rmsnorm(x, gain, self.model.config.norm_eps))

    def gemm(self, a, w, out=None, accumulate: bool = False):
        y = self.wide(a) @ self.wide(w).T                                                 # [N, rows]
        if out is None:
            return y
        if accumulate:
            out += y
        else:
            out[...] = y
        return out

    def rope(self, qkv, positions) -> None:
        cos, sin = rope_tables(positions, self.model.inv_freq)                            # [N, hd/2] each
        width = self.n_rot * self.hd
        heads = qkv[:, :width].reshape(len(qkv), self.n_rot, self.hd)                     # [N, H + n_kv, hd]
        qkv[:, :width] = apply_rope(heads, cos, sin).reshape(len(qkv), width)

    def kv_write(self, qkv, slots, k_pool, v_pool, scales=None) -> None:
        c = self.model.config
        nq, nkv, hd = c.n_heads * self.hd, c.n_kv_heads * self.hd, self.hd
        for pool, new, scale in zip((k_pool, v_pool), (qkv[:, nq:nq + nkv], qkv[:, nq + nkv:nq + 2 * nkv]),
                                    scales or (None, None)):
            flat = pool.reshape(-1, c.n_kv_heads, hd)                                     # [blocks * bs, n_kv, hd] view
            if scale is None:
                flat[slots] = self.narrow(new).reshape(-1, c.n_kv_heads, hd)
            else:                                                                         # the CPU pools' format
                codes, vector_scales = quantize_vectors(new.reshape(-1, c.n_kv_heads, hd))  # [N, n_kv, hd], [N, n_kv]
                flat[slots], scale.reshape(-1, c.n_kv_heads)[slots] = codes, vector_scales

    def attention(self, qkv, k_pool, v_pool, meta: BatchMeta, out=None, scales=None):
        c = self.model.config
        if scales is not None:                                                            # code · scale
            k_pool, v_pool = (p.astype(np.float32) * s[..., None] for p, s in zip((k_pool, v_pool), scales))
        return paged_attention_reference(qkv, k_pool, v_pool, meta.block_tables, meta.seq_of_row, meta.positions,
                                         c.n_heads, c.sliding_window)

    def cast(self, x):
        return self.narrow(x)

    def swiglu(self, gu):
        ffn = gu.shape[1] // 2
        return self.narrow(silu(gu[:, :ffn]) * gu[:, ffn:])                              # [N, ffn]

    def head(self, x) -> np.ndarray:
        return self.gemm(self.rmsnorm(x, self.model.final_norm), self.model.lm_head)


def is_gpu_model(model) -> bool:
    """Is this a GPUTransformer (without importing CuPy to find out)?"""
    from minillm.cuda.gpu_model import GPUTransformer
    return isinstance(model, GPUTransformer)
