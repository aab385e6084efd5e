"""`minillm bench serve` at a tiny size: every server runs every workload and the numbers make sense."""
import csv

import pytest
from click.testing import CliRunner

from hf_models import llama_config, save_random_model
from minillm.cli import cli
from minillm.tools import serve_bench
from minillm.tools.serve_bench import MODES, agentic_workload, load_warning


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_random_model(llama_config(num_hidden_layers=2), path)
    return path


def test_bench_serve_writes_the_table_the_csv_and_the_png(model_dir, tmp_path):
    out_csv, out_png = tmp_path / "serve.csv", tmp_path / "serve.png"
    result = CliRunner().invoke(cli, ["bench", "serve", "--model", str(model_dir), "--requests", "6",
                                      "--concurrency", "3", "--prompt-len", "40", "--output-len", "4",
                                      "--rounds", "2", "--csv", str(out_csv), "--png", str(out_png)])
    assert result.exit_code == 0, result.output
    assert "random: 6 requests" in result.output and "agentic (75% shared)" in result.output
    assert "2 interleaved rounds" in result.output and "at the start" in result.output and "spread" in result.output
    rows = list(csv.DictReader(out_csv.open()))
    assert [(r["workload"].split()[0], r["mode"]) for r in rows] == \
        [(w, m) for w in ("random", "agentic") for m in MODES]
    for r in rows:
        assert int(r["requests"]) == 6 and float(r["output_tok_per_s"]) > 0 and float(r["peak_kv_bytes"]) > 0
        assert int(r["rounds"]) == 2 and float(r["tok_per_s_spread"]) >= 0
        assert float(r["ttft_p90_s"]) >= float(r["ttft_mean_s"]) * 0.5 > 0
    hits = {(r["workload"].split()[0], r["mode"]): int(r["prefix_hit_tokens"]) for r in rows}
    assert hits[("agentic", "+ prefix caching")] > 0 and hits[("agentic", "continuous batching")] == 0
    kv = {r["mode"]: int(r["peak_kv_bytes"]) for r in rows if r["workload"] == "random"}
    assert kv["+ int8 KV"] < kv["+ prefix caching"] / 2       # head_dim 8: (8 + 4 scale bytes) / 32 per vector
    pytest.importorskip("matplotlib")
    assert out_png.stat().st_size > 1000


def test_plain_bench_is_still_a_command_and_serve_errors_are_one_line(model_dir):
    assert CliRunner().invoke(cli, ["bench", "--help"]).exit_code == 0
    result = CliRunner().invoke(cli, ["bench", "serve", "--model", str(model_dir), "--prompt-len", "200"])
    assert result.exit_code == 1 and result.output.count("\n") == 1
    assert result.output.startswith("minillm: error:") and "context" in result.output


def test_agentic_prompts_share_their_system_prompt():
    w = agentic_workload(5, 1000, prompt_len=100, output_len=8, prefix_share=0.5)
    system = w.prompts[0][:50]
    assert all(p[:50] == system for p in w.prompts) and len({tuple(p[50:]) for p in w.prompts}) == 5


def test_modes_run_in_interleaved_rotating_rounds_and_each_row_is_the_median_round(model_dir, monkeypatch):
    """Each round runs every mode once, starting one mode later than the round before, so a burst of
    other work slows every mode alike; a row is the mode's median round (issue 16)."""
    from minillm import load
    calls, speeds = [], iter([1, 5, 3, 4] * 10)            # output tokens in 1 s: the round's tok/s

    def run_mode(llm, w, concurrency, mode):
        calls.append((mode, next(speeds)))
        return serve_bench.Result(w.name, mode, 1.0, calls[-1][1], [0.1], [0.01], 1)
    monkeypatch.setattr(serve_bench, "run_mode", run_mode)
    lines = []
    rows = serve_bench.run_cli(load(str(model_dir)), n_requests=2, concurrency=2, prompt_len=8, output_len=2,
                               workload="random", rounds=3, echo=lines.append)
    modes = list(MODES)
    assert [m for m, _ in calls] == modes + modes[1:] + modes[:1] + modes[2:] + modes[:2]
    assert [r.mode for r in rows] == modes and all(r.rounds == 3 for r in rows)
    medians = {m: sorted(n for mode, n in calls if mode == m)[1] for m in modes}
    assert {r.mode: r.output_tokens for r in rows} == medians
    assert "load average (1 min):" in lines[0] and any("at the start" in line for line in lines)


def test_median_round_and_spread():
    rs = [serve_bench.Result("w", "m", 1.0, n, [0.1], [0.01], 1) for n in (10, 30, 20)]
    chosen = serve_bench.median_round(rs)
    assert chosen.output_tokens == 20 and chosen.rounds == 3 and chosen.spread == pytest.approx(1.0)
    even = serve_bench.median_round(rs[:2])
    assert even.output_tokens == 10            # of two, the slower: a burst of other work never flatters


def test_a_moving_load_average_is_warned_about():
    assert load_warning(0.2, 0.4, cores=2) is None
    warning = load_warning(0.2, 1.9, cores=2)
    assert warning.startswith("warning: the load average moved from 0.20 to 1.90") and "--rounds" in warning
    assert load_warning(None, 3.0) is None


# ---- the mixed workload: a chat beside a long prompt (issue 40) ----------------------------------------

@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-long")
    save_random_model(llama_config(num_hidden_layers=2, max_position_embeddings=2048), path)
    return path


def test_mixed_workload_shows_the_chat_stalled_before_the_budget_and_flowing_after(long_context_dir, tmp_path):
    """A chat streams 8-token replies while a 1600-token prompt arrives two tokens before a reply ends. Before
    (512-token chunks in arrival order) the chat's next turn waits for a chunk that leaves room: fewer chat
    tokens than steps. After (the step budget) the chat gets a token in every step. Each round of each mode
    is a CSV row; the chat's longest gap lies within the long prompt's time to first token."""
    out_csv = tmp_path / "mixed.csv"
    result = CliRunner().invoke(cli, ["bench", "serve", "--model", str(long_context_dir), "--workload", "mixed",
                                      "--long-prompt-len", "1600", "--prompt-len", "8", "--output-len", "8",
                                      "--rounds", "2", "--csv", str(out_csv)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "a 1600-token prompt arrives; 2 interleaved rounds" in out and "threads: " in out
    assert "at the start" in out and "after / before (medians): chat max gap" in out
    rows = list(csv.DictReader(out_csv.open()))
    assert sorted((r["mode"].split()[0], r["round"]) for r in rows) == \
        [("after", "0"), ("after", "1"), ("before", "0"), ("before", "1")]
    for r in rows:
        assert 0 < float(r["chat_max_gap_s"]) <= float(r["long_ttft_s"])
        assert 0 < float(r["chat_max_itl_s"]) <= float(r["chat_max_gap_s"])   # a reply's gaps are some of them
        if r["mode"].startswith("before"):
            assert (int(r["steps"]), int(r["chat_tokens"])) == (4, 3)      # 512, 512, 512 (the stall), 64
        else:
            assert int(r["chat_tokens"]) == int(r["steps"]) >= 4         # chunks of at most 512


def test_mixed_workload_refuses_what_it_cannot_do_in_one_line(long_context_dir, model_dir):
    for args, words in [(["--model", str(model_dir)], "context"),
                        (["--model", str(long_context_dir), "--url", "http://127.0.0.1:9"], "--url")]:
        result = CliRunner().invoke(cli, ["bench", "serve", "--workload", "mixed", *args])
        assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
        assert result.output.startswith("minillm: error:") and words in result.output
