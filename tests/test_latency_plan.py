"""`minillm plan --latency-ms T --ttft-ms F` (minillm/tools/latency_plan.py): on one GPU, each precision's largest
batch meeting a per-token and a first-token target, colocated and with prefill and decode disaggregated."""
import pytest
from click.testing import CliRunner

from minillm.cli import cli
from minillm.model.config import PRESETS
from minillm.tools.latency_plan import (DTYPES, colocated, disaggregated, meet_targets, prefill_time_s,
                                        targets_cli)
from minillm.tools.planner import PlanError, find_gpu, plan, weight_bytes


def test_prefill_is_the_weights_read_for_one_token_and_flops_for_a_long_prompt():
    c, h100 = PRESETS["llama-3-8b"].config, find_gpu("h100")
    assert prefill_time_s(c, h100, "bf16", 1) == pytest.approx(weight_bytes(c, "bf16") / h100.bandwidth)
    attention = 2 * 2 * c.n_layers * c.n_heads * c.head_dim * 4096 * 4097 / 2
    assert prefill_time_s(c, h100, "bf16", 4096) == pytest.approx((2 * c.n_params * 4096 + attention) / h100.bf16_flops)


def test_colocated_prefills_stall_the_batch_and_disaggregated_ones_cross_the_link():
    p = plan("llama-3-8b", "h100", "bf16", None, 2304, 64)
    co, dis = colocated(p, 0.05, 256), disaggregated(p, 0.05, 256, 2048, link=50e9)
    assert co.itl_s == pytest.approx(p.step_time_s + 64 / 256 * 0.05) and co.gpus == 1
    assert dis.itl_s == p.step_time_s
    assert dis.ttft_s == pytest.approx(0.05 + 2048 * p.kv_bytes_per_token / 50e9 + p.step_time_s)
    assert dis.gpus == pytest.approx(1 + 64 / 256 * 0.05 / p.step_time_s)
    assert co.tok_s_per_gpu == pytest.approx(64 / co.itl_s)


def test_each_precision_gets_the_largest_batch_that_meets_both_targets():
    rows = meet_targets("llama-3-8b", "h100", latency_ms=30, ttft_ms=60, prompt_tokens=2048, output_tokens=256)
    assert [r.weight_dtype for r in rows] == list(DTYPES)
    for r in rows:
        for s in (r.colocated, r.disaggregated):
            assert s.itl_s * 1e3 <= 30 and s.ttft_s * 1e3 <= 60 and s.batch <= r.max_users
        # one user more breaks a target, or memory
        bigger = plan("llama-3-8b", "h100", r.weight_dtype, r.kv_dtype, 2304, r.colocated.batch + 1)
        prefill = prefill_time_s(bigger.config, find_gpu("h100"), r.weight_dtype, 2048)
        more = colocated(bigger, prefill, 256)
        assert more.itl_s * 1e3 > 30 or more.ttft_s * 1e3 > 60 or r.colocated.batch == r.max_users
        # no stalls: the decode GPU of a disaggregated pair holds at least as many users
        assert r.disaggregated.batch >= r.colocated.batch
    assert rows[-1].max_users > rows[0].max_users                    # int4 weights leave more memory for KV


def test_a_tight_ttft_rules_out_what_the_per_token_target_allows():
    loose = meet_targets("mistral-7b", "h100", latency_ms=30, prompt_tokens=4096, output_tokens=128)
    tight = meet_targets("mistral-7b", "h100", latency_ms=30, ttft_ms=60, prompt_tokens=4096, output_tokens=128)
    assert all(r.colocated for r in loose)
    assert all(r.colocated is None and r.disaggregated is None and "TTFT" in r.reasons["colocated"] for r in tight)


def test_a_slow_gpu_says_why_no_precision_meets_the_target():
    text = targets_cli("llama-3-8b", "l4", latency_ms=15)
    assert text.count("ms a token for one user") == 2 * len(DTYPES)      # 5.7 GB / 300 GB/s > 15 ms, even int4
    assert "no precision meets the target on this GPU" in text


def test_plan_cli_with_ttft_prints_the_table_and_refuses_bad_input_in_one_line():
    ok = CliRunner().invoke(cli, ["plan", "-m", "llama-3-8b", "--gpu", "h200", "--latency-ms", "30",
                                  "--ttft-ms", "300", "--prompt-tokens", "2048"])
    assert ok.exit_code == 0, ok.output
    assert ok.output.startswith("llama-3-8b on H200-SXM: <= 30 ms a token, TTFT <= 300 ms")
    assert ok.output.count("disaggregated") >= len(DTYPES) and "most tokens per GPU at the target" in ok.output
    for args, says in [(["--ttft-ms", "300"], "--ttft-ms needs --latency-ms"),
                       (["--latency-ms", "30", "--ttft-ms", "300", "--prompt-tokens", "5000", "--context", "4096"],
                        "cannot hold a prompt of 5,000"),
                       (["--latency-ms", "30", "--ttft-ms", "300", "--gpu", "v100"], "unknown GPU")]:
        bad = CliRunner().invoke(cli, ["plan", *args])
        assert bad.exit_code != 0 and bad.stderr.count("\n") == 1 and says in bad.stderr, bad.output


def test_bad_targets_are_plan_errors():
    for kwargs in (dict(latency_ms=0), dict(ttft_ms=-1), dict(prompt_tokens=0)):
        with pytest.raises(PlanError):
            meet_targets("llama-3-8b", "h100", **({"latency_ms": 30} | kwargs))
