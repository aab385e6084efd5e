"""`minillm info`: what a model is and what it costs in memory, before running it."""
from __future__ import annotations

from minillm.model.config import PRESETS, ModelConfig
from minillm.errors import WeightsNotFound


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def describe(model: str) -> str:
    """A short report: shape, parameters, weight bytes, KV-cache bytes per token."""
    from minillm.checkpoints import pull
    from minillm.checkpoints.reader import read_checkpoint

    preset = PRESETS.get(model)
    weights_bytes, where = None, "not pulled: run `minillm pull %s`" % model
    try:
        path = pull.resolve(model)
    except WeightsNotFound:
        if preset is None:
            raise
        config = preset.config
    else:
        config, tensors, _ = read_checkpoint(path)
        weights_bytes = sum(t.nbytes for t in tensors.values())
        where = str(path)
    return _report(model, config, weights_bytes, where)


def _report(name: str, c: ModelConfig, weights_bytes: int | None, where: str) -> str:
    heads = _attention_summary(c)
    rows = [
        ("model", name),
        ("weights", where),
        ("family", c.family + (f", sliding window {c.sliding_window}" if c.sliding_window else "")),
        ("layers", c.n_layers),
        ("dim / ffn", f"{c.dim} / {c.ffn_dim}"),
        ("attention", heads),
        ("vocab", f"{c.vocab_size}" + (" (tied embeddings)" if c.tie_embeddings else "")),
        ("context", c.max_seq_len),
        ("rope", f"theta {c.rope_theta:g}" + (f", scaling {c.rope_scaling.get('rope_type')}" if c.rope_scaling else "")),
        ("parameters", f"{c.n_params:,} ({c.n_params / 1e9:.3f} B)"),
        ("bytes fp32 / bf16", f"{_gb(4 * c.n_params)} / {_gb(2 * c.n_params)}"),
    ]
    if c.n_experts:   # memory holds every expert; a token reads its k (and the shared ones)
        rows[5:5] = [("experts", _moe_summary(c))]
        rows += [("active parameters", f"{c.n_active_params:,} ({c.n_active_params / 1e9:.3f} B) a token"),
                 ("bytes read / token", f"{_gb(2 * c.n_active_params)} bf16 at batch 1 (the active experts only)")]
    if c.quantization:
        q = c.quantization
        rows.append(("quantization", q["method"] + (f", groups of {q['group_size']}" if "group_size" in q else "")
                     + " (layer matrices; embedding and head as stored)"))
    if weights_bytes is not None:
        rows.append(("bytes as stored", _gb(weights_bytes)))
    rows += [
        ("KV cache per token", f"{c.kv_bytes_per_token(2):,} bytes fp16, {c.kv_bytes_per_token(4):,} bytes fp32"),
        ("KV cache full context", f"{_gb(c.kv_bytes_per_token(2) * c.max_seq_len)} fp16"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _moe_summary(c: ModelConfig) -> str:
    routing = ("softmax top-k" if c.router == "softmax" else
               f"sigmoid + correction bias, {c.n_groups_per_token} of {c.n_expert_groups} groups")
    shared = f", {c.n_shared_experts} shared" if c.n_shared_experts else ""
    dense = f"; layers 0-{c.first_dense_layers - 1} dense" if c.first_dense_layers else ""
    return (f"{c.n_experts} of width {c.moe_ffn_dim}, top-{c.n_experts_per_token}{shared} ({routing}){dense}")


def _attention_summary(c: ModelConfig) -> str:
    if c.attention == "mla":
        q = f"q_lora_rank {c.q_lora_rank}" if c.q_lora_rank else "full-rank queries"
        return (f"MLA: {c.n_heads} heads, latent kv_lora_rank {c.kv_lora_rank} + shared RoPE key "
                f"{c.qk_rope_head_dim}, {q}")
    kind = ("MHA" if c.n_kv_heads == c.n_heads else "MQA" if c.n_kv_heads == 1
            else f"GQA, groups of {c.n_heads // c.n_kv_heads}")
    return f"{c.n_heads} query heads, {c.n_kv_heads} KV heads, head_dim {c.head_dim} ({kind})"
