"""GPUTransformer: the Llama-family forward pass on the device, same contract as `model.Transformer`.

    gpu = GPUTransformer.from_cpu(cpu_model, dtype="float16")   # or "bfloat16"
    cache = gpu.new_cache(256)
    logits = gpu.prefill(ids, cache)      # float32 numpy [vocab], on the host
    logits = gpu.decode(token, cache)     # float32 numpy [vocab]

Weights: 16-bit (fp16, or bf16 as uint16 bits) in HF's [out, in] layout, q|k|v and gate|up each one matrix, or
int8/int4 layer matrices in minillm.model.quant's layout (qweights.QuantMatrix). Activations and accumulations
are fp32; the KV cache is 16-bit or int8 (`kv_cache="int8"`: Int8KVCache's codes and scales).

Prefill (compute-bound) is forward.run_layers, the batching engine's layer loop, over this sequence's cache
(ContiguousOps): cuBLAS GEMMs, a quantized matrix widened into one reused 16-bit scratch just before its GEMM.
Decode (memory-bound) is only our kernels, 5 launches a layer: [rmsnorm + qkv GEMV + RoPE + KV append],
[attention], [o GEMV + residual], [rmsnorm + gate/up GEMV + SwiGLU], [down GEMV + residual], captured once per
cache as a CUDA graph and replayed per token (graph.GraphDecode). Earlier decode steps: minillm/cuda/dev/lab.py.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from minillm.backend import to_dtype
from minillm.model.config import ModelConfig
from minillm.model.layers import rope_inv_freq
from minillm.cuda import cublas_raw
from minillm.cuda.graph import GraphDecode, capture
from minillm.cuda.gpu_kv_cache import KV_CACHES, GPUKVCache, device_dtype
from minillm.cuda.forward import LayerOps, StepBuffers, run_layers
from minillm.cuda.kernels import Kernels, KernelSettings, n_splits_for
from minillm.cuda.qweights import QuantMatrix, is_quantized, random_matrices


def _cp():
    import cupy
    return cupy


ROWS_GRAPH_MAX = 16     # forwards of up to this many rows with every row's logits replay as a CUDA graph


@dataclass
class GPULayer:
    attn_norm: object   # [dim] fp32
    wqkv: object        # [(n_heads + 2 n_kv_heads) * hd, dim] 16-bit, or a QuantMatrix of that shape
    wo: object          # [dim, n_heads * hd]
    mlp_norm: object    # [dim] fp32
    w_gate_up: object   # [2 * ffn_dim, dim]  (gate rows, then up rows)
    w_down: object      # [dim, ffn_dim]

    def matrices(self) -> list:
        return [self.wqkv, self.wo, self.w_gate_up, self.w_down]


# What GPUTransformer's kernels implement: a Llama-family block (RMSNorm, RoPE at plain, linear or Llama-3
# frequencies on whole heads, GQA attention with one window for every layer, SwiGLU) in 16 bits, int8 or int4.
# A config whose other fields differ from these values uses a piece the kernels do not have: llm.gpu_path then
# runs it as device_model (the engine's Transformer on CuPy), never the kernels without the piece.
# tests/test_gpu_dispatch.py holds every ModelConfig field to KERNEL_FIELDS or to this table.
PLAIN_LLAMA = {"attention": "gqa", "qkv_bias": False, "o_bias": False, "mlp_bias": False, "n_experts": 0,
               "qk_norm": False, "norm_plus_one": False, "sandwich_norms": False, "activation": "silu",
               "embed_scale": False, "layer_windows": None, "rope_local_theta": None, "attn_scalar": None,
               "final_softcap": None, "partial_rotary_factor": 1.0, "attention_sinks": False, "moe_bias": False}
KERNEL_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_dim", "norm_eps",
                 "rope_theta", "rope_scaling", "max_seq_len", "tie_embeddings", "sliding_window", "bos_token_id",
                 "eos_token_id", "family", "torch_dtype", "quantization")
KERNEL_ROPES = ("default", "linear", "llama3")
KERNEL_QUANT = (None, "int8", "int4")


def unsupported(model) -> str | None:
    """Why GPUTransformer cannot run this CPU Transformer (one line), or None. Needs no GPU."""
    c = model.config
    for name, plain in PLAIN_LLAMA.items():
        if getattr(c, name) != plain:
            return f"the kernels have no {name}={getattr(c, name)!r} (a Llama block has {plain!r})"
    rope = (c.rope_scaling or {}).get("rope_type", (c.rope_scaling or {}).get("type", "default"))
    if rope not in KERNEL_ROPES:
        return f"the kernels rotate at {', '.join(KERNEL_ROPES)} RoPE frequencies, not {rope!r}"
    method = (c.quantization or {}).get("method")
    if method not in KERNEL_QUANT:
        return f"the kernels read 16-bit, int8 or int4 weights, not {method}"
    if getattr(model, "kv_cache", "auto") not in KV_CACHES:      # read off the loaded Transformer: fp8
        return f"the kernels keep a 16-bit or int8 KV cache, not {model.kv_cache}"
    return None


def attention_scratch(T: int, n_heads: int, splits: int, head_dim: int) -> tuple:
    """Kernels.attention's parts for T queries: m, l [T, H, S] and acc [T, H, S, hd] fp32, counters [T, H] uint32 (0)."""
    cp, f32 = _cp(), _cp().float32
    return (cp.zeros((T, n_heads, splits), f32), cp.zeros((T, n_heads, splits), f32),
            cp.zeros((T, n_heads, splits, head_dim), f32), cp.zeros((T, n_heads), cp.uint32))


def _checked_options(config: ModelConfig, kv_cache: str, prefill_chunk: int) -> tuple[str, int]:
    if kv_cache not in KV_CACHES:
        raise ValueError(f"kv_cache is one of {KV_CACHES}, not {kv_cache!r}")
    if kv_cache == "int8" and config.head_dim % 8:
        raise ValueError(f"the GPU int8 KV cache needs head_dim % 8 == 0, not {config.head_dim}")
    if int(prefill_chunk) < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    return kv_cache, int(prefill_chunk)


class GPUTransformer(GraphDecode):
    def __init__(self, config: ModelConfig, layers: list[GPULayer], embed, final_norm, lm_head,
                 dtype: str = "float16", use_graph: bool = True, kv_cache: str = "auto", prefill_chunk: int = 1024,
                 settings: KernelSettings = KernelSettings()):
        """kv_cache: "auto" (the weights' 16 bits) or "int8". prefill_chunk: tokens per prefill pass (bounds
        the [T, 2 * ffn] fp32 scratch). settings: how the decode kernels launch (kernels.KernelSettings)."""
        cp = _cp()
        self.kv_cache, self.prefill_chunk = _checked_options(config, kv_cache, prefill_chunk)
        if config.attention != "gqa":
            raise ValueError("GPUTransformer runs MHA/GQA/MQA models; MLA runs on gpu_mla.GPUMLATransformer "
                             "(llm.gpu_path picks)")
        c, hd, f32 = config, config.head_dim, cp.float32
        kernels = Kernels(dtype, settings)
        self.inv_freq = cp.asarray(rope_inv_freq(hd, c.rope_theta, c.rope_scaling))
        self._hold(config, layers, embed, final_norm, lm_head, dtype, use_graph, kernels)
        quantized = [w for L in layers for w in L.matrices() if is_quantized(w)]
        self.quant = quantized[0].method if quantized else None     # "int8", "int4" or None (16-bit)
        self.q_width, self.qkv_width = c.n_heads * hd, (c.n_heads + 2 * c.n_kv_heads) * hd
        # the decode step's activations after x (graph._hold)
        self.h = cp.zeros((1, c.dim), f32)                 # normalized
        self.qkv = cp.zeros((1, self.qkv_width), f32)
        self.attn = cp.zeros((1, self.q_width), f32)
        self.gu = cp.zeros((1, 2 * c.ffn_dim), f32)
        self.act = cp.zeros((1, c.ffn_dim), f32)
        self.logits = cp.zeros(c.vocab_size, f32)
        self._alpha = np.ones(1, np.float32)
        self._beta0 = np.zeros(1, np.float32)
        self._beta1 = np.ones(1, np.float32)
        # prefill widens one quantized matrix at a time into this (the largest matrix's size, reused)
        largest = max((w.shape[0] * w.shape[1] for w in quantized), default=0)
        self._dense_scratch = cp.empty(largest, device_dtype(dtype)) if largest else None
        self._kv_scratch = None          # int8 KV cache: prefill's 16-bit K/V of one layer (sized on first use)
        self.rows_graph_error = None     # why a few-row forward could not be captured (then it runs eagerly)
        self._capturing = False          # inside that capture: GEMMs go through cublas_raw
        cp.cuda.Device().synchronize()     # uploads and zero-fills ran on the default stream: finish them

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def from_cpu(cls, model, dtype: str = "float16", **kw) -> "GPUTransformer":
        """Copy a CPU `minillm.model.transformer.Transformer`'s weights to the device: 16-bit matrices as fp16 or bf16,
        int8/int4 ones (minillm.model.quant) as they are stored; norms fp32; embedding and LM head in `dtype`."""
        cp, cfg = _cp(), model.config
        dev = lambda a: cp.asarray(to_dtype(np.asarray(a), dtype))
        f32 = lambda a: cp.asarray(to_dtype(np.asarray(a), "float32"))

        def stacked(*parts):                 # q|k|v or gate|up as one matrix (or one matrix alone)
            from minillm.model.quant import QuantizedWeight
            quantized = [isinstance(w, QuantizedWeight) for w in parts]
            if all(quantized):
                return QuantMatrix.upload(list(parts))
            if any(quantized):
                raise ValueError("a layer mixes quantized and 16-bit matrices; the GPU path needs one or the other")
            return dev(np.concatenate(parts) if len(parts) > 1 else parts[0])

        layers = [GPULayer(f32(L.attn_norm), stacked(L.wq, L.wk, L.wv), stacked(L.wo), f32(L.mlp_norm),
                           stacked(L.w_gate, L.w_up), stacked(L.w_down)) for L in model.layers]
        embed = dev(model.embed)
        lm_head = embed if model.lm_head is model.embed else dev(model.lm_head)
        return cls(cfg, layers, embed, f32(model.final_norm), lm_head, dtype=dtype, **kw)

    @classmethod
    def random(cls, config: ModelConfig, dtype: str = "float16", seed: int = 0, quant: str | None = None,
               group_size: int = 128, **kw) -> "GPUTransformer":
        """Random weights of `config`'s shape, made on the device (uniform, variance 1/fan_in; with `quant`,
        random int8/int4 codes of that spread): for speed measurements, where the values do not matter."""
        cp, c, hd = _cp(), config, config.head_dim
        mat = random_matrices(Kernels(dtype), dtype, seed, quant, group_size)
        ones = lambda: cp.ones(c.dim, cp.float32)
        layers = [GPULayer(ones(), mat((c.n_heads + 2 * c.n_kv_heads) * hd, c.dim), mat(c.dim, c.n_heads * hd),
                           ones(), mat(2 * c.ffn_dim, c.dim), mat(c.dim, c.ffn_dim))
                  for _ in range(c.n_layers)]
        embed = mat(c.vocab_size, c.dim, quantize=False)
        lm_head = embed if c.tie_embeddings else mat(c.vocab_size, c.dim, quantize=False)
        cp.cuda.Device().synchronize()
        return cls(config, layers, embed, ones(), lm_head, dtype=dtype, **kw)

    def quantized(self, method: str = "int4", group_size: int = 128) -> "GPUTransformer":
        """The layer matrices quantized on the host by minillm.model.quant, the rest shared: speculative decoding's
        int4 self-draft. (Stacked q|k|v and gate|up quantize as their parts would: a group never crosses a row.)"""
        from minillm.model.quant import quantize_int4, quantize_int8
        if self.quant:
            raise ValueError(f"the model is already {self.quant}: it is its own cheap draft only in 16 bits")
        if method not in ("int4", "int8"):
            raise ValueError(f"quantized copies are int4 or int8, not {method!r}")
        cp = _cp()

        def narrow(w):                     # 16-bit device matrix -> QuantMatrix (via the host)
            host = cp.asnumpy(w)           # fp16, or bf16 bits as uint16: quant widens both
            return QuantMatrix.upload([quantize_int4(host, group_size) if method == "int4" else quantize_int8(host)])

        layers = [GPULayer(L.attn_norm, narrow(L.wqkv), narrow(L.wo), L.mlp_norm, narrow(L.w_gate_up), narrow(L.w_down))
                  for L in self.layers]
        return GPUTransformer(self.config, layers, self.embed, self.final_norm, self.lm_head, dtype=self.dtype,
                              use_graph=self.use_graph, kv_cache=self.kv_cache, prefill_chunk=self.prefill_chunk,
                              settings=self.settings)

    def with_options(self, **options) -> "GPUTransformer":
        """A copy with kv_cache, prefill_chunk (as Transformer.with_options) or use_graph (False: the same launches
        one by one) changed, sharing the weights and buffers: run one of the two at a time."""
        cache = {"kv_cache": self.kv_cache, "prefill_chunk": self.prefill_chunk}
        unknown = set(options) - set(cache) - {"use_graph"}
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(sorted(unknown))}")
        other = copy.copy(self)
        other.use_graph = bool(options.get("use_graph", self.use_graph))
        other.kv_cache, other.prefill_chunk = _checked_options(
            self.config, **{name: options.get(name, now) for name, now in cache.items()})
        return other

    def with_settings(self, **changes) -> "GPUTransformer":
        """A copy launching with some KernelSettings changed (a benchmark's variant), sharing weights and buffers."""
        other = copy.copy(self)
        other.k = self.k.with_settings(**changes)
        return other

    @property
    def settings(self) -> KernelSettings:
        return self.k.settings

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights a decode step reads (quantized matrices as stored; the embedding only one row)."""
        per_layer = sum(w.nbytes for L in self.layers for w in L.matrices() + [L.attn_norm, L.mlp_norm])
        return per_layer + self.lm_head.nbytes + self.final_norm.nbytes

    def new_cache(self, max_seq_len: int | None = None, spare: int = 0) -> GPUKVCache:
        """A KV cache for up to `max_seq_len` positions (default: the model's context). `spare` (speculative
        decoding's roll-back room) needs no slots: the cache is contiguous, a rolled-back position is rewritten."""
        capacity = max_seq_len or self.config.max_seq_len
        with self.stream:        # zero-filled on our stream, so no later kernel can overtake the fill
            return GPUKVCache(self.config, capacity, "int8" if self.kv_cache == "int8" else self.dtype)

    # ---- the two phases --------------------------------------------------------------------------
    def prefill(self, tokens, cache: GPUKVCache, all_logits: bool = False, n_layers: int | None = None) -> np.ndarray:
        """Run the prompt, filling the cache.  -> logits [T, vocab] if all_logits else [vocab] (host fp32)
        n_layers: early exit (the first n_layers layers, then the final norm and head), as on the CPU.
        Speculative decoding verifies its drafts here: all_logits over the pending token and the drafts."""
        tokens = np.asarray(tokens, dtype=np.int32).reshape(-1)
        cache.end_of_write(len(tokens))                 # refuses to run past the capacity
        if all_logits and n_layers is None and self._rows_graphable(len(tokens)):
            return self._rows_by_graph(tokens, cache)
        layers, ops, outputs = self.layers[:n_layers], ContiguousOps(self, cache), []
        with self.stream:
            for start in range(0, len(tokens), self.prefill_chunk):
                chunk = tokens[start:start + self.prefill_chunk]
                x = self._prefill_chunk(chunk, cache, layers, ops)                 # [T, dim] fp32, after the last layer
                if all_logits:
                    outputs.append(ops.logits(x).get())                             # [T, vocab]
                elif start + self.prefill_chunk >= len(tokens):
                    self.k.rmsnorm(x[-1:], self.final_norm, self.h, self.config.norm_eps)
                    self.k.gemv(self.lm_head, self.h[0], self.logits)
                    outputs.append(self.logits.get())
            self.stream.synchronize()
        return np.concatenate(outputs) if all_logits else outputs[-1]

    # ---- decode: one token, our kernels only ---------------------------------------------------
    def decode_step(self, cache: GPUKVCache, n_layers: int | None = None) -> None:
        """Enqueue one decode step: token and position from `self.step`, logits into `self.logits`; no allocation,
        host sync or cuBLAS, so it can be captured. n_layers: the first n_layers layers only (early exit)."""
        c, k, hd, x = self.config, self.k, self.config.head_dim, self.x[0]
        parts = self._decode_parts(cache)
        k.embed(self.step_tokens, self.embed, self.x)                                  # [1, dim]
        for i, L in enumerate(self.layers[:n_layers]):
            into = (None, None) if self.kv_cache == "int8" else (cache.k[i], cache.v[i])   # int8: next line
            k.gemv_qkv(L.wqkv, x, L.attn_norm, c.norm_eps, self.qkv[0], self.step_pos, self.inv_freq,
                       *into, c.n_heads, c.n_kv_heads, hd, "qkv")
            if self.kv_cache == "int8":
                self._append_kv(i, cache, self.qkv, 1)
            self._attend(i, cache, self.qkv, 1, parts, self.attn)                      # [1, n_heads * hd]
            k.gemv(L.wo, self.attn[0], x, True, "o")                                   # x += o_proj(attn)
            k.gemv_swiglu(L.w_gate_up, x, L.mlp_norm, c.norm_eps, self.act[0], "gate_up")   # [ffn]
            k.gemv(L.w_down, self.act[0], x, True, "down")                             # x += down(act)
        self._decode_head()

    def _decode_head(self) -> None:
        """logits [vocab] = lm_head · rmsnorm(x, final_norm): one fused GEMV."""
        self.k.gemv_rmsnorm(self.lm_head, self.x[0], self.final_norm, self.config.norm_eps, self.logits, "lm_head")

    def _append_kv(self, i: int, cache, qkv, T: int) -> None:
        """Layer i's keys and values of the T qkv rows [T, width] into the cache at step_pos (int8: quantized)."""
        c = self.config
        if self.kv_cache == "int8":
            self.k.kv_append_int8(qkv, T, c.n_heads, c.n_kv_heads, c.head_dim, cache.k[i], cache.v[i],
                                  cache.k_scale[i], cache.v_scale[i], self.step_pos)
        else:
            self.k.kv_append(qkv, T, c.n_heads, c.n_kv_heads, c.head_dim, cache.k[i], cache.v[i], self.step_pos)

    def _attend(self, i: int, cache, qkv, T: int, parts, out) -> None:
        """The decode attention kernel: T queries of qkv against layer i's cache -> out [T, n_heads * hd]."""
        c = self.config
        scales = (cache.k_scale[i], cache.v_scale[i]) if self.kv_cache == "int8" else None
        self.k.attention(qkv, T, c.n_heads, c.n_kv_heads, c.head_dim, cache.k[i], cache.v[i], self.step_pos,
                         c.sliding_window, parts, out, scales=scales)

    def _decode_parts(self, cache: GPUKVCache):
        """The decode step's attention scratch for this cache's capacity (allocated once: a graph keeps it)."""
        s = n_splits_for(self.config.n_heads, cache.max_seq_len, self.n_sms)
        if s not in self._parts:
            self._parts[s] = attention_scratch(1, self.config.n_heads, s, self.config.head_dim)
        return self._parts[s]

    # ---- prefill: forward.run_layers over the chunk's rows -------------------------------------------------
    def _prefill_chunk(self, chunk: np.ndarray, cache, layers=None, ops=None):
        """The chunk's T tokens through `layers` (default: all), appended to the cache.  -> x [T, dim] fp32"""
        self.step.set(np.array([0, cache.length], dtype=np.int32))
        b = self._prefill_buffers(len(chunk))
        b.tokens.set(chunk)
        x = self._prefill_layers(ops or ContiguousOps(self, cache), b, self.layers if layers is None else layers)
        cache.advance(len(chunk))
        return x

    def _prefill_buffers(self, T: int) -> StepBuffers:
        """The activations of a T-row forward (made before a capture, so a graph's pointers stay valid)."""
        cp = _cp()
        c, nd = self.config, device_dtype(self.dtype)
        rows = lambda width, dtype=cp.float32: cp.empty((T, width), dtype)
        return StepBuffers(x=rows(c.dim), h=rows(c.dim, nd), qkv=rows(self.qkv_width), attn=rows(self.q_width),
                           attn16=rows(self.q_width, nd), gu=rows(2 * c.ffn_dim), act=rows(c.ffn_dim, nd),
                           tokens=cp.empty(T, cp.int32))

    def _prefill_layers(self, ops: "ContiguousOps", b: StepBuffers, layers: list[GPULayer]):
        """Enqueue the forward of b.tokens at the position in self.step: launches only (capturable). -> b.x [T, dim]"""
        return run_layers(ops, layers, None, ops.embed(b.tokens, out=b.x), b)

    # ---- a few rows at once: speculative decoding's verify pass, one CUDA graph ------------------
    def _rows_graphable(self, T: int) -> bool:
        """Can a T-row forward with every row's logits replay as a graph? A short one (a verify pass) over a 16-bit
        cache (the int8 one widens `length + T` positions, which a graph would freeze), unless a capture failed."""
        return (self.use_graph and T <= ROWS_GRAPH_MAX and self.kv_cache != "int8" and self.rows_graph_error is None
                and self.k.prefill_attention_supported(self.config.head_dim))

    def _rows_by_graph(self, tokens: np.ndarray, cache) -> np.ndarray:
        """Logits [T, vocab] of T new positions by replaying the T-row forward + LM head captured for this cache
        (on first use); eager, remembering why in rows_graph_error, if capturing fails."""
        T, key = len(tokens), (self, self.k.settings)
        if cache.rows_key != key:                        # captured by another model or with other settings
            cache.rows_graphs.clear()
            cache.rows_key = key
        with self.stream:
            if T not in cache.rows_graphs:
                b, ops = self._prefill_buffers(T), ContiguousOps(self, cache)
                logits = _cp().empty((T, self.config.vocab_size), _cp().float32)
                graph, _, self.rows_graph_error = self.capture_with_cublas(     # b.h is free once the layers ran
                    lambda: ops.logits(self._prefill_layers(ops, b, self.layers), out=logits, norm_out=b.h))
                if graph is None:
                    return self.prefill(tokens, cache, all_logits=True)
                cache.rows_graphs[T] = (graph, b, logits)
            graph, b, logits = cache.rows_graphs[T]
            b.tokens.set(tokens)
            self.step.set(np.array([0, cache.length], dtype=np.int32))
            graph.launch(self.stream)
            out = logits.get()
            self.stream.synchronize()
        cache.advance(T)
        return out

    def capture_with_cublas(self, step):
        """step()'s launches, cuBLAS's GEMMs among them (through cublas_raw while `_capturing`: CuPy's binding refuses
        cuBLAS under capture), as a CUDA graph on this model's stream: the verify pass's and the batching engine's
        decode graphs. -> (graph, step()'s result, None), or (None, None, why capturing failed)."""
        result = []
        try:
            cublas_raw.prepare(_cp().cuda.device.get_cublas_handle())   # its own workspace, set before capturing
            self._capturing = True
            graph = capture(self.stream, lambda: result.append(step()))
        except Exception as e:                     # no libcublas, CUDA errors, or cuBLAS refusing the capture
            return None, None, f"{type(e).__name__}: {e}"
        finally:
            self._capturing = False
        return graph, result[0], None

    def _prefill_kv(self, i: int, cache, T: int):
        """Layer i's keys and values in 16 bits for the tiled prefill kernel: the cache's arrays, or (int8) its first
        length + T positions widened into a scratch every layer reuses."""
        if self.kv_cache != "int8":
            return cache.k[i], cache.v[i]
        cp = _cp()
        shape = cache.k.shape[1:]                                  # [n_kv_heads, capacity, hd]
        if self._kv_scratch is None or self._kv_scratch[0].shape != shape:
            self._kv_scratch = tuple(cp.empty(shape, device_dtype(self.dtype)) for _ in range(2))
        keys, values = self._kv_scratch
        self.k.kv_dequantize(cache.k[i], cache.v[i], cache.k_scale[i], cache.v_scale[i], cache.length + T,
                             keys, values)
        return keys, values

    def gemm(self, a, w, out, accumulate: bool = False) -> None:
        """out [T, rows] fp32 (+)= a [T, in] (16-bit) @ w [rows, in]ᵀ, on cuBLAS with fp32 accumulation
        (a quantized w is first widened to 16 bits: `_dense`).

        Row-major a and w are column-major aᵀ and wᵀ to cuBLAS, so out (row-major [T, rows] = column-
        major [rows, T]) = op(W) · aᵀ with op = transpose: m = rows, n = T, k = in."""
        cp = _cp()
        from cupy_backends.cuda.libs import cublas
        from cupy.cuda import runtime
        w = self._dense(w)
        T, n_in = a.shape
        rows = w.shape[0]
        ab_type = runtime.CUDA_R_16F if self.dtype == "float16" else runtime.CUDA_R_16BF
        handle = cp.cuda.device.get_cublas_handle()
        beta = self._beta1 if accumulate else self._beta0
        args = (handle, self.stream.ptr, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, rows, T, n_in,
                self._alpha.ctypes.data, w.data.ptr, ab_type, n_in, a.data.ptr, ab_type, n_in,
                beta.ctypes.data, out.data.ptr, runtime.CUDA_R_32F, rows, cublas.CUBLAS_COMPUTE_32F, -1)  # default algo
        if self._capturing:             # CuPy's binding refuses cuBLAS under capture: the same call by ctypes
            cublas_raw.gemm_ex(*args)
            return
        cublas.setStream(handle, self.stream.ptr)
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
        cublas.gemmEx(handle, *args[2:])

    def _dense(self, w):
        """w itself when 16-bit; a quantized w widened into the shared scratch buffer (valid until the
        next call: the GEMM that reads it runs first, on the same stream)."""
        if not is_quantized(w):
            return w
        rows, n_in = w.shape
        out = self._dense_scratch[:rows * n_in].reshape(rows, n_in)
        self.k.dequantize(w, out)
        return out


class ContiguousOps(LayerOps):
    """forward.run_layers' ops for one sequence's rows over its contiguous cache (GPUKVCache), at
    the position in model.step: RoPE, the KV append and the tiled prefill attention of kernels.py."""

    def __init__(self, model: GPUTransformer, cache):
        super().__init__(model)
        self.cache = cache

    def rope(self, qkv, meta) -> None:
        c, m = self.model.config, self.model
        m.k.rope(qkv, qkv.shape[0], c.n_heads + c.n_kv_heads, c.head_dim, m.step_pos, m.inv_freq)

    def kv_write(self, layer: int, qkv, meta) -> None:
        self.model._append_kv(layer, self.cache, qkv, qkv.shape[0])

    def attention(self, layer: int, qkv, meta, out=None):
        """The T queries of qkv [T, width] against the cache (their own keys already in) -> [T, n_heads * hd]"""
        m, c, T = self.model, self.model.config, qkv.shape[0]
        out = self.xp.empty((T, c.n_heads * c.head_dim), self.xp.float32) if out is None else out
        if m.k.prefill_attention_supported(c.head_dim):
            keys, values = m._prefill_kv(layer, self.cache, T)
            m.k.prefill_attention(qkv, T, c.n_heads, c.n_kv_heads, c.head_dim, keys, values, m.step_pos,
                                  c.sliding_window, out)
        else:              # head sizes the tiles do not take: the decode kernel, a query per token (never captured)
            splits = max(1, min(16, (4 * m.n_sms) // (c.n_heads * T)))              # splits only when T is small
            m._attend(layer, self.cache, qkv, T, attention_scratch(T, c.n_heads, splits, c.head_dim), out)
        return out

