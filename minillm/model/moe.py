"""Sparse mixture of experts (Mixtral, Qwen3-MoE, DeepSeek-V3): a router picks k of E SwiGLU experts per token.

A dense layer runs every token through one MLP. An MoE layer holds E expert MLPs and a router, a
[E, dim] matrix that scores each token against each expert; the token goes through its k best
experts only, and their outputs are summed with the router's weights:

    y(x) = Σ_{e in topk(x)} w_e(x) · SwiGLU_e(x)   (+ the shared experts' SwiGLU(x), DeepSeek)

So a model can hold E/k times the MLP parameters of the dense model it costs to run: Mixtral 8x7B
stores 47 B parameters and uses 13 B a token. Two routers:

  softmax (Mixtral)    p = softmax(x Wᵣᵀ) over the E experts; the k largest, renormalized to sum 1
                       (Qwen3-MoE: only when norm_topk_prob; no shared expert). GPT-OSS adds a bias to
                       the logits and softmaxes its top-k logits: the same weights. Its experts
                       have biases and a clamped SwiGLU (`clamped_swiglu`).
  sigmoid (DeepSeek-V3) s = sigmoid(x Wᵣᵀ), each expert scored on its own. The *choice* adds a
                       per-expert correction bias b (trained to balance the load without an
                       auxiliary loss), the *weights* do not: pick by s + b, weigh by s.
                       Group-limited: the E experts form n_group groups; a group scores the sum
                       of its top-2 (s + b); only the topk_group best groups are eligible (on a
                       cluster, a group is a node: a token's experts then sit on few nodes).
                       The k weights are renormalized (norm_topk_prob) and scaled by
                       routed_scaling_factor, and n_shared experts (one SwiGLU) see every token.

Computing it sparsely. Each token's k expert ids are flattened and sorted by expert: then every
expert's tokens are one contiguous run. For each expert with tokens: gather those rows, run the
expert's three matmuls on them alone, scale by the routing weight, scatter-add into the output. The
work is k / E of running every expert on every token, so prefill time follows the active, not the
total, parameters (lesson 22 measures it). At decode (one token) that is k matrix-vector products:
the bytes read are the active experts' only, which is where an MoE's decode speed comes from.

Everything here is written against the array module of its input (NumPy or CuPy).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minillm.backend import array_module, as_f32
from minillm.model.config import ModelConfig
from minillm.model.layers import linear, silu


@dataclass
class Expert:
    """One SwiGLU MLP in HF [out, in] layout (any stored dtype, or a QuantizedWeight)."""
    w_gate: np.ndarray   # [ffn, dim]
    w_up: np.ndarray     # [ffn, dim]
    w_down: np.ndarray   # [dim, ffn]
    biases: tuple | None = None        # GPT-OSS: (gate [ffn], up [ffn], down [dim])
    swiglu_limit: float | None = None  # GPT-OSS: the clamped SwiGLU (clamped_swiglu) instead of SwiGLU
    swiglu_alpha: float = 1.702

    def __call__(self, h):
        """down(silu(gate(h)) * up(h)), or GPT-OSS's clamped form, biases added.   h: [n, dim] -> [n, dim]"""
        b_gate, b_up, b_down = self.biases or (None, None, None)
        gate, up = linear(h, self.w_gate, b_gate), linear(h, self.w_up, b_up)      # [n, ffn] each
        if self.swiglu_limit is None:
            return linear(silu(gate) * up, self.w_down, b_down)
        return linear(clamped_swiglu(gate, up, self.swiglu_alpha, self.swiglu_limit), self.w_down, b_down)

    def matrices(self) -> list:
        return [self.w_gate, self.w_up, self.w_down]


def clamped_swiglu(gate, up, alpha: float, limit: float):
    """GPT-OSS's expert activation: (up + 1) · g · sigmoid(alpha · g), g = gate clamped to at most
    `limit` and up to ±limit. The clamps bound what an outlier token can put through an expert; the +1
    lets up = 0 pass the gate's value on (a plain SwiGLU would zero it).   [n, ffn] each -> [n, ffn]"""
    xp = array_module(gate)
    g = xp.minimum(gate, np.float32(limit))
    u = xp.clip(up, np.float32(-limit), np.float32(limit))
    return (u + 1) * g / (1 + xp.exp(-np.float32(alpha) * g))


@dataclass
class MoEWeights:
    """One layer's sparse MLP: the router, the routed experts, and (DeepSeek) the shared experts."""
    router: np.ndarray             # [E, dim]
    experts: list[Expert]          # E of them, each [moe_ffn, dim] / [dim, moe_ffn]
    bias: np.ndarray | None = None     # [E] DeepSeek's e_score_correction_bias: added for the choice only
    shared: Expert | None = None       # DeepSeek: [n_shared * moe_ffn, dim] ..., every token
    router_bias: np.ndarray | None = None   # [E] GPT-OSS: added to the router's logits (choice and weights)

    def matrices(self, active: int | None = None) -> list:
        """The arrays this block holds; active=k: those one token reads (the router, the shared
        experts and k experts' worth: the first k stand in for whichever are chosen)."""
        experts = self.experts if active is None else self.experts[:active]
        extra = [b for b in (self.bias, self.router_bias) if b is not None]
        shared = self.shared.matrices() if self.shared is not None else []
        biases = [b for e in experts for b in e.biases or ()]
        return [self.router] + extra + shared + [m for e in experts for m in e.matrices()] + biases

    @classmethod
    def from_hf(cls, tensors: dict, i: int, config: ModelConfig) -> "MoEWeights":
        """Layer i's MoE tensors, under Mixtral's or DeepSeek-V3's HF names (see `moe_matrix_names`)."""
        names = moe_tensor_names(config, i)
        experts = [Expert(*(tensors[n] for n in names[f"experts.{e}"]),
                          biases=tuple(tensors[n] for n in names[f"expert_biases.{e}"]) if config.moe_bias else None,
                          swiglu_limit=config.swiglu_limit, swiglu_alpha=config.swiglu_alpha)
                   for e in range(config.n_experts)]
        shared = Expert(*(tensors[n] for n in names["shared"])) if "shared" in names else None
        return cls(router=tensors[names["router"]], experts=experts,
                   bias=tensors.get(names["bias"]) if "bias" in names else None, shared=shared,
                   router_bias=tensors[names["router_bias"]] if "router_bias" in names else None)


def moe_tensor_names(config: ModelConfig, i: int) -> dict:
    """HF tensor names of layer i's MoE block: {"router": name, "bias": name, "experts.e": (gate, up, down),
    "shared": (gate, up, down)} (Mixtral calls gate/up/down w1/w3/w2 under block_sparse_moe)."""
    p = f"model.layers.{i}."
    if config.family == "gpt_oss":     # stacked [E, ...] in the file: checkpoints/hf_layouts.py names each expert's
        m = p + "mlp."
        out = {"router": m + "router.weight", "router_bias": m + "router.bias"}
        for e in range(config.n_experts):
            out[f"experts.{e}"] = tuple(f"{m}experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down"))
            out[f"expert_biases.{e}"] = tuple(f"{m}experts.{e}.{w}_proj.bias" for w in ("gate", "up", "down"))
        return out
    if config.family == "mixtral":
        m = p + "block_sparse_moe."
        out = {"router": m + "gate.weight"}
        for e in range(config.n_experts):
            out[f"experts.{e}"] = tuple(f"{m}experts.{e}.{w}.weight" for w in ("w1", "w3", "w2"))
        return out
    m = p + "mlp."
    out = {"router": m + "gate.weight"}
    if config.family != "qwen3_moe":                                       # DeepSeek-V3's; Qwen3-MoE has none
        out["bias"] = m + "gate.e_score_correction_bias"
    for e in range(config.n_experts):
        out[f"experts.{e}"] = tuple(f"{m}experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down"))
    if config.n_shared_experts:
        out["shared"] = tuple(f"{m}shared_experts.{w}_proj.weight" for w in ("gate", "up", "down"))
    return out


def moe_matrix_shapes(config: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of layer i's MoE block -> its shape (the expert matrices are [out, in])."""
    names, dim, ffn = moe_tensor_names(config, i), config.dim, config.moe_ffn_dim
    shapes = {names["router"]: (config.n_experts, dim)}
    for key in ("bias", "router_bias"):
        if key in names:
            shapes[names[key]] = (config.n_experts,)
    for key, triple in names.items():
        if key.startswith("expert_biases."):
            shapes |= dict(zip(triple, [(ffn,), (ffn,), (dim,)]))
        if key.startswith("experts.") or key == "shared":
            gate, up, down = triple
            width = ffn * (config.n_shared_experts if key == "shared" else 1)
            shapes |= {gate: (width, dim), up: (width, dim), down: (dim, width)}
    return shapes


# ---- routing ---------------------------------------------------------------------------------------
def route(h, moe: MoEWeights, cfg: ModelConfig):
    """Which k experts each token goes to, and with what weight.   h: [T, dim] -> ids [T, k], weights [T, k]"""
    xp = array_module(h)
    logits = h @ as_f32(moe.router).T                                      # [T, E]
    if moe.router_bias is not None:                                        # GPT-OSS
        logits += as_f32(moe.router_bias)
    k = cfg.n_experts_per_token
    if cfg.router == "softmax":                                            # Mixtral
        probs = xp.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)                         # [T, E]
        ids = top_k(probs, k)                                              # [T, k]
        weights = xp.take_along_axis(probs, ids, axis=-1)                  # [T, k]
        if cfg.norm_topk_prob:                                             # Mixtral always; Qwen3-MoE if its config says
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return ids, weights
    scores = 1.0 / (1.0 + xp.exp(-logits))                                 # [T, E] sigmoid, each expert on its own
    choice = scores if moe.bias is None else scores + as_f32(moe.bias)     # the bias steers the choice only
    if cfg.n_expert_groups > 1:
        choice = limit_to_groups(choice, cfg.n_expert_groups, cfg.n_groups_per_token)
    ids = top_k(choice, k)                                                 # [T, k]
    weights = xp.take_along_axis(scores, ids, axis=-1)                     # [T, k] weighed by s, not s + b
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


def top_k(scores, k: int):
    """Indices of the k largest entries of each row, in no particular order.   [T, E] -> [T, k]"""
    xp = array_module(scores)
    return xp.argpartition(-scores, k - 1, axis=-1)[:, :k]


def limit_to_groups(choice, n_groups: int, keep: int):
    """Group-limited routing: score each group of E / n_groups experts by the sum of its two best,
    keep the `keep` best groups, and make every other expert unchoosable (-inf).   [T, E] -> [T, E]"""
    xp = array_module(choice)
    T, E = choice.shape
    grouped = choice.reshape(T, n_groups, E // n_groups)                   # [T, G, E/G]
    top2 = -xp.partition(-grouped, 1, axis=-1)[..., :2]                    # [T, G, 2] the two largest
    best = top_k(top2.sum(axis=-1), keep)                                  # [T, keep] group ids
    allowed = (best[:, :, None] == xp.arange(n_groups)).any(axis=1)        # [T, G] the kept groups
    return xp.where(allowed[:, :, None], grouped, -xp.inf).reshape(T, E)   # [T, E]


# ---- the sparse block ------------------------------------------------------------------------------
def moe_block(h, moe: MoEWeights, cfg: ModelConfig):
    """The MoE MLP on normed hidden states: route, then each expert on its own tokens only.
    h: [T, dim] -> [T, dim]"""
    xp = array_module(h)
    ids, weights = route(h, moe, cfg)                                      # [T, k] each
    out = moe.shared(h) if moe.shared is not None else xp.zeros_like(h)    # [T, dim]
    k = ids.shape[1]
    order = xp.argsort(ids.ravel(), kind="stable")                         # [T*k] slots grouped by expert
    token_of = order // k                                                  # [T*k] the token of each sorted slot
    weight_of = weights.ravel()[order]                                     # [T*k]
    counts = xp.bincount(ids.ravel(), minlength=len(moe.experts))          # [E] tokens per expert
    start = 0
    for e, n in enumerate(counts.tolist()):                                # (a host list: CuPy syncs once)
        if n == 0:
            continue                                                       # an idle expert costs nothing
        rows = token_of[start:start + n]                                   # [n] distinct tokens (k distinct experts)
        y = moe.experts[e](h[rows])                                        # gather -> expert matmuls  [n, dim]
        out[rows] += y * weight_of[start:start + n, None]                  # scatter, weighted
        start += n
    return out


def expert_load(ids, n_experts: int) -> np.ndarray:
    """Fraction of the routed slots each expert received (1/E each when perfectly balanced).  -> [E]"""
    xp = array_module(ids)
    counts = xp.bincount(ids.ravel(), minlength=n_experts)
    return counts / max(int(ids.size), 1)
