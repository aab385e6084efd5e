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
    weights_bytes, disk, where, loaded = None, None, "not pulled: run `minillm pull %s`" % model, None
    try:
        path = pull.resolve(model)
    except WeightsNotFound:
        if preset is None:
            raise
        config = preset.config
    else:
        config, tensors, _ = read_checkpoint(path)
        weights_bytes = sum(t.nbytes for t in tensors.values())
        where, disk = str(path), on_disk(path)
        if ".gguf" in disk:             # which way a GGUF's matrices load (gguf_quantized.load_gguf_for_cpu)
            from minillm.checkpoints.gguf_quantized import load_path
            loaded = load_path(tensors)
    return _report(model, config, weights_bytes, where, disk, loaded)


def on_disk(path) -> str:
    """What a checkpoint takes on disk, and in which form its weights are kept (issue 16: a pulled
    SmolLM2 is its 98 MB GGUF, dequantized at load, where a float32 copy took 538 MB more)."""
    from pathlib import Path

    from minillm.checkpoints.gguf_import import open_gguf
    from minillm.checkpoints.weights import GGUF_WEIGHTS, SAFETENSORS, SAFETENSORS_INDEX
    path = Path(path)
    files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    gguf = path if path.is_file() else path / GGUF_WEIGHTS
    converted = path.is_dir() and ((path / SAFETENSORS).is_file() or (path / SAFETENSORS_INDEX).is_file())
    if not gguf.is_file():
        return f"{_gb(total)} ({len(files)} files)"
    kinds: dict[str, int] = {}
    for t in open_gguf(gguf).tensors:
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    form = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
    if converted:       # pulled before issue 16: the GGUF and a float32 copy of it, which is what loads
        return (f"{_gb(total)}: safetensors (loaded) and {gguf.name} ({_gb(gguf.stat().st_size)}: {form} tensors, "
                f"which they were converted from); `minillm pull {path.name} --force` keeps only the GGUF")
    return (f"{_gb(total)}: {gguf.name} ({_gb(gguf.stat().st_size)}: {form} tensors, as they came)"
            + ("" if path.is_file() else ", config and tokenizer"))


def _report(name: str, c: ModelConfig, weights_bytes: int | None, where: str, disk: str | None = None,
            loaded: str | None = None) -> str:
    heads = _attention_summary(c)
    rows = [
        ("model", name),
        ("weights", where),
        ("family", c.family + (f", sliding window {c.sliding_window}" if c.sliding_window else "")
         + (f", windowed layers {sum(w is not None for w in c.layer_windows)} of {c.n_layers} "
            f"(window {next(w for w in c.layer_windows if w)})" if c.layer_windows else "")),
        ("layers", c.n_layers),
        ("dim / ffn", f"{c.dim} / {c.ffn_dim}"),
        ("attention", heads),
        ("vocab", f"{c.vocab_size}" + (" (tied embeddings)" if c.tie_embeddings else "")),
        ("context", c.max_seq_len),
        ("stop token ids", _stop_ids(c)),
        ("rope", f"theta {c.rope_theta:g}" + (f", scaling {c.rope_scaling.get('rope_type')}" if c.rope_scaling else "")
         + (f", windowed layers theta {c.rope_local_theta:g}" if c.rope_local_theta is not None else "")),
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
                     + (" (the experts as shipped; attention, router, embedding and head as stored)"
                        if q.get("experts_only") else " (layer matrices; embedding and head as stored)")))
    if disk is not None:
        rows.append(("on disk", disk))
    if loaded is not None:
        rows.append(("load path", loaded + " (on the CPU; --device cuda, --quant and --flashnorm dequantize)"))
    if weights_bytes is not None:
        rows.append(("bytes in memory", _gb(weights_bytes) + " (the weights as loaded, before --dtype/--quant)"))
    rows.append(("on --device cuda", _gpu_path(c)))
    rows += [
        ("KV cache per token", f"{c.kv_bytes_per_token(2):,} bytes fp16, {c.kv_bytes_per_token(4):,} bytes fp32"),
        ("KV cache full context", f"{_gb(c.kv_bytes_per_token(2) * c.max_seq_len)} fp16"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _gpu_path(c: ModelConfig) -> str:
    """Which GPU model would run it (llm.gpu_path's choice, from the config alone) and why."""
    from types import SimpleNamespace
    from minillm.cuda import gpu_mla, gpu_model
    other = "device_model (the engine's own Transformer on CuPy, every matrix in 16 bits): "
    if c.attention == "mla":
        try:
            gpu_mla.check_shape(c)
        except ValueError as e:
            return other + str(e)
        return "GPUMLATransformer (the MLA kernels, decode as one CUDA graph)"
    why = gpu_model.unsupported(SimpleNamespace(config=c))
    return "GPUTransformer (the kernels, decode as one CUDA graph)" if why is None else other + why


def _stop_ids(c: ModelConfig) -> str:
    """The ids generation stops on, as each file names them (the tokenizer's end-of-turn tokens stop too)."""
    eos = c.eos_token_id
    config_ids = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
    parts = [f"{' '.join(map(str, config_ids))} (config.json)"] if config_ids else []
    if c.generation_eos_token_ids:
        parts.append(f"{' '.join(map(str, c.generation_eos_token_ids))} (generation_config.json)")
    return "; ".join(parts + ["the tokenizer's end-of-turn tokens"])


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
