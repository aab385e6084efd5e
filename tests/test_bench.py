"""`minillm bench` on the CPU at a tiny size, so that it cannot rot: its table, the HF peer in both forms
(generate-style last-row logits and the plain forward), the prefill floor, and where prefill time goes.
It is run, not timed: speed is measured by the command itself, never asserted here."""
import time

import minillm
from minillm.tools import bench


def tiny_model():
    cfg = minillm.ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
    return bench.random_model(cfg)


def test_bench_prints_both_peers_the_ratios_and_the_floor():
    lines = []
    numbers = bench.run(tiny_model(), prompt_tokens=24, new_tokens=2, repeats=1, echo=lines.append)
    text = "\n".join(lines)
    assert "minillm / HF: decode" in text and "HF's plain forward, logits for all 24 positions" in text
    assert "floor: the weight matmuls alone take" in text
    assert numbers["minillm"].ttft_s > 0 and numbers["hf"].decode_tok_s > 0 and numbers["hf_all_logits_ttft_s"] > 0


def test_bench_prefill_breakdown_accounts_for_the_whole_prefill():
    """`minillm bench` says where prefill time goes: the parts are all there and add up to the total."""
    model = tiny_model()
    prompt = [i % 128 for i in range(200)]
    start = time.perf_counter()
    parts = bench.prefill_breakdown(model, prompt)
    wall = time.perf_counter() - start
    assert set(parts) == set(bench.PREFILL_PARTS) | {"other"}
    assert all(t > 0 for label, t in parts.items() if label != "other") and parts["other"] > -1e-3
    assert sum(parts.values()) <= wall


def test_bench_with_the_int8_kv_cache_counts_its_bytes_and_says_so():
    model = tiny_model()
    cfg = model.config
    fp32 = bench.decode_bytes_per_token(model, 100)
    model = model.with_options(kv_cache="int8")
    int8 = bench.decode_bytes_per_token(model, 100)
    vectors = 2 * cfg.n_layers * cfg.n_kv_heads * 100                  # K and V, every layer and KV head
    assert fp32 - int8 == vectors * (4 * cfg.head_dim - (cfg.head_dim + 4))
    lines = []
    numbers = bench.run(model, prompt_tokens=24, new_tokens=2, repeats=1, peer=False, echo=lines.append)
    text = "\n".join(lines)
    assert "minillm (NumPy, int8 KV)" in text and "(int8 KV cache)" in text
    assert numbers["bytes_per_token"] == bench.decode_bytes_per_token(model, 24 + 2 // 2)


def test_the_gpu_summary_says_how_far_decode_is_from_its_target(capsys):
    """minillm bench --device cuda's summary (dev/bench.py, shared by the 16-bit and the int8/int4 runs): the rows,
    then met/missed against the target; no verdict for a shape the targets are not for, nor on another card
    than the H200 the targets are for."""
    from minillm.cuda.dev.bench import TARGETS, _summary, bench_config
    from minillm.model.config import PRESETS
    rows = [("decode tok/s", "247.3", "≥ 270"), ("TTFT 512 tokens, ms", "14.2", "≤ 15")]
    _summary(rows, 247.3, TARGETS["float16"], "NVIDIA H200")
    out = capsys.readouterr().out
    assert "247.3" in out and "≥ 270" in out and "target (H200)" in out
    assert "missed: -8% against 270 tok/s" in out
    _summary(rows, 702.0, TARGETS["int4"], "NVIDIA H200")
    assert "met: +8% against 650 tok/s" in capsys.readouterr().out
    _summary([("decode tok/s", "99.0", "")], None, TARGETS["int8"], "NVIDIA H200")
    assert "against" not in capsys.readouterr().out
    _summary(rows, 191.1, TARGETS["float16"], "NVIDIA H100 80GB HBM3")
    out = capsys.readouterr().out
    assert "against" not in out and "missed" not in out
    assert "no verdict: the targets are for an H200, this is an NVIDIA H100 80GB HBM3" in out
    from minillm.cuda.dev.bench import against_target                  # the line dev/qbench prints too
    assert against_target(393.6, TARGETS["int8"], "NVIDIA H200") == "missed: -8% against 430 tok/s"
    assert against_target(322.4, TARGETS["int8"], "NVIDIA H100 80GB HBM3").startswith("no verdict")
    assert bench_config(False) == PRESETS["mistral-7b"].config     # what `minillm bench -m mistral-7b` passes in
