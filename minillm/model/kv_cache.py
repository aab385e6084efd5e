"""The KV cache: every layer's keys and values for the positions seen so far.

Without it, each new token would recompute K and V for the whole prefix (O(N²) work for N tokens);
with it, decode computes K and V for one position and appends them (O(N)). The cost is memory:
2 × n_layers × n_kv_heads × head_dim values per token (`ModelConfig.kv_bytes_per_token`).

This is the contiguous form: one preallocated block per layer, sized for the longest sequence the
caller asks for. A paged cache (blocks handed out on demand) comes with continuous batching.

`MLACache` is the same contract for multi-head latent attention (mla.py): per token it keeps the
latent c_KV and the shared RoPE key, kv_lora_rank + qk_rope_head_dim values a layer, no heads at all.

`Int8KVCache` is the same contract as `KVCache` with a quarter of the bytes: int8 values and one
fp32 scale per (layer, kv_head, position) vector of head_dim values; `Fp8KVCache` the same bytes as E4M3
codes. Each cache is made in the array module it is given (NumPy, or CuPy for the engine's Transformer on
the GPU, cuda/device_model.py) and quantizes there: the same codes and scales on either.
"""
from __future__ import annotations

import numpy as np

from minillm.backend import array_module, as_f32
from minillm.model.config import ModelConfig


# The KV-cache format, one vocabulary on every backend: "auto" keeps keys and values in the float type
# the model computes in (fp32 on the CPU, the weights' fp16/bf16 on the GPU), as vLLM's kv_cache_dtype
# "auto" does; "int8" stores codes with one scale per (token, KV head) vector; "fp8" E4M3 codes with one
# the same way (Fp8KVCache; on cuda the engine's Transformer keeps it: the kernels have no fp8 cache).
KV_CACHE_FORMATS = ("auto", "int8", "fp8")


def kv_cache_format(name: str, device: str = "cpu") -> str:
    """Check a kv_cache choice and return its canonical name ("float32" is the CPU's "auto" by name)."""
    if name == "float32" and device == "cpu":
        return "auto"
    if name not in KV_CACHE_FORMATS:
        hint = " (on cuda the float cache is the weights' 16 bits: 'auto')" if name == "float32" else ""
        raise ValueError(f"unknown kv_cache {name!r}{hint}; choose {' or '.join(KV_CACHE_FORMATS)}")
    return name


class CacheBase:
    """What every cache here shares: the count of filled positions (all layers agree; it advances
    once per forward pass, after the last layer) and the bytes it holds."""
    length = 0
    max_seq_len: int | None = None

    def advance(self, n_tokens: int) -> None:
        self.length += n_tokens

    def reset(self) -> None:
        self.length = 0

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` positions (speculative decoding's rejected drafts): the
        positions after them are zeroed, so the arrays equal a cache that never saw them."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.clear(length, self.length)
        self.length = length

    def clear(self, start: int, stop: int) -> None:
        """Zero positions start .. stop-1 of every layer (each cache knows its layout)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in vars(self).values() if hasattr(a, "shape"))   # NumPy or CuPy arrays

    def end_of_write(self, n_new: int) -> int:
        """The position after `n_new` new ones, refusing to run past the capacity."""
        end = self.length + n_new
        if self.max_seq_len is not None and end > self.max_seq_len:
            raise ValueError(f"KV cache is full: {end} positions > capacity {self.max_seq_len}")
        return end


class KVCache(CacheBase):
    def __init__(self, config: ModelConfig, max_seq_len: int, dtype=np.float32, xp=np):
        """xp: the array module the cache lives in (numpy, or cupy: made on the device, nothing crosses the bus)."""
        shape = (config.n_layers, config.n_kv_heads, max_seq_len, config.head_dim)
        self.k = xp.zeros(shape, dtype=dtype)   # [layers, n_kv_heads, max_seq, head_dim]
        self.v = xp.zeros(shape, dtype=dtype)
        self.max_seq_len = max_seq_len
        self.length = 0                         # positions filled so far (all layers agree)

    def append(self, layer: int, k_new: np.ndarray, v_new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write the new positions of one layer; return that layer's keys and values so far.

        k_new, v_new: [n_kv_heads, T, head_dim] -> k, v: [n_kv_heads, length + T, head_dim]
        `length` itself advances once per forward pass, in `advance`, after the last layer.
        """
        start, end = self.length, self.end_of_write(k_new.shape[1])
        self.k[layer, :, start:end] = k_new
        self.v[layer, :, start:end] = v_new
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def clear(self, start: int, stop: int) -> None:
        self.k[:, :, start:stop] = 0
        self.v[:, :, start:stop] = 0



def quantize_vectors(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The int8 KV format: each vector along the last axis gets its own symmetric scale (quant.quantize_int8's
    arithmetic, a vector for a row), in x's array module.   x [..., hd] -> codes int8 [..., hd], scales fp32 [...]"""
    xp = array_module(x)
    x = as_f32(x)
    scales = xp.abs(x).max(axis=-1) / np.float32(127)                       # [...]
    safe = xp.where(scales > 0, scales, np.float32(1))                      # an all-zero vector stays 0
    codes = xp.clip(xp.rint(x / safe[..., None]), -127, 127).astype(xp.int8)
    return codes, scales


def quantize_fp8_vectors(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The fp8 KV format: each vector scaled by amax / 448 to E4M3 codes (formats.quantize_fp8's arithmetic,
    a vector for a row), in x's array module.   x [..., hd] -> codes uint8 [..., hd], scales fp32 [...]"""
    from minillm.model.formats import encode_e4m3, largest

    xp = array_module(x)
    x = as_f32(x)
    scales = xp.abs(x).max(axis=-1) / np.float32(largest("e4m3"))             # [...]
    safe = xp.where(scales > 0, scales, np.float32(1))
    return encode_e4m3(x / safe[..., None]), scales


def int8_kv_bytes_per_token(config: ModelConfig) -> int:
    """Bytes a token adds to an int8 KV cache: head_dim codes and a fp32 scale per K and V vector, every
    layer and KV head (the CPU and GPU caches and pools alike)."""
    return 2 * config.n_layers * config.n_kv_heads * (config.head_dim + 4)


class Int8KVCache(CacheBase):
    """Keys and values as int8, each vector of head_dim values with its own symmetric fp32 scale:

        scale[l, h, p] = max_i |k[l, h, p, i]| / 127      k[l, h, p, :] ≈ k8[l, h, p, :] · scale[l, h, p]

    A scale per token and head follows the outliers of each key (some channels of K are large,
    some tokens too) at head_dim + 4 bytes a vector instead of 4 · head_dim: 0.27 of fp32 at
    head_dim 64, 0.26 at 128. Same contract as `KVCache`: `append` returns fp32 keys and values,
    dequantized, so attention does not change. It is contiguous even for sliding-window models
    (the window is applied by the attention mask instead of a rolling buffer).
    """

    code_dtype = np.int8

    def __init__(self, config: ModelConfig, max_seq_len: int, xp=np):
        """xp: the array module the cache lives and quantizes in (numpy, or cupy: as KVCache)."""
        shape = (config.n_layers, config.n_kv_heads, max_seq_len, config.head_dim)
        self.k = xp.zeros(shape, dtype=self.code_dtype)        # [layers, n_kv_heads, max_seq, head_dim]
        self.v = xp.zeros(shape, dtype=self.code_dtype)
        self.k_scale = xp.zeros(shape[:3], dtype=np.float32)   # [layers, n_kv_heads, max_seq]
        self.v_scale = xp.zeros(shape[:3], dtype=np.float32)
        self.max_seq_len = max_seq_len
        self.length = 0

    quantize = staticmethod(quantize_vectors)    # x [..., hd] -> codes [..., hd], scales [...]

    def widen(self, codes):
        """The values of stored codes, unscaled.   [...] -> [...]"""
        return codes                             # int8 times an fp32 scale is fp32 already: no copy here

    def append(self, layer: int, k_new: np.ndarray, v_new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """k_new, v_new: [n_kv_heads, T, head_dim] -> fp32 k, v: [n_kv_heads, length + T, head_dim]"""
        start, end = self.length, self.end_of_write(k_new.shape[1])
        for new, q, scale in ((k_new, self.k, self.k_scale), (v_new, self.v, self.v_scale)):
            q[layer, :, start:end], scale[layer, :, start:end] = self.quantize(new)   # one scale per vector
        keys = self.widen(self.k[layer, :, :end]) * self.k_scale[layer, :, :end, None]   # [n_kv, end, hd] fp32
        values = self.widen(self.v[layer, :, :end]) * self.v_scale[layer, :, :end, None]
        return keys, values

    def clear(self, start: int, stop: int) -> None:
        for a in (self.k, self.v, self.k_scale, self.v_scale):
            a[:, :, start:stop] = 0



class Fp8KVCache(Int8KVCache):
    """Keys and values as fp8 E4M3 (formats.py), each vector with its own fp32 scale amax / 448, so its
    largest value sits at the top of the grid. The same bytes as int8; the error is relative (≤ 2⁻⁴ of
    each value) where int8's is absolute (≤ scale / 2 for every value of the vector). On the device, where
    CuPy has no fp8 dtype, codes are found on the E4M3 grid (formats.encode_e4m3) and values read from its table."""
    code_dtype = np.uint8                         # fp8 bit patterns
    quantize = staticmethod(quantize_fp8_vectors)

    def widen(self, codes):
        from minillm.model.formats import value_table

        return value_table("e4m3", array_module(codes))[codes]              # a gather from 256 values


class MLACache(CacheBase):
    def __init__(self, config: ModelConfig, max_seq_len: int, dtype=np.float32, xp=np):
        """dtype: fp32, or fp16 (the GPU's default: the latent is MLA's whole saving, so it stays small)."""
        n = (config.n_layers, max_seq_len)
        self.c_kv = xp.zeros(n + (config.kv_lora_rank,), dtype=dtype)       # [layers, max_seq, kv_lora_rank]
        self.k_rope = xp.zeros(n + (config.qk_rope_head_dim,), dtype=dtype)  # [layers, max_seq, qk_rope_head_dim]
        self.max_seq_len = max_seq_len
        self.length = 0

    def append(self, layer: int, c_kv_new: np.ndarray, k_rope_new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write one layer's new latents; return that layer's latents so far.

        c_kv_new: [T, kv_lora_rank], k_rope_new: [T, rope] -> [length + T, kv_lora_rank], [length + T, rope]
        """
        start, end = self.length, self.end_of_write(c_kv_new.shape[0])
        self.c_kv[layer, start:end] = c_kv_new
        self.k_rope[layer, start:end] = k_rope_new
        return self.c_kv[layer, :end], self.k_rope[layer, :end]

    def clear(self, start: int, stop: int) -> None:
        self.c_kv[:, start:stop] = 0
        self.k_rope[:, start:stop] = 0



class RollingKVCache(CacheBase):
    """Mistral's rolling buffer: with a sliding window of W, only the last W positions can ever be
    attended to, so the cache keeps W slots and position p lives in slot p % W. Memory stops growing
    at the window, however long the sequence.

    Same contract as `KVCache`. Keys carry their RoPE rotation from the absolute position they were
    computed at, so attention does not care in which slot they sit.

    spare > 0 (speculative decoding) keeps W + spare slots: a verify pass that writes up to spare + 1
    positions and is then rolled back has overwritten only positions already outside every later
    query's window, so `truncate` loses nothing.
    """

    def __init__(self, config: ModelConfig, window: int, dtype=np.float32, xp=np, spare: int = 0):
        self.n_slots = window + spare
        shape = (config.n_layers, config.n_kv_heads, self.n_slots, config.head_dim)
        self.k = xp.zeros(shape, dtype=dtype)   # [layers, n_kv_heads, window + spare, head_dim]
        self.v = xp.zeros(shape, dtype=dtype)
        self.window = window
        self.max_seq_len = None                 # unbounded: old positions are overwritten
        self.length = 0                         # absolute positions seen so far

    def append(self, layer: int, k_new: np.ndarray, v_new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """k_new, v_new: [n_kv, T, hd] -> the keys and values the T new queries may need.

        Decode (T = 1): all filled slots, in slot order; every one is inside the window.
        Prefill (T > 1): the cached window in position order, then the new positions, so the new
        queries are the last T and the causal sliding-window mask applies as usual.
        """
        T, W, S = k_new.shape[1], self.window, self.n_slots
        if T == 1 and S == W:
            slot = self.length % W
            self.k[layer, :, slot], self.v[layer, :, slot] = k_new[:, 0], v_new[:, 0]
            filled = min(self.length + 1, W)
            return self.k[layer, :, :filled], self.v[layer, :, :filled]
        cached = min(self.length, W)
        slots = np.arange(self.length - cached, self.length) % S              # oldest first
        xp = array_module(self.k)
        keys = xp.concatenate([self.k[layer][:, slots], k_new], axis=1)       # [n_kv, cached + T, hd]
        values = xp.concatenate([self.v[layer][:, slots], v_new], axis=1)
        kept = min(T, S)                                                       # only the last S survive
        new_slots = np.arange(self.length + T - kept, self.length + T) % S
        self.k[layer][:, new_slots], self.v[layer][:, new_slots] = k_new[:, T - kept:], v_new[:, T - kept:]
        return keys, values

    def clear(self, start: int, stop: int) -> None:
        """Zero the slots of positions start .. stop-1, refusing a rollback deeper than the spare slots
        allow (the slots would have held keys still inside the window)."""
        if stop - start > self.n_slots - self.window + 1:
            raise ValueError(f"a rolling cache with {self.n_slots - self.window} spare slots can roll back "
                             f"{self.n_slots - self.window + 1} positions at most, not {stop - start}")
        slots = np.arange(start, stop) % self.n_slots
        self.k[:, :, slots] = 0
        self.v[:, :, slots] = 0
