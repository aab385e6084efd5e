"""The HF peer's second way of starting (tools/hf_peer.py): random weights of an HF config dict, on a device and
dtype, in a process of its own; what `minillm bench --device cuda` compares minillm against (cuda, fp16).
Here on the CPU, at a tiny size."""
from minillm.model.config import ModelConfig
from minillm.tools.hf_peer import HFPeer


def test_the_peer_builds_a_random_model_of_an_hf_config_and_answers_the_same_requests():
    cfg = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=128,
                      family="mistral", sliding_window=64)
    with HFPeer(config=cfg.to_hf(), device="cpu", dtype="float32", seed=3) as peer:
        first = peer.measure([5, 17, 42, 99, 3], new_tokens=6)
        again = peer.measure([5, 17, 42, 99, 3], new_tokens=6)
    assert "torch" in peer.versions and "transformers" in peer.versions
    assert len(first["tokens"]) == 6 + 1                       # the prefill's token, then one per decode step
    assert all(0 <= t < cfg.vocab_size for t in first["tokens"])
    assert first["ttft_s"] > 0 and first["decode_tok_s"] > 0
    assert again["tokens"] == first["tokens"]                  # greedy on fixed weights: the same tokens
