"""The capacity planner against numbers worked out by hand from spec sheets and model shapes."""
import json
import math

import pytest

from minillm.model.config import PRESETS
from minillm.tools.planner import (GPUS, PlanError, find_gpu, format_plan, kv_bytes_per_token, plan, plot_plan,
                             run_cli, weight_bytes)

GB = 1e9

# Mistral-7B: vocab 32000, dim 4096, 32 layers, 32 query heads, 8 KV heads of 128, ffn 14336, untied head.
MISTRAL_LINEAR_PER_LAYER = 4096 * 4096 + 2 * (1024 * 4096) + 4096 * 4096 + 3 * (14336 * 4096)  # q, k+v, o, gate+up+down
MISTRAL_REST = 32000 * 4096 * 2 + 32 * 2 * 4096 + 4096            # embedding + LM head, two norms a layer, final norm
MISTRAL_PARAMS = 32 * MISTRAL_LINEAR_PER_LAYER + MISTRAL_REST      # 7,241,732,096
MISTRAL_KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2                        # K+V × layers × KV heads × head_dim × fp16

# Llama-3-8B: the same body as Mistral-7B, vocab 128256, max 8192 positions.
LLAMA3_PARAMS = 32 * MISTRAL_LINEAR_PER_LAYER + 128256 * 4096 * 2 + 32 * 2 * 4096 + 4096


def test_mistral_7b_kv_bytes_per_token_is_128_kib():
    assert MISTRAL_KV_PER_TOKEN == 131_072
    assert kv_bytes_per_token(PRESETS["mistral-7b"].config, "fp16") == MISTRAL_KV_PER_TOKEN


def test_max_users_mistral_7b_on_h100_bf16():
    p = plan("mistral-7b", "h100", "bf16", context=4096)
    weights = 2 * MISTRAL_PARAMS                                   # 14.48 GB
    budget = 80 * GB - weights - 0.10 * 80 * GB                    # 57.52 GB after a 10 % reserve
    kv_per_user = MISTRAL_KV_PER_TOKEN * 4096                      # 0.537 GB
    users = math.floor(budget / kv_per_user)
    assert users == 107
    step = (weights + users * kv_per_user) / 3.35e12               # memory-bound: ~21.5 ms
    assert 2 * MISTRAL_PARAMS * users / 989.4e12 < step            # the compute bound is ~1.6 ms
    assert (p.weights_bytes, p.kv_bytes_per_user, p.users, p.kv_dtype) == (weights, kv_per_user, users, "bf16")
    assert p.kv_budget_bytes == pytest.approx(budget)
    assert p.step_time_s == pytest.approx(step) and p.bound == "memory"
    assert p.tok_s_per_user == pytest.approx(1 / step)
    assert p.tok_s_total == pytest.approx(users / step)            # ~4,983 tok/s
    assert p.cost_per_million == pytest.approx(3.35 / (users / step * 3600) * 1e6)  # ~$0.187 at RunPod's $3.35/h


def test_max_context_at_given_users_mistral_7b_on_h100():
    p = plan("mistral-7b", "h100", "fp16", context=4096, users=16)
    budget = 80 * GB - 2 * MISTRAL_PARAMS - 8 * GB
    assert p.mode == "max-context"
    assert p.max_context == math.floor(budget / (16 * MISTRAL_KV_PER_TOKEN)) == 27_426
    assert (p.users, p.context, p.max_users) == (16, 4096, 107)    # 16 users at 4096 fit: evaluated there
    assert p.tok_s_total == pytest.approx(16 * 3.35e12 / (2 * MISTRAL_PARAMS + 16 * MISTRAL_KV_PER_TOKEN * 4096))


def test_llama_3_8b_on_l4_both_modes():
    weights = 2 * LLAMA3_PARAMS                                    # 16.06 GB of the L4's 24
    budget = 24 * GB - weights - 2.4 * GB
    p = plan("llama-3-8b", "L4", "bf16", context=4096)
    assert p.users == math.floor(budget / (131_072 * 4096)) == 10
    assert p.tok_s_total == pytest.approx(10 * 300e9 / (weights + 10 * 131_072 * 4096))
    assert p.cost_per_million == pytest.approx(0.47 / (p.tok_s_total * 3600) * 1e6)

    two = plan("llama-3-8b", "l4", "bf16", context=4096, users=2)   # memory allows ~21k: the model caps 8192
    assert math.floor(budget / (2 * 131_072)) > 8192 and two.max_context == 8192
    crowd = plan("llama-3-8b", "l4", "bf16", context=4096, users=40)
    assert crowd.max_context == math.floor(budget / (40 * 131_072)) == 1056
    assert crowd.context == 1056 and crowd.notes                   # evaluated where 40 users fit


def test_weights_too_big_is_a_plan_with_zero_users():
    p = plan("llama-3-8b", "l4", "fp32")                           # 32 GB of weights on a 24 GB GPU
    assert p.weights_bytes == 4 * LLAMA3_PARAMS
    assert (p.users, p.fits, p.kv_budget_bytes, p.tok_s_total, p.cost_per_million) == (0, False, 0, 0, None)
    assert "does not fit" in format_plan(p)


def test_not_one_users_kv_cache_fits():
    p = plan("llama-2-7b", "l4", "fp16", context=16384)            # MHA: 512 KiB a token, 8.6 GB a user
    kv_per_user = 2 * 32 * 32 * 128 * 2 * 16384
    assert 24 * GB - 2 * PRESETS["llama-2-7b"].config.n_params - 2.4 * GB < kv_per_user
    assert p.users == 0 and any("does not fit" in n for n in p.notes)


def test_int8_and_int4_weight_bytes_count_their_scales():
    c = PRESETS["mistral-7b"].config
    linear = 32 * MISTRAL_LINEAR_PER_LAYER
    rows = 32 * (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096)          # one fp16 scale per output row
    assert weight_bytes(c, "int8") == linear * 1 + rows * 2 + MISTRAL_REST * 2
    groups = 32 * ((4096 + 1024 + 1024 + 4096 + 14336 + 14336) * (4096 // 128) + 4096 * (14336 // 128))
    assert weight_bytes(c, "int4") == linear // 2 + groups * 2 + MISTRAL_REST * 2   # ~3.86 GB + 16-bit rest
    # SmolLM2: rows of 576 inputs are 4.5 groups of 128, so 5 scales a row
    s = PRESETS["smollm2-135m"].config
    s_linear = 30 * (576 * 576 * 2 + 192 * 576 * 2 + 1536 * 576 * 3)
    s_groups = 30 * ((576 + 192 + 192 + 576 + 1536 + 1536) * 5 + 576 * 12)
    assert weight_bytes(s, "int4") == s_linear // 2 + s_groups * 2 + (s.n_params - s_linear) * 2


def test_kv_dtypes_and_defaults():
    c = PRESETS["mistral-7b"].config
    assert kv_bytes_per_token(c, "int8") == 2 * 32 * 8 * 128 + 2 * 32 * 8 * 2   # + an fp16 scale per token per head
    assert kv_bytes_per_token(c, "fp32") == 2 * MISTRAL_KV_PER_TOKEN
    assert plan("mistral-7b", weight_dtype="int4").kv_dtype == "fp16"
    assert plan("mistral-7b", weight_dtype="float32").kv_dtype == "fp32"


def test_compute_bound_when_many_users_share_tiny_contexts():
    p = plan("smollm2-135m", "h100", "bf16", context=16)
    assert p.bound == "compute"
    assert p.step_time_s == pytest.approx(2 * PRESETS["smollm2-135m"].config.n_params * p.users / 989.4e12)


def test_gpu_names_price_and_reserve_overrides():
    assert find_gpu("H100") is find_gpu("h100-80gb") is find_gpu("H100 SXM") is GPUS["H100-80GB-SXM"]
    assert find_gpu("rtx 6000 ada").memory_bytes == 48 * GB
    p = plan("mistral-7b", "a100", price_per_hour=1.0, reserve=4e9)
    assert p.reserve_bytes == 4e9 and p.kv_budget_bytes == pytest.approx(80 * GB - 2 * MISTRAL_PARAMS - 4e9)
    assert p.cost_per_million == pytest.approx(1.0 / (p.tok_s_total * 3600) * 1e6)


def test_model_from_a_config_json_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["mistral-7b"].config.to_hf()))
    assert plan(tmp_path, "h100").users == plan("mistral-7b", "h100").users


@pytest.mark.parametrize("kwargs, message", [
    (dict(gpu="v100"), "unknown GPU"), (dict(dtype="fp6"), "unknown weight dtype"),
    (dict(kv_dtype="int4"), "unknown KV dtype"), (dict(context=0), "context must be positive"),
    (dict(users=-1), "users must be positive"), (dict(reserve="lots"), "reserve"),
    (dict(model="gpt-5"), "unknown model"),
])
def test_run_cli_rejects_bad_input_in_one_line(kwargs, message):
    args = dict(model="mistral-7b", gpu="h100", context=4096, users=None, dtype="bf16", kv_dtype=None,
                price=None, plot=None, reserve=None) | kwargs
    with pytest.raises(ValueError, match=message) as e:
        run_cli(**args)
    assert isinstance(e.value, PlanError) and "\n" not in str(e.value)


def test_run_cli_prints_the_table_and_writes_plots(tmp_path):
    text = run_cli("mistral-7b", "h100", 4096, 16, "fp16", "fp16", 2.5, tmp_path / "plots", "10%")
    assert "max context     27,426 tokens at 16 users" in text and "per 1M output tokens" in text
    pngs = sorted((tmp_path / "plots").glob("*.png"))
    assert [p.name for p in pngs] == ["kv_memory_vs_context.png", "max_users_vs_context.png"]
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plots_of_a_plan_that_does_not_fit(tmp_path):
    assert all(p.stat().st_size > 0 for p in plot_plan(plan("llama-3-8b", "l4", "fp32"), tmp_path))


def test_plot_without_matplotlib_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib.figure", None)
    with pytest.raises(PlanError, match="pip install"):
        plot_plan(plan("mistral-7b"), tmp_path)


def test_mla_weights_and_latent_kv_cache():
    from minillm.model.config import ModelConfig
    try:
        c = ModelConfig(vocab_size=1000, dim=256, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=512,
                        attention="mla", q_lora_rank=64, kv_lora_rank=128, qk_nope_head_dim=32,
                        qk_rope_head_dim=16, v_head_dim=32)
    except TypeError:
        pytest.skip("this ModelConfig has no MLA fields")
    assert kv_bytes_per_token(c, "bf16") == 2 * (128 + 16) * 2          # layers × (latent + rope key) × 2 bytes
    assert kv_bytes_per_token(c, "int8") == 2 * (128 + 16) + 2 * 2      # + one fp16 scale a layer
    linear = 2 * (256 * 64 + 64 * 4 * 48 + 256 * (128 + 16) + 128 * 4 * (32 + 32) + 4 * 32 * 256 + 3 * 256 * 512)
    rows = 2 * (64 + 4 * 48 + 128 + 16 + 4 * 64 + 256 + 512 + 512 + 256)
    assert weight_bytes(c, "int8") == linear + rows * 2 + (c.n_params - linear) * 2


# ---- the workshop's workflow: rank GPUs by cost per 1M output tokens (issue 21) -----------------------
from minillm.tools.planner import (PRICE_SOURCES, PlannerAPI, parse_prices, rank_cli,  # noqa: E402
                                   rank_gpus)

WORKSHOP_CARDS = ["H100-80GB-SXM", "H200-SXM", "A100-80GB-SXM", "L40S", "A40", "RTX-PRO-6000-Blackwell", "L4", "B200"]


def test_gpu_table_has_the_workshop_cards_with_a_stated_price_source():
    assert set(WORKSHOP_CARDS) <= set(GPUS)
    for g in GPUS.values():
        assert g.memory_bytes > 0 and g.bandwidth > 0 and g.bf16_flops > 0 and g.price_per_hour > 0
        assert g.price_source in PRICE_SOURCES and any(ch.isdigit() for ch in PRICE_SOURCES[g.price_source])
    assert find_gpu("l40s") is GPUS["L40S"] and find_gpu("RTX PRO 6000") is GPUS["RTX-PRO-6000-Blackwell"]


def test_ranking_takes_the_largest_batch_that_meets_the_latency_and_sorts_by_cost():
    rows = rank_gpus("llama-3-8b", latency_ms=30, min_batch=8)
    met = [r for r in rows if r.plan is not None]
    assert len(met) >= 5 and {r.gpu.name for r in rows} == set(GPUS)
    costs = [r.cost_per_million for r in met]
    assert costs == sorted(costs)
    for r in met:
        p = r.plan
        assert p.users >= 8 and p.step_time_s * 1e3 <= 30
        assert p.cost_per_million == pytest.approx(r.price_per_hour / (p.tok_s_total * 3600) * 1e6)
        bigger = plan("llama-3-8b", r.gpu, context=4096, users=p.users + 1)
        # one more user breaks the latency target, or memory (then the plan is evaluated at a shorter context)
        assert bigger.step_time_s * 1e3 > 30 or p.users == p.max_users
    l4 = next(r for r in rows if r.gpu.name == "L4")          # 300 GB/s: 16 GB of weights alone take 54 ms
    assert l4.plan is None and "ms a token" in l4.reason


def test_ranking_follows_overridden_prices():
    cheap = rank_gpus("llama-3-8b", 30, 8, prices=parse_prices("a40=0.01"))
    assert cheap[0].gpu.name == "A40" and cheap[0].price_per_hour == 0.01
    assert parse_prices("H100=2, l4=0.5") == {"H100-80GB-SXM": 2.0, "L4": 0.5}
    for bad in ("h100", "h100=cheap", "h100=-1", "v100=1"):
        with pytest.raises(PlanError):
            parse_prices(bad)


def test_rank_cli_table_names_its_price_sources_and_writes_a_png(tmp_path):
    text = rank_cli("llama-3-8b", 25, 16, prices="l40s=0.9", png=tmp_path / "rank.png")
    lines = text.splitlines()
    assert lines[1].split() == ["GPU", "GB", "TB/s", "TFLOP/s", "$/h", "batch", "ms/token", "tok/s", "$/1M", "out"]
    assert lines[2].startswith("B200") and "docs.runpod.io" in text and "given on the command line" in text
    assert (tmp_path / "rank.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_pages_json_is_the_planners_own_numbers():
    api = PlannerAPI()
    assert set(WORKSHOP_CARDS) <= {g["name"] for g in api.options()["gpus"]}
    got = api.plan({"model": "mistral-7b", "gpu": "a100", "context": "8192", "users": "4", "weight_dtype": "int8",
                    "kv_dtype": "int8", "latency_ms": "40"})
    want = plan("mistral-7b", "a100", "int8", "int8", 8192, 4)
    assert got["decode"]["tok_s_total"] == want.tok_s_total and got["cost_per_million"] == want.cost_per_million
    assert got["memory_gb"]["weights"] == want.weights_bytes / GB
    assert got["memory_gb"]["kv"] == pytest.approx(4 * want.kv_bytes_per_user / GB)
    assert got["ranking"][0]["cost_per_million"] == rank_gpus("mistral-7b", 40, 4, "int8", "int8", 8192)[0].cost_per_million
    with pytest.raises(PlanError, match="context must be a number"):
        api.plan({"context": "lots"})


def test_plan_cli_ranks_with_latency_ms(tmp_path):
    from click.testing import CliRunner

    from minillm.cli import cli
    result = CliRunner().invoke(cli, ["plan", "-m", "llama-3-8b", "--latency-ms", "25", "--min-batch", "16",
                                      "--png", str(tmp_path / "rank.png")])
    assert result.exit_code == 0, result.output
    assert "cheapest first" in result.output and (tmp_path / "rank.png").exists()
    bad = CliRunner().invoke(cli, ["plan", "--latency-ms", "25", "--prices", "h100=free"])
    assert bad.exit_code != 0 and bad.output.count("\n") == 1 and "h100=free" in bad.output


def test_a_target_no_gpu_meets_is_a_table_of_reasons(tmp_path):
    text = rank_cli("llama-3-8b", 1, 1, png=tmp_path / "none.png")       # 16 GB in 1 ms: 16 TB/s, nobody
    assert "(none of them does)" in text and text.count("no: ") == len(GPUS)
    assert (tmp_path / "none.png").exists()
