"""`minillm bench serve` at a tiny size: every server runs every workload and the numbers make sense."""
import csv

import pytest
from click.testing import CliRunner

from hf_models import llama_config, save_random_model
from minillm.cli import cli
from minillm.tools.serve_bench import MODES, agentic_workload


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_random_model(llama_config(num_hidden_layers=2), path)
    return path


def test_bench_serve_writes_the_table_the_csv_and_the_png(model_dir, tmp_path):
    out_csv, out_png = tmp_path / "serve.csv", tmp_path / "serve.png"
    result = CliRunner().invoke(cli, ["bench", "serve", "--model", str(model_dir), "--requests", "6",
                                      "--concurrency", "3", "--prompt-len", "40", "--output-len", "4",
                                      "--csv", str(out_csv), "--png", str(out_png)])
    assert result.exit_code == 0, result.output
    assert "random: 6 requests" in result.output and "agentic (75% shared)" in result.output
    rows = list(csv.DictReader(out_csv.open()))
    assert [(r["workload"].split()[0], r["mode"]) for r in rows] == \
        [(w, m) for w in ("random", "agentic") for m in MODES]
    for r in rows:
        assert int(r["requests"]) == 6 and float(r["output_tok_per_s"]) > 0 and float(r["peak_kv_bytes"]) > 0
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
