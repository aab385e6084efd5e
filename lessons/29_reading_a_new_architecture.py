"""Lesson 29 — reading a new architecture: what Qwen3, Qwen3-MoE and Gemma 3 change against Llama.

A new model family is rarely a new model. Qwen3 is a Llama with two more norms; Qwen3-MoE is that
Qwen3 with Mixtral's router; Gemma 3 changes more, but each change is a line or two of arithmetic. The
way to read one is the way minillm took them in: diff its config.json against a Llama's, give every new
key a ModelConfig field (or refuse it in one line), and write the few lines of model/ each field
switches on. Four steps, each measured here:

1. The config diff: each family's config.json against the Llama config.json of the same shape, and the
   ModelConfig fields minillm reads the new keys into. # NEW
2. The lines of model/ those fields switch on, printed from minillm's own source (so the count is true
   of the code you are reading).
3. Each family on a random config against HF transformers: max |minillm - HF| over every position, then
   with each new piece switched off in turn: how far the logits move without it (none is decoration).
4. What Gemma 3's 5:1 windowed/global layers buy: the KV cache of gemma-3-1b at 32k tokens, every
   layer global vs the windowed layers holding 512 positions.

Exercise 29 is QK-norm (step 2's first two lines), graded against the engine's.

Run: python lessons/29_reading_a_new_architecture.py    (MINILLM_LESSON_QUICK=1: smoke run)
Step 3 needs HF transformers and torch (`pip install -e ".[test]"`); without them it says so and skips.
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 01 (a forward pass by hand: the Llama block)",
        "lesson 05 (GQA) and lesson 07 (the sliding window)",
        "lesson 22 (mixture of experts: the router)",
    ],
    "objectives": [
        "read a config.json against a Llama's and name what each new key changes in the forward pass",
        "find the lines of model/ that implement QK-norm, sandwich norms, (1 + w) gains and interleaved windows",
        "check an implementation against HF transformers on random weights, and show each piece matters",
    ],
    "study_time": "40 min, plus 20 min for exercise 29 (QK-norm)",
    "check_questions": [
        "Qwen3's head_dim is 128 with hidden_size 1024 and 16 heads: why can q_proj not be square?",
        "Gemma stores a norm's gain as w: what goes wrong if a Llama loader multiplies by w?",
        "Why does QK-norm normalize each head on its own rather than the whole query row?",
    ],
    "try_this": [
        "minillm presets, then minillm pull qwen3-0.6b and ask it something: its reasoning prints apart",
        "switch off norm_plus_one in step 3 and read how far Gemma's logits move",
    ],
}
import os
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # stable timings on a shared machine (lesson 08)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import ast
import inspect
import re
import tempfile
import textwrap

import numpy as np

from minillm.course import print_table, quick
from minillm.model import layers, moe, transformer
from minillm.model.config import PRESETS, ModelConfig

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3, max_position_embeddings=256)

# The config.json keys each family adds to a Llama's, and the ModelConfig fields they become.
FAMILIES = {
    "Qwen3": dict(hf="Qwen3Config", keys=dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32),
                  fields=["qk_norm", "head_dim"]),
    "Qwen3-MoE": dict(hf="Qwen3MoeConfig", keys=dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                     num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                     norm_topk_prob=True, initializer_range=0.1),
                      fields=["qk_norm", "head_dim", "n_experts", "n_experts_per_token", "moe_ffn_dim",
                              "norm_topk_prob"]),
    "Gemma 3": dict(hf="Gemma3TextConfig",
                    keys=dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=5,
                              query_pre_attn_scalar=24, final_logit_softcapping=3.0,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
                    fields=["qk_norm", "head_dim", "norm_plus_one", "sandwich_norms", "activation", "embed_scale",
                            "layer_windows", "rope_local_theta", "attn_scalar", "final_softcap", "tie_embeddings"]),
}
# Keys that do not change the forward pass (token ids, training settings, HF's own bookkeeping).
BOOKKEEPING = {"architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
               "output_router_logits", "router_aux_loss_coef", "use_cache", "transformers_version", "dtype"}
# Where each field acts: (function, the pattern of its lines). Printed from the source in step 2.
CODE = {
    "qk_norm": (transformer.Transformer.qkv, r"q_norm"),
    "norm_plus_one": (transformer.norm_gain, r"norm_plus_one|\+ np.float32\(1"),
    "sandwich_norms": (transformer.Transformer.add_residual, r"out_norm"),
    "activation": (layers.gelu_tanh, r"inner|tanh"),
    "embed_scale": (transformer.Transformer.scale_embedding, r"factor|embed_scale"),
    "layer_windows": (ModelConfig.window, r"layer_windows"),
    "rope_local_theta": (transformer.Transformer.rope, r"local"),
    "attn_scalar": (transformer.Transformer.qkv, r"attn_scalar"),
    "final_softcap": (transformer.Transformer.head, r"softcap|tanh"),
    "norm_topk_prob": (moe.route, r"norm_topk_prob|weights / weights"),
}
# Switching a piece off: the ModelConfig change that makes minillm run the model as if it lacked it.
OFF = {"qk_norm": dict(qk_norm=False), "norm_plus_one": dict(norm_plus_one=False),
       "sandwich_norms": dict(sandwich_norms=False), "activation": dict(activation="silu"),
       "embed_scale": dict(embed_scale=False), "layer_windows": dict(layer_windows=None),
       "rope_local_theta": dict(rope_local_theta=None), "attn_scalar": dict(attn_scalar=None),
       "final_softcap": dict(final_softcap=None), "norm_topk_prob": dict(norm_topk_prob=False)}


def main() -> None:
    hf = _transformers()

    # ---- 1. the config diff ------------------------------------------------------------------------------
    print("\nLesson 29 — 1. config.json against a Llama's of the same shape: what each family adds or changes  # NEW")
    for family, spec in FAMILIES.items():
        d, llama = _family_config_json(family, spec, hf), _llama_config_json(spec, hf)
        added = sorted(k for k in d if k not in llama and not k.startswith("_") and k not in BOOKKEEPING)
        changed = sorted(k for k in d if k in llama and d[k] != llama[k] and k not in BOOKKEEPING)
        config = ModelConfig.from_hf(d)
        print(f"   {family}\n      keys added    {', '.join(added) or '-'}\n      keys changed  {', '.join(changed) or '-'}")
        print(f"      minillm reads {', '.join(f'{f}={_short(getattr(config, f))}' for f in spec['fields'])}")

    # ---- 2. the lines of model/ each field switches on ---------------------------------------------------
    print("\n2. the lines of model/ each new field switches on (from minillm's source)")
    total = 0
    for field, (fn, pattern) in CODE.items():
        lines, first = inspect.getsourcelines(fn)
        hits = [(first + i, line.rstrip()) for i, line in enumerate(lines)
                if re.search(pattern, line) and i >= _body_start(lines)]
        where = f"{Path(inspect.getsourcefile(fn)).name}:{fn.__qualname__}"
        print(f"   {field}  ({where}, {len(hits)} lines)")
        for number, line in hits:
            print(f"      {number:4d}  {line.strip()}")
        total += len(hits)
    print(f"   {total} lines of arithmetic for three families; everything else is the Llama forward pass")

    # ---- 3. against HF transformers, and each piece switched off -----------------------------------------
    if hf is None:
        print("\n3. skipped: HF transformers and torch are not installed (pip install -e \".[test]\")")
    else:
        rows = []
        for family, spec in FAMILIES.items():
            rows += _parity_rows(family, spec, hf)
        print_table("3. minillm vs HF transformers on random weights (fp32, 16 tokens): the model, then each "
                    "piece switched off", ("family", "run", "max |minillm - HF|", "same argmax"), rows)

    # ---- 4. what Gemma 3's interleaved layers buy -------------------------------------------------------
    c = PRESETS["gemma-3-1b"].config
    context, per_layer = 32768, 2 * c.n_kv_heads * c.head_dim * 2                      # K and V, bf16: bytes/token
    windowed = [c.window(i) for i in range(c.n_layers) if c.window(i) is not None]
    every_global = c.n_layers * context * per_layer
    interleaved = (c.n_layers - len(windowed)) * context * per_layer + sum(windowed) * per_layer
    print_table(f"4. gemma-3-1b's KV cache at {context:,} tokens ({c.n_layers} layers, {len(windowed)} windowed "
                f"to {windowed[0]} positions, bf16)",
                ("layers", "KV cache", "vs every layer global"),
                [("every layer global", f"{every_global / 2**20:,.0f} MiB", "1.00"),
                 ("5 windowed : 1 global", f"{interleaved / 2**20:,.0f} MiB", f"{interleaved / every_global:.2f}")])
    print("   minillm runs the windows as masks over a full cache on every layer for now (new_cache): a rolling"
          "\n   buffer per windowed layer, as lesson 07 builds for Mistral, is what would bank this saving.")


def _transformers():
    """HF transformers and torch, or None when they are not installed (step 3 needs them)."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    return transformers, torch


def _family_config_json(family: str, spec: dict, hf) -> dict:
    """The config.json HF writes for this family at the lesson's small shape (or minillm's own, without HF)."""
    if hf is None:
        return _to_hf_without_transformers(family, spec)
    return getattr(hf[0], spec["hf"])(**(SMALL | spec["keys"])).to_dict()


def _llama_config_json(spec: dict, hf) -> dict:
    keys = {k: v for k, v in spec["keys"].items() if k in ("num_attention_heads", "num_key_value_heads")}
    if hf is None:
        return ModelConfig(vocab_size=320, dim=64, n_layers=3, n_heads=keys["num_attention_heads"],
                           n_kv_heads=keys["num_key_value_heads"], ffn_dim=128).to_hf()
    return hf[0].LlamaConfig(**(SMALL | keys)).to_dict()


def _to_hf_without_transformers(family: str, spec: dict) -> dict:
    """Without transformers: minillm's own to_hf() of the same shape stands in for HF's config.json."""
    heads, kv, hd = (spec["keys"][k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    base = dict(vocab_size=320, dim=64, n_layers=3, n_heads=heads, n_kv_heads=kv, ffn_dim=128, head_dim=hd, qk_norm=True)
    if family == "Qwen3":
        return ModelConfig(family="qwen3", **base).to_hf()
    if family == "Qwen3-MoE":
        return ModelConfig(family="qwen3_moe", n_experts=4, n_experts_per_token=2, moe_ffn_dim=32, **base).to_hf()
    return PRESETS["gemma-3-1b"].config.replace(**base, layer_windows=(5, None, 5), attn_scalar=24.0).to_hf()


def _parity_rows(family: str, spec: dict, hf) -> list[tuple]:
    """minillm against HF on one random model of the family, whole and with each piece switched off."""
    import minillm
    from minillm.checkpoints.weights import load_hf_dir
    from minillm.model.transformer import Transformer
    transformers, torch = hf
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, spec["hf"])(**(SMALL | spec["keys"])),
                                                          dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):               # HF starts gains at 1 (Gemma's w at 0): make them matter
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    ids = np.random.default_rng(1).integers(0, SMALL["vocab_size"], 8 if quick() else 16).tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()                       # [T, vocab]
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        ours = minillm.load(folder, threads=1).logits(ids)
        config, tensors = load_hf_dir(folder)
        rows = [(family, "minillm", f"{np.abs(ours - want).max():.1e}", _same_argmax(ours, want))]
        for field in spec["fields"]:
            if field not in OFF or not getattr(config, field) or (field == "rope_local_theta" and config.layer_windows is None):
                continue
            off = Transformer(config.replace(**OFF[field]), tensors)
            logits = off.prefill(ids, off.new_cache(len(ids)), all_logits=True)
            rows.append((family, f"without {field}", f"{np.abs(logits - want).max():.1e}", _same_argmax(logits, want)))
    return rows


def _body_start(lines: list[str]) -> int:
    """The index of a function's first line of code: after its signature and its docstring."""
    function = ast.parse(textwrap.dedent("".join(lines))).body[0]
    body = function.body[1:] if ast.get_docstring(function) is not None else function.body
    return body[0].lineno - 1


def _same_argmax(a: np.ndarray, b: np.ndarray) -> str:
    return f"{(a.argmax(-1) == b.argmax(-1)).mean():.0%}"


def _short(value) -> str:
    if isinstance(value, tuple):                       # layer_windows: (5, None, 5)
        return "(" + ",".join("-" if v is None else str(v) for v in value) + ")"
    return str(value)


if __name__ == "__main__":
    main()
