"""MoE in the tools: `minillm plan` holds every expert in memory but reads only the routed ones per
decode step, splits experts over GPUs (all-to-all bytes), and reproduces the workshop's GPT-OSS-120B
sizes from its real config.json; `minillm info` prints total vs active."""
import json

import pytest

from minillm.model.config import ModelConfig
from minillm.tools import planner
from minillm.tools.info import _report

MIXTRAL = ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                      n_experts=8, n_experts_per_token=2, moe_ffn_dim=14336, family="mixtral")


@pytest.mark.parametrize("dtype,workshop_gb", [("bf16", 240), ("fp8", 120), ("mxfp4", 65)])
def test_planner_reproduces_gpt_oss_120b_sizes(dtype, workshop_gb):
    gb = planner.weight_bytes(planner.PLANNER_ONLY["gpt-oss-120b"], dtype) / 1e9
    assert abs(gb / workshop_gb - 1) < 0.05, gb                 # 233.6 / 118.1 / 63.8 GB


def test_moe_decode_reads_the_routed_experts_only():
    c = MIXTRAL
    all_bytes = planner.weight_bytes(c, "bf16")
    assert all_bytes == 2 * c.n_params
    one = planner.weights_read_per_step(c, "bf16", users=1)
    assert one == pytest.approx(2 * c.n_active_params, rel=1e-6)  # batch 1: k of E experts
    assert planner.weights_read_per_step(c, "bf16", users=64) == pytest.approx(all_bytes, rel=1e-6)
    p = planner.plan(c, "h200", "bf16", context=1024, users=1)
    assert p.step_bytes < all_bytes and any("memory holds all 8 experts" in n for n in p.notes)
    text = planner.format_plan(p)
    assert "expert parallel 8" in text and "all-to-all" in text


def test_expert_parallel_all_to_all_bytes():
    (name, text), = planner.expert_parallel_rows(MIXTRAL, "bf16", ranks=(4,))
    per_layer_kb = 2 * 2 * 4096 * 2 * 3 / 4 / 1e3             # dispatch + combine, k=2, bf16, 3/4 off-GPU
    assert name == "expert parallel 4" and "2 experts a GPU" in text
    assert f"{per_layer_kb:.1f} KB x 32 MoE layers" in text


def test_info_prints_total_and_active():
    text = _report("mixtral-8x7b", MIXTRAL, None, "-")
    assert "8 of width 14336, top-2" in text and "active parameters" in text and "(12.880 B) a token" in text


def test_a_gpt_oss_config_missing_a_field_is_refused_in_one_line(tmp_path):
    from minillm.checkpoints.weights import read_config
    from minillm.errors import MiniLLMError
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                                                      "hidden_size": 2880, "num_hidden_layers": 36}))
    with pytest.raises(MiniLLMError, match="num_attention_heads is missing") as e:
        read_config(tmp_path)
    assert "\n" not in str(e.value)


def test_the_planner_reads_gpt_oss_120b_from_its_config_json():
    """The real config (minillm/tools/data): 116.83 B parameters, as OpenAI's model card counts them."""
    c = planner.PLANNER_ONLY["gpt-oss-120b"]
    assert (c.family, c.n_layers, c.n_experts, c.quantization) == ("gpt_oss", 36, 128, {"method": "mxfp4", "experts_only": True})
    assert round(c.n_params / 1e9, 2) == 116.83


def test_plan_cli_takes_the_expert_parallel_size():
    from click.testing import CliRunner
    from minillm.cli import cli
    out = CliRunner().invoke(cli, ["plan", "-m", "gpt-oss-120b", "--gpu", "h200", "--dtype", "mxfp4", "--ep", "4"])
    assert out.exit_code == 0, out.output
    assert "expert parallel 4" in out.output and "32 experts a GPU" in out.output
