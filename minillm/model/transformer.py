"""The Transformer: a Llama-family forward pass over a KV cache, readable top to bottom.

`prefill(tokens, cache)` runs the whole prompt at once (big matrix-matrix products: compute-bound);
`decode(token, cache)` runs one new position (matrix-vector products: memory-bound). Both are the
same `forward`, over a different number of new positions.

Attention comes in two kinds, picked once from `config.attention`: "gqa" (`attention_block`, the
Llama path) and "mla" (`mla_block`, DeepSeek's latent attention in mla.py, with its own cache).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
import math

import numpy as np

from minillm.errors import MiniLLMError
from minillm.backend import STORAGE_DTYPES, array_module, as_f32, to_dtype, to_host
from minillm.model.config import ModelConfig
from minillm.model.flashnorm import deferred_linear, deferred_swiglu, inv_rms, is_weightless, require_weightless
from minillm.model.kv_cache import Fp8KVCache, Int8KVCache, KVCache, MLACache, RollingKVCache, kv_cache_format
from minillm.model.layers import ACTIVATION_FUNCTIONS, linear, rmsnorm, rope_inv_freq, rope_tables, rope_frequencies
from minillm.model.mla import MLAWeights, mla_attention, mla_rope
from minillm.model.moe import MoEWeights, moe_block, moe_tensor_names
from minillm.model.pieces import ENGINE_PIECES
from minillm.model.quantized import gather


@dataclass
class LayerWeights:
    """One transformer block, in HF's [out, in] layout, stored in any dtype backend.as_f32 widens.

    MLA layers leave wq, wk, wv, wo as None and keep their attention weights in `mla`; MoE layers
    leave w_gate, w_up, w_down as None and keep their router and experts in `moe` (moe.py).
    """
    attn_norm: np.ndarray   # [dim]
    wq: np.ndarray | None   # [n_heads * hd, dim]
    wk: np.ndarray | None   # [n_kv_heads * hd, dim]
    wv: np.ndarray | None   # [n_kv_heads * hd, dim]
    wo: np.ndarray | None   # [dim, n_heads * hd]
    mlp_norm: np.ndarray    # [dim]
    w_gate: np.ndarray | None   # [ffn_dim, dim]
    w_up: np.ndarray | None     # [ffn_dim, dim]
    w_down: np.ndarray | None   # [dim, ffn_dim]
    mla: MLAWeights | None = None
    moe: MoEWeights | None = None
    wqkv: np.ndarray | None = None       # [(n_heads + 2 n_kv_heads) * hd, dim]  after fuse()
    w_gate_up: np.ndarray | None = None  # [2 * ffn_dim, dim]                    after fuse()
    # Additive biases, by projection ("q", "k", "v", "o", "gate", "up", "down"; see BIASES), [out] each;
    # empty for bias-free models. fuse() adds the stacks "qkv" and "gate_up" (the parts become views).
    bias: dict = field(default_factory=dict)
    q_norm: np.ndarray | None = None         # [hd] QK-norm gains (Qwen3, Gemma 3), shared by every head
    k_norm: np.ndarray | None = None         # [hd]
    attn_out_norm: np.ndarray | None = None  # [dim] Gemma's sandwich norms: on the attention output ...
    mlp_out_norm: np.ndarray | None = None   # [dim] ... and on the MLP output, before each residual add
    sinks: np.ndarray | None = None          # [n_heads] fp32: GPT-OSS's attention sinks (attention.py)

    def fuse(self) -> None:
        """Stack q/k/v into one matrix, and gate/up into another; the separate names become views
        of the stacks, so nothing is stored twice and edits through either name are seen by both.

        Why: one long matrix-vector product streams its bytes faster than three short ones (NumPy
        and BLAS pay a fixed cost per call), and at prefill one GEMM replaces three. Quantized
        weights stay separate: they are not plain arrays.
        """
        if self.wq is not None and _plain_arrays(self.wq, self.wk, self.wv):
            self.wqkv = np.concatenate([self.wq, self.wk, self.wv])
            self.wq, self.wk, self.wv = np.split(self.wqkv, np.cumsum([len(self.wq), len(self.wk)]))
        if self.w_gate is not None and _plain_arrays(self.w_gate, self.w_up):
            self.w_gate_up = np.concatenate([self.w_gate, self.w_up])
            self.w_gate, self.w_up = np.split(self.w_gate_up, 2)
        for stack, fused in (("qkv", self.wqkv), ("gate_up", self.w_gate_up)):
            parts = BIAS_STACKS[stack]
            if fused is not None and parts[0] in self.bias:                 # biases follow their matrices
                self.bias[stack] = np.concatenate([self.bias[n] for n in parts])            # [sum of outs]
                sizes = np.cumsum([len(self.bias[n]) for n in parts[:-1]])
                self.bias.update(zip(parts, np.split(self.bias[stack], sizes)))

    def biases(self) -> list:
        """Each bias array once (the stacks, not their views)."""
        views = {n for stack, parts in BIAS_STACKS.items() if stack in self.bias for n in parts}
        return [b for n, b in self.bias.items() if n not in views]

    def matrices(self, active_experts: int | None = None) -> list:
        """Every weight one forward pass reads, each once (stacks instead of their views); of an MoE
        block all experts, or `active_experts` experts' worth (what one token reads)."""
        attention = ([self.wqkv] if self.wqkv is not None else [self.wq, self.wk, self.wv]) + [self.wo]
        if self.mla is not None:
            attention = [w for w in vars(self.mla).values() if w is not None]
        mlp = [self.w_gate_up] if self.w_gate_up is not None else [self.w_gate, self.w_up]
        mlp = self.moe.matrices(active_experts) if self.moe is not None else mlp + [self.w_down]
        norms = [n for n in (self.q_norm, self.k_norm, self.attn_out_norm, self.mlp_out_norm, self.sinks) if n is not None]
        return [self.attn_norm, self.mlp_norm] + attention + mlp + self.biases() + norms

    @classmethod
    def from_hf(cls, tensors: dict[str, np.ndarray], i: int, attention: str = "gqa",
                config: ModelConfig | None = None) -> "LayerWeights":
        """Layer i from HF-named tensors; `config` says whether its MLP is a sparse MoE block."""
        p = f"model.layers.{i}."
        if config is not None and config.is_moe_layer(i):
            mlp = dict(w_gate=None, w_up=None, w_down=None, moe=MoEWeights.from_hf(tensors, i, config))
        else:
            mlp = dict(w_gate=tensors[p + "mlp.gate_proj.weight"], w_up=tensors[p + "mlp.up_proj.weight"],
                       w_down=tensors[p + "mlp.down_proj.weight"])
        if attention == "mla":
            attn = dict(wq=None, wk=None, wv=None, wo=None, mla=MLAWeights.from_hf(tensors, i))
        else:
            attn = dict(wq=tensors[p + "self_attn.q_proj.weight"], wk=tensors[p + "self_attn.k_proj.weight"],
                        wv=tensors[p + "self_attn.v_proj.weight"], wo=tensors[p + "self_attn.o_proj.weight"])
        norms = {part: norm_gain(tensors[name], config) for part, name in norm_names(config, i).items()}
        return cls(
            **attn,
            **mlp,
            **norms,
            bias={part: tensors[name] for part, name in bias_names(config, i).items()} if config else {},
            sinks=as_f32(tensors[p + "self_attn.sinks"]) if config is not None and config.attention_sinks else None,
        )


def norm_names(config: ModelConfig | None, i: int) -> dict[str, str]:
    """Layer i's norm gains: LayerWeights field -> HF name. Gemma's sandwich names shift: its
    post_attention_layernorm norms the attention output, pre_feedforward_layernorm the MLP input."""
    p = f"model.layers.{i}."
    names = {"attn_norm": p + "input_layernorm.weight", "mlp_norm": p + "post_attention_layernorm.weight"}
    if config is not None and config.sandwich_norms:
        names |= {"mlp_norm": p + "pre_feedforward_layernorm.weight",
                  "attn_out_norm": p + "post_attention_layernorm.weight",
                  "mlp_out_norm": p + "post_feedforward_layernorm.weight"}
    if config is not None and config.qk_norm:
        names |= {"q_norm": p + "self_attn.q_norm.weight", "k_norm": p + "self_attn.k_norm.weight"}
    return names


def norm_gain(w, config: ModelConfig | None):
    """The gain a norm multiplies by: w, or Gemma's 1 + w (added once here, in fp32 as HF computes it)."""
    return as_f32(w) + np.float32(1.0) if config is not None and config.norm_plus_one else w


# Bias tensors: our short name -> (the HF module it belongs to, the ModelConfig flag that says it exists).
BIASES = {"q": ("self_attn.q_proj", "qkv_bias"), "k": ("self_attn.k_proj", "qkv_bias"),
          "v": ("self_attn.v_proj", "qkv_bias"), "o": ("self_attn.o_proj", "o_bias"),
          "gate": ("mlp.gate_proj", "mlp_bias"), "up": ("mlp.up_proj", "mlp_bias"), "down": ("mlp.down_proj", "mlp_bias")}


# The stacked biases fuse() makes, and the parts each one stacks (in that order).
BIAS_STACKS = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


def bias_names(config: ModelConfig, i: int) -> dict[str, str]:
    """The bias tensors layer i has: short name -> HF name (`model.layers.{i}.self_attn.q_proj.bias`, ...)."""
    return {part: f"model.layers.{i}.{module}.bias" for part, (module, flag) in BIASES.items()
            if getattr(config, flag) and not (module.startswith("mlp.") and config.is_moe_layer(i))}


def _moe_tensors(config: ModelConfig, i: int, moe: MoEWeights) -> dict:
    """Layer i's MoE block under its HF names (the inverse of MoEWeights.from_hf)."""
    names = moe_tensor_names(config, i)
    t = {names["router"]: moe.router}
    if moe.bias is not None:
        t[names["bias"]] = moe.bias
    if moe.router_bias is not None:
        t[names["router_bias"]] = moe.router_bias
    for e, expert in enumerate(moe.experts):
        t |= dict(zip(names[f"experts.{e}"], expert.matrices()))
        t |= dict(zip(names.get(f"expert_biases.{e}", ()), expert.biases or ()))
    if moe.shared is not None:
        t |= dict(zip(names["shared"], moe.shared.matrices()))
    return t


def _checked_options(config: ModelConfig, kv_cache: str, mla_mode: str, prefill_chunk: int) -> tuple[str, str, int]:
    kv_cache = kv_cache_format(kv_cache)
    if kv_cache in ("int8", "fp8") and config.attention != "gqa":
        raise ValueError(f"kv_cache={kv_cache!r} supports Llama-style (GQA) attention only, not MLA")
    if mla_mode not in ("absorbed", "naive", "naive-prefill"):   # naive-prefill: naive for T > 1 (mla.py)
        raise ValueError(f"unknown mla_mode {mla_mode!r}; choose absorbed, naive or naive-prefill")
    if int(prefill_chunk) < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    return kv_cache, mla_mode, int(prefill_chunk)


class NonFiniteLogits(MiniLLMError):
    """The forward pass produced NaN or Inf logits: corrupt weights, or activations that overflowed."""


def require_finite(logits, positions=None):
    """`logits` [T, vocab], if every value is finite; else NonFiniteLogits naming the first bad row.

    Sampling would turn NaNs into token 0 without a word (argmax of NaNs is 0). One pass over [T, vocab]
    next to the LM head's [vocab, dim] matmul that made them: nothing measurable per token."""
    xp = array_module(logits)
    if bool(xp.isfinite(logits).all()):
        return logits
    row = int(to_host(~xp.isfinite(logits).all(axis=-1)).argmax())
    where = f"position {int(positions[row])}" if positions is not None else f"row {row} of the batch"
    raise NonFiniteLogits(f"the model's logits are NaN/Inf at {where}: its weights are corrupt or its "
                          "activations overflowed")


def _stored_gain(gain, config: ModelConfig):
    """The inverse of norm_gain: what the checkpoint stores."""
    return gain - np.float32(1.0) if config.norm_plus_one else gain


def _is_longrope(config: ModelConfig) -> bool:
    return (config.rope_scaling or {}).get("rope_type") == "longrope"


def _plain_arrays(*weights) -> bool:
    return all(type(w) is np.ndarray or isinstance(w, np.memmap) for w in weights) and \
        len({w.dtype for w in weights}) == 1


class Transformer:
    """The model: its weights, how it runs (options fixed at construction), prefill and decode."""
    # FlashNorm (flashnorm.py), set by the constructor: norms deferred past the projections (Prop. 2).
    flashnorm = False
    defer_head = False
    pieces = ENGINE_PIECES    # norm, RoPE, cache write, attention: a student's in course/student.py

    def __init__(self, config: ModelConfig, tensors: dict[str, np.ndarray], flashnorm: bool = False,
                 kv_cache: str = "auto", mla_mode: str = "absorbed", prefill_chunk: int = 512, comm=None):
        """flashnorm: run the deferred normalization; the gains must already be folded (all-ones norms,
        flashnorm.fold_checkpoint), else ValueError. kv_cache: "auto" (fp32 here) or "int8"
        (Int8KVCache: a quarter of the bytes; GQA models only). mla_mode (MLA only): "absorbed" (attend
        in latent space) or "naive" (expand K and V per head); the same numbers. prefill_chunk: prompts
        longer than this run in chunks, so attention scores stay [heads, chunk, L], not [heads, L, L].
        comm: tensor parallelism (engine/parallel): an object with all_reduce and all_gather; config and
        tensors are then this rank's shard (engine/parallel/sharding.py)."""
        self.config = config
        self.comm = comm
        self.kv_cache, self.mla_mode, self.prefill_chunk = _checked_options(config, kv_cache, mla_mode, prefill_chunk)
        tensors = gather(config, tensors)                                   # quantized: qweight/scales -> one weight
        self.embed = tensors["model.embed_tokens.weight"]                   # [vocab, dim]
        self.layers = [LayerWeights.from_hf(tensors, i, config.attention, config) for i in range(config.n_layers)]
        for layer in self.layers:
            layer.fuse()
        self.final_norm = norm_gain(tensors["model.norm.weight"], config)   # [dim]
        self.lm_head = tensors.get("lm_head.weight", self.embed)            # [vocab, dim] (tied: the embedding)
        if config.tie_embeddings:
            self.lm_head = self.embed
        if flashnorm and any(layer.bias for layer in self.layers):     # Prop. 2 would scale the bias by 1/RMS too
            raise ValueError("flashnorm is not implemented for models with biases (attention_bias, mlp_bias, Qwen2)")
        if flashnorm and (config.qk_norm or config.sandwich_norms):
            raise ValueError("flashnorm is not implemented for QK-norm or sandwich norms (Qwen3, Gemma 3)")
        self.activation = ACTIVATION_FUNCTIONS[config.activation]         # the gated MLP's: SwiGLU or GeGLU
        if flashnorm:   # a tied head keeps its final-norm gain unless untied: then it is normalized first
            self.flashnorm = require_weightless(self.layers)
            self.defer_head = is_weightless(self.final_norm)
        self.rope_gain = 1.0                                                # YaRN scales cos and sin
        self.cache_dtype = np.float32       # of the float caches; 16-bit when on the GPU (cuda.device_model)
        if config.attention == "mla":
            self.inv_freq, self.rope_gain = mla_rope(config)
            self.attend = self.mla_block
        else:
            self.inv_freq, self.rope_gain = rope_frequencies(config)       # [rotary_dim/2]; YaRN/LongRoPE gain
            self.attend = self.attention_block
        # LongRoPE (Phi-3): sequences past the pretraining context turn at the long factors instead.
        self.inv_freq_long = rope_frequencies(config, long=True)[0] if _is_longrope(config) else None
        # Gemma 3: windowed layers rotate with their own base; None: every layer uses inv_freq.
        self.inv_freq_local = None if config.rope_local_theta is None else \
            rope_inv_freq(config.head_dim, config.rope_local_theta)

    def new_cache(self, max_seq_len: int | None = None, spare: int = 0) -> KVCache | RollingKVCache | MLACache | Int8KVCache:
        """A cache for up to `max_seq_len` positions (default: the model's context). With a sliding
        window shorter than that, a rolling buffer of the window's size is all that is needed.
        kv_cache "int8" always gives a contiguous Int8KVCache (the window is then a mask).
        spare: positions a forward may write and then roll back (speculative decoding's drafts): the
        rolling buffer keeps that many slots more, so a rollback never loses a key still in the window."""
        cfg = self.config
        n = max_seq_len or cfg.max_seq_len
        xp, dtype = array_module(self.embed), self.cache_dtype               # made where the weights are
        if cfg.attention == "mla":
            return MLACache(cfg, n, dtype, xp)
        if self.kv_cache == "int8":
            return Int8KVCache(cfg, n, xp)
        if self.kv_cache == "fp8":
            return Fp8KVCache(cfg, n, xp)
        if cfg.sliding_window is not None and n > cfg.sliding_window:
            return RollingKVCache(cfg, cfg.sliding_window, dtype, xp, spare=spare)
        return KVCache(cfg, n, dtype, xp)

    def with_options(self, **options) -> "Transformer":
        """The same weights run another way: a copy with some of kv_cache, mla_mode, prefill_chunk changed."""
        unknown = set(options) - {"kv_cache", "mla_mode", "prefill_chunk"}
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(sorted(unknown))}")
        current = {"kv_cache": self.kv_cache, "mla_mode": self.mla_mode, "prefill_chunk": self.prefill_chunk}
        other = copy.copy(self)
        other.kv_cache, other.mla_mode, other.prefill_chunk = _checked_options(self.config, **(current | options))
        if self.attend.__func__ is Transformer.mla_block:        # bound methods must point at the copy
            other.attend = other.mla_block
        else:
            other.attend = other.attention_block
        return other

    # ---- the two phases ----------------------------------------------------------------------
    def prefill(self, tokens, cache: KVCache, all_logits: bool = False, n_layers: int | None = None) -> np.ndarray:
        """Run the prompt, filling the cache.  -> logits [T, vocab] if all_logits else [vocab]
        n_layers: early exit (forward)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        outputs = []
        for start in range(0, len(tokens), self.prefill_chunk):
            chunk = tokens[start:start + self.prefill_chunk]
            is_last = start + self.prefill_chunk >= len(tokens)
            if all_logits or is_last:                                       # logits come back to the host
                outputs.append(to_host(self.forward(chunk, cache, last_only=not all_logits, n_layers=n_layers)))
            else:
                self.forward(chunk, cache, skip_head=True, n_layers=n_layers)
        return np.concatenate(outputs) if all_logits else outputs[-1][-1]

    def decode(self, token: int, cache: KVCache, n_layers: int | None = None) -> np.ndarray:
        """Run one new position against the cache.  -> logits [vocab]"""
        return to_host(self.forward(np.array([token], dtype=np.int64), cache, n_layers=n_layers)[0])

    # ---- the forward pass ----------------------------------------------------------------------
    def forward(self, tokens: np.ndarray, cache: KVCache, last_only: bool = False,
                skip_head: bool = False, n_layers: int | None = None) -> np.ndarray | None:
        """tokens: [T] new positions, appended after the cache's `length` ones.  -> logits [T or 1, vocab]
        n_layers: early exit (LayerSkip-style self-speculation): only the first n_layers blocks run, then
        the final norm and head as usual; the cache's deeper layers are left untouched."""
        xp = array_module(self.embed)                                       # numpy, or cupy: weights on the GPU
        positions = xp.arange(cache.length, cache.length + len(tokens))
        tokens = xp.asarray(tokens)
        ropes = self.rope(positions)                                        # per layer: cos, sin [T, hd/2]
        x = self.embed_tokens(tokens)                                       # [T, dim]
        layers = self.layers if n_layers is None else self.layers[:n_layers]
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            cos, sin = ropes[i]
            if last_only and i == last and self.attend == self.attention_block:
                # Only the last row reaches the LM head. The last layer still writes every row's k and v
                # into the cache, but attention, o and the MLP run for the last query alone.
                x = self.add_residual(x[-1:], self.attention_block(x, layer, i, cache, cos, sin, last_row_only=True),
                                      layer.attn_out_norm)
            else:
                x = self.add_residual(x, self.attend(x, layer, i, cache, cos, sin), layer.attn_out_norm)
            x = self.add_residual(x, self.ffn(x, layer), layer.mlp_out_norm)
        cache.advance(len(tokens))
        if skip_head:
            return None
        if last_only:
            x = x[-1:]                                                      # only the next token's logits are needed
        return self.head(x, positions[-len(x):])                            # [T or 1, vocab]

    def rope(self, positions, seq_ends=None) -> list:
        """RoPE's cos and sin for every layer: [(cos, sin) [T, hd/2] each] * n_layers, two tables at most
        (Gemma 3's windowed layers have their own base; YaRN (MLA, GPT-OSS) and LongRoPE scale both).
        LongRoPE: rows whose sequence reaches past original_max_position_embeddings (seq_ends [T], default
        this forward's last position + 1, as HF decides per forward) turn at the long factors; keys already
        cached keep the rotation they were written with (as vLLM; HF's generate recomputes them once)."""
        cos, sin = rope_tables(positions, self.inv_freq)                    # [T, hd/2] each
        if self.inv_freq_long is not None:
            xp, original = array_module(positions), self.config.rope_scaling["original_max_position_embeddings"]
            ends = positions.max() + 1 if seq_ends is None else xp.asarray(seq_ends)
            long_rows = ends > original                                     # [T], or one for every row
            if long_rows.any():
                cos_long, sin_long = rope_tables(positions, self.inv_freq_long)
                cos, sin = (array_module(cos).where(long_rows.reshape(-1, 1), a, b)
                            for a, b in ((cos_long, cos), (sin_long, sin)))
        if self.rope_gain != 1.0:
            cos, sin = cos * self.rope_gain, sin * self.rope_gain
        if self.inv_freq_local is None:
            return [(cos, sin)] * self.config.n_layers
        local = rope_tables(positions, self.inv_freq_local)
        return [local if self.config.window(i) is not None else (cos, sin) for i in range(self.config.n_layers)]

    def add_residual(self, x, partial, out_norm) -> np.ndarray:
        """x + a block's output: summed over the tp ranks (one all-reduce after o or down), and normed
        first where the model has sandwich norms (Gemma).   [T, dim] -> [T, dim]"""
        y = self.reduce(partial)
        if out_norm is not None:
            y = rmsnorm(y, out_norm, self.config.norm_eps)
        return x + y

    def ffn(self, x, layer: LayerWeights) -> np.ndarray:
        """The MLP half of a layer, norm included (shared with batched.py).   [T, dim] -> [T, dim]"""
        if self.flashnorm:                                                  # Prop. 2: 1/RMS on the gate, after down
            return deferred_swiglu(x, layer, self.config.ffn_dim, self.config.norm_eps)
        h = self.pieces.rmsnorm(x, layer.mlp_norm, self.config.norm_eps)    # [T, dim]
        if layer.moe is not None:                                           # sparse: k experts a token (moe.py)
            return moe_block(h, layer.moe, self.config)
        return self.mlp_block(h, layer)

    def head(self, x, positions=None) -> np.ndarray:
        """Final norm and LM head (shared with batched.py).   x: [T, dim] -> logits [T, vocab]
        NaN/Inf logits raise NonFiniteLogits, naming the position (`positions` [T]) when given."""
        if self.defer_head:                                                 # Prop. 2: (x · W*) · 1/RMS(x)
            logits = deferred_linear(x, self.lm_head, self.config.norm_eps)
        else:
            logits = linear(self.pieces.rmsnorm(x, self.final_norm, self.config.norm_eps), self.lm_head)
        logits = self.gather_vocab(logits)
        if self.config.final_softcap is not None:                           # Gemma: squashed into (-c, c)
            c = self.config.final_softcap
            logits = array_module(logits).tanh(logits / c) * c
        return require_finite(logits, positions)

    # ---- tensor parallelism (engine/parallel): what moves between ranks; nothing at all without comm ----
    def embed_tokens(self, tokens):
        """The embedding rows of `tokens`.   [T] -> [T, dim]
        Vocab-parallel: this rank holds rows rank·R ... rank·R + R - 1 of the table; other ranks' tokens
        read as zero rows here, and the all-reduce adds in the rank that holds each."""
        if self.comm is None or self.comm.size == 1:
            return self.scale_embedding(as_f32(self.embed[tokens]))
        xp, rows = array_module(self.embed), len(self.embed)
        local = tokens - self.comm.rank * rows                              # [T] row in this rank's block
        mine = (local >= 0) & (local < rows)                                # [T]
        x = as_f32(self.embed[xp.where(mine, local, 0)])                    # [T, dim] (a fresh copy)
        x *= mine[:, None]
        return self.scale_embedding(self.comm.all_reduce(x))

    def scale_embedding(self, x):
        """Gemma: embeddings times sqrt(dim), the factor and the product rounded to the embedding's
        dtype as HF computes them (bf16: sqrt(1152) = 33.94 becomes 34.0).   [T, dim] -> [T, dim]"""
        if not self.config.embed_scale:
            return x
        stored = {np.dtype(t): name for name, t in STORAGE_DTYPES.items()}.get(self.embed.dtype, "float32")
        factor = as_f32(to_dtype(np.array([math.sqrt(self.config.dim)], np.float32), stored))[0]
        x = x * factor
        if stored != "float32" and array_module(x) is np:                   # the product rounded too, as torch's
            x = as_f32(to_dtype(x, stored))
        return x

    def reduce(self, partial):
        """Sum the ranks' partial outputs of a row-parallel matmul (o, down).   [T, dim] -> [T, dim]"""
        return partial if self.comm is None else self.comm.all_reduce(partial)

    def gather_vocab(self, logits):
        """Every rank's block of logits side by side, cut to the vocabulary.   [T, R] -> [T, vocab]"""
        if self.comm is None or self.comm.size == 1:
            return logits
        blocks = self.comm.all_gather(logits)                               # [tp, T, R]
        return blocks.transpose(1, 0, 2).reshape(len(logits), -1)[:, :self.config.vocab_size]

    def attention_block(self, x, layer: LayerWeights, i: int, cache: KVCache, cos, sin,
                        last_row_only: bool = False) -> np.ndarray:
        """Norm, q/k/v, RoPE, the cache append, attention and o.   x: [T, dim] -> [T, dim] ([1, dim] when
        last_row_only: every row's k and v are cached, only the last query attends)."""
        q, k, v = self.qkv(x, layer, cos, sin)                              # [T, heads, hd] each
        keys, values = self.pieces.cache_append(cache, i, k.transpose(1, 0, 2), v.transpose(1, 0, 2))  # [n_kv, L, hd]
        if last_row_only:
            q = q[-1:]                                                      # [1, n_heads, hd]: the last position
        out = self.pieces.attention(q, keys, values, self.config.window(i), sinks=layer.sinks)   # [T or 1, n_heads * hd]
        return linear(out, layer.wo, layer.bias.get("o"))                   # [T or 1, dim]

    def qkv(self, x, layer: LayerWeights, cos, sin):
        """Norm, the q/k/v projections and RoPE: what attention needs besides the cache.
        (Shared with the batched engine, batched.py.)   -> q [T, n_heads, hd], k, v [T, n_kv_heads, hd]"""
        cfg = self.config
        T, hd = x.shape[0], cfg.head_dim
        h = x if self.flashnorm else self.pieces.rmsnorm(x, layer.attn_norm, cfg.norm_eps)   # [T, dim]
        b = layer.bias                                                      # empty, or Qwen2's / attention_bias's
        if layer.wqkv is not None:                                          # one matmul for q, k and v
            qkv = linear(h, layer.wqkv, b.get("qkv"))                       # [T, (n_heads + 2 n_kv) * hd]
            nq, nk = len(layer.wq), len(layer.wk)
            q, k, v = qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:]
        else:
            q, k, v = linear(h, layer.wq, b.get("q")), linear(h, layer.wk, b.get("k")), linear(h, layer.wv, b.get("v"))
        if self.flashnorm:                                                  # Prop. 2: the deferred 1/RMS(x) per row
            s = inv_rms(x, cfg.norm_eps)                                    # [T, 1]
            q, k, v = q * s, k * s, v * s
        q = q.reshape(T, cfg.n_heads, hd)                                   # [T, n_heads, hd]
        k = k.reshape(T, cfg.n_kv_heads, hd)                                # [T, n_kv_heads, hd]
        v = v.reshape(T, cfg.n_kv_heads, hd)                                # [T, n_kv_heads, hd]
        if layer.q_norm is not None:                                        # QK-norm: each head's q and k to unit RMS
            q, k = rmsnorm(q, layer.q_norm, cfg.norm_eps), rmsnorm(k, layer.k_norm, cfg.norm_eps)
        if cfg.attn_scalar is not None:         # attention divides by sqrt(hd); Gemma's scores want sqrt(scalar)
            q = q * np.float32(math.sqrt(hd / cfg.attn_scalar))
        return self.pieces.apply_rope(q, cos, sin), self.pieces.apply_rope(k, cos, sin), v

    def mlp_block(self, h, layer: LayerWeights) -> np.ndarray:
        """SwiGLU (GeGLU for Gemma): down(act(gate(h)) * up(h)), gate and up one matmul when stacked.   [T, dim]"""
        b = layer.bias                                                      # empty unless mlp_bias
        if layer.w_gate_up is None:
            gate, up = linear(h, layer.w_gate, b.get("gate")), linear(h, layer.w_up, b.get("up"))   # [T, ffn_dim]
        else:
            gate_up = linear(h, layer.w_gate_up, b.get("gate_up"))          # [T, 2 * ffn_dim]
            gate, up = gate_up[:, :self.config.ffn_dim], gate_up[:, self.config.ffn_dim:]
        return linear(self.activation(gate) * up, layer.w_down, b.get("down"))   # [T, dim]

    def hf_tensors(self) -> dict[str, np.ndarray]:
        """The HF-named weights this (GQA) model holds: the inverse of __init__, for conversions."""
        t = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.final_norm,
             "lm_head.weight": self.lm_head}
        if self.config.norm_plus_one:                                       # stored as w, held as 1 + w
            t["model.norm.weight"] = self.final_norm - np.float32(1.0)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            t |= {name: _stored_gain(getattr(layer, part), self.config) for part, name in norm_names(self.config, i).items()}
            t |= {p + "self_attn.q_proj.weight": layer.wq, p + "self_attn.k_proj.weight": layer.wk,
                  p + "self_attn.v_proj.weight": layer.wv, p + "self_attn.o_proj.weight": layer.wo,
                  p + "mlp.gate_proj.weight": layer.w_gate, p + "mlp.up_proj.weight": layer.w_up,
                  p + "mlp.down_proj.weight": layer.w_down}
            t |= {name: layer.bias[part] for part, name in bias_names(self.config, i).items()}
            if layer.sinks is not None:
                t[p + "self_attn.sinks"] = layer.sinks
            if layer.moe is not None:                                       # the experts' names instead
                t = {k: v for k, v in t.items() if ".mlp." not in k} | _moe_tensors(self.config, i, layer.moe)
        return t

    def weights_read_per_token(self) -> list:
        """Every array one decode step reads, each once: what decode's memory traffic is made of
        (of an MoE block, k experts' worth: a token reads its k experts only)."""
        arrays, seen = [], set()
        k = self.config.n_experts_per_token or None
        for a in [self.final_norm, self.lm_head] + [m for layer in self.layers for m in layer.matrices(k)]:
            if id(a) not in seen:
                seen.add(id(a))
                arrays.append(a)
        return arrays

    def mla_block(self, x, layer: LayerWeights, i: int, cache: MLACache, cos, sin) -> np.ndarray:
        h = rmsnorm(x, layer.attn_norm, self.config.norm_eps)               # [T, dim]
        return mla_attention(h, layer.mla, i, cache, cos, sin, self.config, self.mla_mode)   # [T, dim]
