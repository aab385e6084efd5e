"""FlashNorm (Graef et al., arXiv 2407.09577): RMSNorm gains folded away, the normalization deferred.

A Llama block normalizes before every projection:  y = RMSNorm(x) · W = (x · 1/RMS(x) ⊙ g) · W, with
1/RMS(x) = rsqrt(mean(x²) + eps) one number per token (row) and g a learned gain per channel.

Prop. 1, weightless normalization. (x ⊙ g) · W = x · (diag(g) · W): the gain can live in the weights.
In HF's [out, in] layout that scales input column j of W by g[j]. Done once to the checkpoint
(`fold_checkpoint`), the norms become all-ones, so HF transformers still loads the result and gives the
same logits, and the engine never multiplies by g again:
    input_layernorm          -> q_proj, k_proj, v_proj
    post_attention_layernorm -> gate_proj, up_proj
    model.norm (final)       -> lm_head, only when it is untied: a tied head IS the embedding, and
                                scaling it would also scale every token's input vector. `untie=True`
                                copies the embedding into a separate head first (vocab × dim more bytes).
MLA (DeepSeek) models fold the same way, and their two inner latent norms fold too, each into the
only projection that reads it: q_a_layernorm -> q_b_proj, kv_a_layernorm -> kv_b_proj (every head's
W_UK and W_UV read the latent through it). All of these are exact: eps stays inside the root.

Prop. 2, deferred normalization. 1/RMS(x) is one number per row, so (x · W*) · 1/RMS(x) equals
(x · 1/RMS(x)) · W*: the projection no longer waits for the reduction, both can run at once, and one
per-row scale comes at the end (`deferred_linear`). The scale is applied in fp32: x · W* is not
normalized and can leave fp16's range. SwiGLU needs care: SiLU is not linear, so the gate gets its
scale before SiLU; the up path's scale can move past the product silu(g)·u and through the down
projection (linear, no bias): s·(silu(g)·u)·W_down = s·((silu(g)·u)·W_down) (`deferred_swiglu`).

Prop. 3 (lesson 15 only): a norm right after a normalized projection makes the inner 1/RMS cancel,
RMSNorm(RMSNorm(x) · W) = RMSNorm(x · W) up to eps, since RMS(c·a) = c·RMS(a). Llama has no such
double norm, so the engine does not use it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minillm.backend import STORAGE_DTYPES, as_f32, to_dtype
from minillm.model.config import ModelConfig
from minillm.model.layers import linear, silu

# Each norm (a suffix of "model.layers.{i}.") and the projections that read its output.
LAYER_FOLDS = {
    "input_layernorm": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",      # GQA
                        "self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"],           # MLA
    "self_attn.q_a_layernorm": ["self_attn.q_b_proj"],                                   # MLA query latent
    "self_attn.kv_a_layernorm": ["self_attn.kv_b_proj"],                                 # MLA KV latent
    "post_attention_layernorm": ["mlp.gate_proj", "mlp.up_proj"],
}
# An MLA model without a query latent has q_proj instead of q_a_proj: the input norm feeds either.


# ---- Prop. 1: folding ---------------------------------------------------------------------------------

def fold_rmsnorm_into_linear(gain: np.ndarray, w: np.ndarray) -> np.ndarray:
    """W* = W · diag(g): scale input column j of W [out, in] by gain[j]; same dtype as w, w untouched.

    Then rmsnorm(x, gain) @ W.T == rmsnorm(x, ones) @ W*.T for every x.
    """
    folded = as_f32(w) * as_f32(gain)[None, :]                             # [out, in]
    return to_dtype(folded.astype(np.float32), _stored(w))


def is_weightless(gain: np.ndarray) -> bool:
    """True when a norm's gain is all ones (folded already, or never trained)."""
    return bool(np.all(as_f32(gain) == 1.0))


@dataclass
class FoldReport:
    """What `fold_checkpoint` did: which norms it folded, which it left, and the bytes it added."""
    folded: list[str] = field(default_factory=list)        # norm tensor names now all-ones
    kept: dict[str, str] = field(default_factory=dict)     # norm tensor name -> why it keeps its gain
    extra_bytes: int = 0                                   # the untied LM head, if one was made

    def __str__(self) -> str:
        lines = [f"FlashNorm: folded {len(self.folded)} norm gain(s) into the projections after them"]
        lines += [f"  kept {name}: {why}" for name, why in self.kept.items()]
        if self.extra_bytes:
            lines.append(f"  untied the LM head: +{self.extra_bytes / 1e6:.1f} MB")
        return "\n".join(lines)


def fold_checkpoint(config: ModelConfig, tensors: dict[str, np.ndarray], untie: bool = False
                    ) -> tuple[ModelConfig, dict[str, np.ndarray], FoldReport]:
    """(config, HF-named tensors, report) with every foldable RMSNorm gain folded and set to ones.

    Norms already all-ones are left as they are (folding twice changes nothing). Raises ValueError for
    quantized weights that still have gains: fold the float checkpoint first, then quantize (an int8
    or int4 scale belongs to a row or a group of a row; a gain scales a column).
    """
    out, report = dict(tensors), FoldReport()
    for i in range(config.n_layers):
        for norm, projections in LAYER_FOLDS.items():
            name = f"model.layers.{i}.{norm}.weight"
            if name not in out:
                continue                                                  # e.g. no q_a_layernorm
            targets = [f"model.layers.{i}.{p}.weight" for p in projections]
            _fold(out, name, [t for t in targets if t in out or t.replace(".weight", ".qweight") in out],
                  report, config)
    _fold_final_norm(config, out, report, untie)
    if report.extra_bytes:
        config = config.replace(tie_embeddings=False)
    return config, out, report


def _fold(out: dict, norm: str, targets: list[str], report: FoldReport, config: ModelConfig) -> None:
    gain = out[norm]
    if is_weightless(gain):
        report.folded.append(norm)
        return
    if not targets:
        raise ValueError(f"{norm}: no projection after it to fold its gain into")
    if config.quantization or any(t not in out for t in targets):
        raise ValueError("these weights are stored quantized: fold the norms of the float checkpoint "
                         "(convert --flashnorm), then quantize the result")
    for t in targets:
        out[t] = fold_rmsnorm_into_linear(gain, out[t])
    out[norm] = to_dtype(np.ones(gain.shape, np.float32), _stored(gain))   # weightless (bf16 1.0 is 0x3F80)
    report.folded.append(norm)


def _stored(a: np.ndarray) -> str:
    """The storage dtype name of a tensor (uint16 holds bf16), so a rewritten tensor keeps it."""
    return {np.dtype(v): k for k, v in STORAGE_DTYPES.items()}.get(np.dtype(a.dtype), "float32")


def _fold_final_norm(config: ModelConfig, out: dict, report: FoldReport, untie: bool) -> None:
    """The final norm folds into the LM head, which for a tied model must first become its own copy."""
    norm, embed = "model.norm.weight", out["model.embed_tokens.weight"]
    if config.tie_embeddings or "lm_head.weight" not in out:
        if is_weightless(out[norm]):
            report.folded.append(norm)
            return
        if not untie:
            report.kept[norm] = (f"the LM head is tied to the embedding; untie it to fold this one too "
                                 f"(+{embed.nbytes / 1e6:.1f} MB)")
            return
        out["lm_head.weight"] = embed          # _fold stores a new, folded array under this name: the copy
        report.extra_bytes = embed.nbytes
    _fold(out, norm, ["lm_head.weight"], report, config)


# ---- Prop. 2: deferred normalization (Transformer(flashnorm=True) calls these) ------------------------

def inv_rms(x: np.ndarray, eps: float) -> np.ndarray:
    """1 / sqrt(mean(x²) + eps) of each row, in fp32 (layers.rmsnorm's arithmetic).   x: [T, dim] -> [T, 1]"""
    mean_square = np.square(x).sum(axis=-1, keepdims=True) * (1.0 / x.shape[-1])    # [T, 1]
    return 1.0 / np.sqrt(mean_square + eps)


def deferred_linear(x: np.ndarray, w, eps: float) -> np.ndarray:
    """rmsnorm(x, ones) @ W*ᵀ computed as (x @ W*ᵀ) · 1/RMS(x): two independent steps, one row scale.

    x: [T, in] -> [T, out]
    """
    return linear(x, w) * inv_rms(x, eps)


def deferred_swiglu(x: np.ndarray, layer, ffn_dim: int, eps: float) -> np.ndarray:
    """The Llama MLP on the un-normalized residual x, with folded gate/up weights.   x: [T, dim] -> [T, dim]

    The gate needs its 1/RMS before SiLU (not linear); the up path's goes after the down projection.
    """
    s = inv_rms(x, eps)                                                    # [T, 1]   independent of the matmul
    if layer.w_gate_up is not None:
        gate_up = linear(x, layer.w_gate_up)                               # [T, 2 * ffn_dim]  x · W*, unscaled
        gate, up = gate_up[:, :ffn_dim], gate_up[:, ffn_dim:]
    else:
        gate, up = linear(x, layer.w_gate), linear(x, layer.w_up)          # [T, ffn_dim] each
    return linear(silu(gate * s) * up, layer.w_down) * s                   # [T, dim]


def require_weightless(layers) -> bool:
    """True, or ValueError if a layer's input or post-attention norm still has a gain (not folded)."""
    for i, layer in enumerate(layers):
        for name, gain in (("input_layernorm", layer.attn_norm), ("post_attention_layernorm", layer.mlp_norm)):
            if not is_weightless(gain):
                raise ValueError(f"flashnorm needs folded weights, but layer {i}'s {name} has a gain: "
                                 f"fold them first (minillm.model.flashnorm.fold_checkpoint, or load(..., flashnorm=True))")
    return True
