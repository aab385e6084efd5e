"""Mixtral GGUFs: a random HF Mixtral written as llama.cpp lays it out (architecture "llama" with
expert keys, Q/K rows permuted for adjacent-pair RoPE, the experts stacked [E, out, in] or one tensor
each) loads back with HF's logits. (HF's own GGUF loader has no Mixtral mapping to compare with.)"""
import numpy as np
import pytest
import torch

import minillm
from hf_models import hf_logits
from test_moe import _ids, mixtral_config, save_moe_model


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF's half-split Q/K rows -> llama.cpp's adjacent-pair order (the inverse of unpermute_rows)."""
    out_dim, in_dim = w.shape
    return w.reshape(n_heads, 2, out_dim // n_heads // 2, in_dim).swapaxes(1, 2).reshape(out_dim, in_dim)


def write_mixtral_gguf(hf, path, stacked: bool):
    from gguf import GGUFWriter
    c = hf.config
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_vocab_size(c.vocab_size)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(b + "attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(b + "attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        w.add_tensor(b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(b + "ffn_gate_inp.weight", sd[p + "mlp.gate.weight"])                  # [E, dim]
        gate_up = sd[p + "mlp.experts.gate_up_proj"]                                         # [E, 2 ffn, dim]
        parts = {"gate": gate_up[:, :c.intermediate_size], "up": gate_up[:, c.intermediate_size:],
                 "down": sd[p + "mlp.experts.down_proj"]}                                    # [E, dim, ffn]
        for name, stack in parts.items():
            if stacked:
                w.add_tensor(b + f"ffn_{name}_exps.weight", np.ascontiguousarray(stack))
            else:
                for e in range(len(stack)):
                    w.add_tensor(b + f"ffn_{name}.{e}.weight", np.ascontiguousarray(stack[e]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def hf_mixtral(tmp_path_factory):
    return save_moe_model(mixtral_config(), tmp_path_factory.mktemp("mixtral-src"))


@pytest.mark.parametrize("stacked", [True, False], ids=["ffn_exps", "per-expert"])
def test_mixtral_gguf_matches_hf_logits(hf_mixtral, tmp_path, stacked):
    path = tmp_path / "mixtral.gguf"
    write_mixtral_gguf(hf_mixtral, path, stacked)
    llm = minillm.load(str(path))
    assert llm.config.family == "mixtral" and llm.config.n_experts == 4 and llm.config.n_experts_per_token == 2
    ids = _ids(16)
    np.testing.assert_allclose(llm.logits(ids), hf_logits(hf_mixtral, ids), atol=1e-4, rtol=0)
