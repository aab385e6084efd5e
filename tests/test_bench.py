"""`minillm bench` on the CPU at a tiny size, so that it cannot rot: its table, the HF peer in its own
process at the same thread counts (generate-style last-row logits and the plain forward), the prefill
floor, and where prefill time goes. It is run, not timed: speed is measured by the command itself, never
asserted here."""
import os
import re
import time

import pytest
from click.testing import CliRunner
from hf_models import llama_config, save_random_model

import minillm
from minillm.cli import cli
from minillm.tools import bench
from minillm.tools.hf_peer import HFPeer, PeerError


def tiny_model():
    cfg = minillm.ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
    return bench.random_model(cfg)


def test_the_peer_is_another_process_on_the_threads_asked_and_decodes_minillms_greedy_tokens(tmp_path):
    """The HF peer (tools/hf_peer.py) runs in a process of its own, on exactly the torch threads each request
    asks for, and its numbers are its own: on the same weights its greedy tokens are minillm's."""
    save_random_model(llama_config(), tmp_path)
    model = minillm.load(str(tmp_path)).model
    prompt = [5, 17, 42, 99, 3, 250, 7, 64]
    ours = bench.bench_minillm(model, prompt, new_tokens=6, repeats=1)
    with HFPeer(tmp_path) as peer:
        replies = {n: peer.measure(prompt, 6, threads=n) for n in (1, 2)}
    assert peer.pid != os.getpid()
    for n, reply in replies.items():
        assert reply["pid"] == peer.pid and reply["threads"] == n
        assert reply["tokens"] == ours.tokens and len(reply["tokens"]) == 1 + 6
        assert reply["ttft_s"] > 0 and reply["decode_tok_s"] > 0


def test_a_peer_that_cannot_load_says_why_in_one_line(tmp_path):
    with pytest.raises(PeerError, match=r"the HF peer process stopped \(exit 1\): \S"):
        HFPeer(tmp_path / "no-such-folder")


def test_bench_headline_compares_both_sides_at_the_same_thread_count(tmp_path):
    """`minillm bench`: every count measured for both sides, the headline ratio at one count for both (as each
    side reports it), each side's own best count on a labelled line, the peer's pid, and its greedy tokens."""
    save_random_model(llama_config(), tmp_path)
    result = CliRunner().invoke(cli, ["bench", "-m", str(tmp_path), "--prompt-tokens", "24", "--new-tokens", "2",
                                      "--repeats", "1"])
    assert result.exit_code == 0, result.output
    out = result.output
    headline = re.search(r"minillm / HF on the same thread count \(minillm (\d+) threads?, HF (\d+) threads?\): "
                         r"decode [\d.]+×, prefill [\d.]+×", out)
    assert headline and headline[1] == headline[2], out
    assert re.search(r"minillm / HF, each on its own best count: decode [\d.]+× \(minillm \d+ threads?, "
                     r"HF \d+ threads?\), prefill", out)
    table = {name: [int(row[len(name):].split()[0]) for row in out.splitlines() if row.startswith(name)]
             for name in ("minillm (NumPy)", "HF transformers (eager)")}
    assert table["minillm (NumPy)"] == table["HF transformers (eager)"] == bench.thread_counts()
    assert int(headline[1]) == bench.thread_counts()[0]
    assert int(re.search(r"HF transformers in its own process \(pid (\d+)", out)[1]) != os.getpid()
    assert "minillm's and HF's first 3 of 3 agree" in out
    assert "HF's plain forward, logits for all 24 positions" in out and "floor: the weight matmuls alone take" in out


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


def test_the_gpu_summary_prints_the_current_figure_of_its_shape_and_format_beside_the_measured_one(capsys):
    """minillm bench --device cuda's summary (minillm/tools/gpu_bench.py, one for 16-bit and int8/int4 weights): each
    row with a figure gets the current one of the same shape and format (data/current_figures.json) with its
    machine and date, not another format's nor an older card's; a shape without one gets none; no verdict."""
    from minillm.resources import current_figures
    from minillm.tools.gpu_bench import summary
    figures = {f["key"]: f for f in current_figures()}
    rows = [("decode tok/s", "318.2", "decode"), ("GB/s", "2345", None), ("TTFT 512 tokens, ms", "23.0", "ttft512")]
    summary("mistral-7b", "int8", rows)
    lines = capsys.readouterr().out.splitlines()
    decode, ttft = figures["gpu.decode.mistral-7b.int8"], figures["gpu.ttft512.mistral-7b.int8"]
    row = next(line for line in lines if "decode tok/s" in line)
    assert "318.2" in row and row.endswith(f"reference: {decode['values']['minillm']:,} tok/s "
                                           f"({decode['machine']}, {decode['date']})")
    assert next(line for line in lines if "TTFT" in line).endswith(f"reference: {ttft['values']['minillm']:,} ms "
                                                                    f"({ttft['machine']}, {ttft['date']})")
    assert "reference" not in next(line for line in lines if "GB/s" in line)
    text = "\n".join(lines)
    for other in ("gpu.decode.mistral-7b.fp16", "h200.decode.mistral-7b.int8"):    # another format, an older card
        assert f"{figures[other]['values']['minillm']:,} tok/s" not in text
    assert not any(word in text for word in ("target", "met", "missed", "verdict"))
    summary("llama-3.2-1b", "int4", rows)                                          # no figure of that format
    assert "reference" not in capsys.readouterr().out
    from minillm.cuda.selfcheck import bench_config
    from minillm.model.config import PRESETS
    assert bench_config(False) == PRESETS["mistral-7b"].config     # the selfcheck times `-m mistral-7b`'s shape
