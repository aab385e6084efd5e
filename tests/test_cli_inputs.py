"""Every input class that used to end in a traceback: one line, a non-zero exit (issue 16).

The CLI's option types refuse what the library would choke on (NaN, inf, negative seeds, empty paths),
the library refuses the same values from Python with an InvalidValue (a MiniLLMError), and a student's
file that does not import is a failed check that names its line."""
import math
import shutil
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from hf_models import llama_config, save_random_model
from minillm.cli import Finite, cli
from minillm.errors import InvalidValue, MiniLLMError


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_dir):
    """A random 2-layer model with SmolLM2's tokenizer files: loads in a blink, speaks text."""
    path = tmp_path_factory.mktemp("tiny-inputs")
    save_random_model(llama_config(vocab_size=49152, num_hidden_layers=2, max_position_embeddings=64), path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    import minillm
    return minillm.load(str(tiny_model))


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def assert_one_line_error(result, *fragments):
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), \
        f"traceback: {result.exception!r}"
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("minillm: error:"), lines[0]
    for f in fragments:
        assert f in lines[0], lines[0]


# ---- generate: the values of the issue -------------------------------------------------------------
@pytest.mark.parametrize("args,fragment", [
    (["", "--no-chat"], "prompt is empty"),
    (["", "--no-chat", "--speculative", "ngram"], "prompt is empty"),
    (["hi", "--seed", "-1"], "--seed"),
    (["hi", "-t", "nan"], "finite"),
    (["hi", "-t", "inf"], "finite"),
    (["hi", "--top-p", "nan"], "top-p"),
])
def test_generate_refuses_in_one_line(tiny_model, args, fragment):
    assert_one_line_error(run("generate", "-m", tiny_model, "-n", 2, *args), fragment)


def test_chat_refuses_a_nan_temperature_before_the_first_prompt(tiny_model):
    result = CliRunner().invoke(cli, ["chat", "-m", str(tiny_model), "-t", "nan"], input="hello\n\n")
    assert_one_line_error(result, "finite")


# ---- the sweep: every numeric option of every command ---------------------------------------------
def _every_option():
    def walk(command, path):
        for param in command.params:
            if isinstance(param, click.Option):
                yield path, param
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, path + [name])
    return list(walk(cli, []))


def test_every_float_option_refuses_nan_and_inf():
    floats = [(path, p) for path, p in _every_option() if isinstance(p.type, click.types.FloatParamType)]
    assert floats                                       # temperature, top-p, prefix-share, price, ...
    for path, param in floats:
        for bad in ("nan", "inf", "-inf"):
            with pytest.raises(click.BadParameter):
                param.type.convert(bad, param, None)
        assert isinstance(param.type, Finite), (path, param.name)


def test_every_integer_option_has_a_lower_bound():
    """A count, a size or a seed below 0 (often below 1) is never meaningful: the type says so."""
    ints = [(path, p) for path, p in _every_option() if isinstance(p.type, click.types.IntParamType)]
    assert ints
    for path, param in ints:
        assert isinstance(param.type, click.IntRange) and param.type.min is not None, (path, param.name)
        with pytest.raises(click.BadParameter):
            param.type.convert("-1", param, None)


@pytest.mark.parametrize("args,fragment", [
    (["bench", "serve", "--prefix-share", "nan"], "--prefix-share"),
    (["bench", "serve", "--seed", "-1"], "--seed"),
    (["bench", "serve", "--requests", "99999999999999999999"], "--requests"),     # would build prompts forever
    (["plan", "--price", "inf"], "--price"),
    (["plan", "--price", "nan"], "--price"),
])
def test_other_commands_refuse_in_one_line(args, fragment):
    assert_one_line_error(run(*args), fragment)


def test_convert_refuses_an_empty_or_file_destination(tiny_model, tmp_path):
    assert_one_line_error(run("convert", tiny_model, ""), "DST")
    assert_one_line_error(run("convert", tiny_model, tiny_model / "config.json"), "is a file")


def test_a_path_the_system_refuses_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert_one_line_error(run("plan", "--plot", blocker / "charts"), str(blocker))


def test_eval_on_a_binary_file_is_one_line(tmp_path):
    binary = tmp_path / "data.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    assert_one_line_error(run("eval", "perplexity", "--text", binary, "--chars", 400), "UTF-8")


def test_eval_windows_longer_than_the_context_are_one_line(tiny_model):
    result = run("eval", "perplexity", "-m", tiny_model, "--context", 99999, "--chars", 400, "--no-baseline")
    assert_one_line_error(result, "--context")                # no progress bar before it


def test_bench_longer_than_the_context_is_one_line(tiny_model):
    assert_one_line_error(run("bench", "-m", tiny_model, "--prompt-tokens", 100, "--new-tokens", 2, "--no-peer",
                              "--repeats", 1), "context")


# ---- the library says the same to Python users ----------------------------------------------------
@pytest.mark.parametrize("kwargs", [dict(temperature=math.nan), dict(temperature=math.inf), dict(seed=-1),
                                    dict(top_k=0), dict(top_p=math.nan), dict(max_tokens=2.5),
                                    dict(max_tokens=0)])
def test_llm_generate_refuses_with_a_minillm_error(tiny_llm, kwargs):
    with pytest.raises(MiniLLMError):
        tiny_llm.generate("hi", **({"max_tokens": 2} | kwargs))


def test_sampling_params_refuse_non_finite_values_as_value_errors():
    from minillm.engine.sampling import SamplingParams
    for kwargs in (dict(temperature=math.nan), dict(temperature=-math.inf), dict(seed=-3), dict(seed=1.5)):
        with pytest.raises(InvalidValue):
            SamplingParams(**kwargs)
    assert issubclass(InvalidValue, ValueError)        # callers that caught ValueError still do
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=2 ** 70)     # big seeds are fine for NumPy


def test_an_empty_prompt_is_a_minillm_error_in_python(tiny_llm):
    with pytest.raises(MiniLLMError, match="empty"):
        tiny_llm.generate("", chat=False, max_tokens=2)


# ---- exercise check on a student's broken file -----------------------------------------------------
@pytest.mark.parametrize("source,fragments", [
    ("import numpy as np\n\n\ndef rmsnorm(x, weight, eps):\n    return x * weight /\n",
     ["line 5", "SyntaxError"]),
    ("import numpy as np\nimport numpyy\n\n\ndef rmsnorm(x, weight, eps):\n    return x\n",
     ["line 2", "ModuleNotFoundError", "numpyy"]),
    ("def rmsnorm(x, weight, eps):\n    return x\n  return x\n", ["line 3", "IndentationError"]),
    ("X = undefined_name + 1\n", ["line 1", "NameError"]),
])
def test_exercise_check_reports_a_broken_file_as_a_failed_check(tmp_path, source, fragments):
    student = tmp_path / "ex01_rmsnorm.py"
    student.write_text(source)
    result = run("exercise", "check", 1, "--file", student)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    note = next(line for line in result.output.splitlines() if "does not load" in line)
    for f in fragments:
        assert f in note, note
    assert "FAILED" in result.output


def test_exercise_check_refuses_a_file_that_is_not_python(tmp_path):
    text = tmp_path / "answer.txt"
    text.write_text("def rmsnorm(): pass\n")
    assert_one_line_error(run("exercise", "check", 1, "--file", text), "Python file")


# ---- issue 40: what a newcomer met ------------------------------------------------------------------
def _stdin(*args, data: bytes):
    return CliRunner().invoke(cli, [str(a) for a in args], input=data)


def test_a_prompt_that_is_not_utf8_is_refused_naming_the_byte(tiny_model, tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(b"hi \xff there")
    assert_one_line_error(_stdin("generate", "-m", tiny_model, "-n", 1, "-", data=b"hi \xff"),
                          "standard input", "not UTF-8", "byte 3")
    assert_one_line_error(_stdin("generate", "-m", tiny_model, "-n", 1, "-f", "-", data=b"hi \xff"), "byte 3")
    assert_one_line_error(run("generate", "-m", tiny_model, "-n", 1, "-f", latin1), str(latin1), "byte 3")
    # an argument's bytes reach Python as surrogate escapes (os.fsdecode)
    assert_one_line_error(run("generate", "-m", tiny_model, "-n", 1, "hi \udcff"), "PROMPT", "byte 3")


def test_a_prompt_that_is_not_utf8_is_one_line_from_a_pipe(tiny_model):
    """`printf 'hi \\xff' | minillm generate -`, as a shell runs it."""
    done = subprocess.run([sys.executable, "-m", "minillm", "generate", "-m", str(tiny_model), "-n", "1", "-"],
                          input=b"hi \xff", capture_output=True)
    assert done.returncode != 0 and done.stdout == b""
    assert done.stderr.decode().splitlines() == \
        ["minillm: error: standard input: not UTF-8 text (byte 3: invalid start byte)"]


@pytest.mark.parametrize("prompt", ["", " ", "  \n\t "])
def test_an_empty_or_whitespace_prompt_is_refused(tiny_model, tmp_path, prompt):
    for chat in ("--chat", "--no-chat"):
        assert_one_line_error(run("generate", "-m", tiny_model, "-n", 1, chat, prompt), "the prompt is")
    assert_one_line_error(_stdin("generate", "-m", tiny_model, "-n", 1, "-", data=prompt.encode()), "the prompt is")
    blank = tmp_path / "blank.txt"
    blank.write_text(prompt)
    assert_one_line_error(run("generate", "-m", tiny_model, "-n", 1, "-f", blank), "the prompt is")


def test_more_threads_than_this_process_may_use_are_refused(tiny_model):
    from minillm import threads
    n = threads.cores()
    assert_one_line_error(run("generate", "-m", tiny_model, "-n", 1, "--threads", n + 1, "hi"),
                          "--threads", f"more than the {n} cores")
    assert_one_line_error(run("bench", "-m", tiny_model, "--threads", 64 * n, "--no-peer"), "--threads")
    with pytest.raises(InvalidValue, match="cores"):                  # load(threads=N) says the same
        threads.fix(n + 1)
    result = run("generate", "-m", tiny_model, "-n", 1, "--threads", n, "hi")   # every core is fine
    assert result.exit_code == 0, result.output


def test_convert_into_a_folder_that_holds_files_needs_force(tiny_model, tmp_path):
    out = tmp_path / "out"
    out.mkdir()                                          # an empty folder is fine
    assert run("convert", tiny_model, out).exit_code == 0
    weights = out / "model.safetensors"
    weights.write_bytes(b"the user's own file")
    assert_one_line_error(run("convert", tiny_model, out, "--quant", "int8"), str(out), "--force")
    assert weights.read_bytes() == b"the user's own file"
    for rewrite in ([], ["--flashnorm"], ["--kv-heads", 1]):
        assert_one_line_error(run("convert", tiny_model, out, *rewrite), "--force")
    result = run("convert", tiny_model, out, "--quant", "int8", "--force")
    assert result.exit_code == 0, result.output
    from minillm.checkpoints.weights import load_hf_dir
    assert load_hf_dir(out)[0].quantization["method"] == "int8"


def test_help_texts_have_no_placeholders_and_every_sampling_option_says_what_it_does():
    def helps(command, path):
        yield path, command.get_help(click.Context(command, info_name=" ".join(path)))
        for name, sub in getattr(command, "commands", {}).items():
            yield from helps(sub, path + [name])
    for path, text in helps(cli, ["minillm"]):
        assert "None" not in text, (path, text)
    generate = cli.commands["generate"]
    for param in generate.params:
        if param.name in ("max_tokens", "temperature", "top_k", "top_p", "seed"):
            assert param.help, param.name


def test_every_command_with_a_model_takes_dash_m(tiny_model):
    models = [(path, p) for path, p in _every_option() if "--model" in p.opts]
    assert {tuple(path) for path, _ in models} >= {("generate",), ("info",), ("lesson",), ("bench",)}
    for path, param in models:
        assert "-m" in param.opts, path
    described = run("info", "-m", tiny_model)
    assert described.exit_code == 0 and described.output == run("info", tiny_model).output
    assert_one_line_error(run("info", "-m", tiny_model, tiny_model), "not both")


def test_the_metrics_line_counts_in_words_and_gives_a_rate_only_for_decoded_tokens(tiny_model):
    one = run("generate", "-m", tiny_model, "-n", 1, "--no-chat", "hi").stderr
    assert "[prompt 1 token · " in one and " · 1 new token · " in one and "tok/s" not in one, one
    three = run("generate", "-m", tiny_model, "-n", 3, "--no-chat", "hi there").stderr
    assert "[prompt 2 tokens · " in three and " · 3 new tokens · decode " in three, three


def test_a_missing_path_reads_the_same_in_every_command(tiny_model, tmp_path):
    missing = tmp_path / "nowhere"
    lines = {" ".join(map(str, args)): run(*args).output.strip() for args in [
        ("generate", "-m", missing, "hi"), ("info", missing), ("convert", missing, tmp_path / "out"),
        ("convert", missing, tmp_path / "out", "--flashnorm"), ("convert", missing, tmp_path / "out", "--kv-heads", 1)]}
    assert len(set(lines.values())) == 1, lines
    assert_one_line_error(run("info", missing), f"unknown model '{missing}': not a file or folder")
    # a file the user names: -f reads like --text and --file
    for args in [("generate", "-f", missing), ("eval", "perplexity", "--text", missing),
                 ("exercise", "check", 1, "--file", missing)]:
        assert_one_line_error(run(*args), f"File '{missing}' does not exist.")


def test_a_missing_preset_folder_says_how_to_pull_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                      # README's tour, run where weights/ holds nothing
    result = CliRunner().invoke(cli, ["convert", "weights/smollm2-135m", str(tmp_path / "out")],
                                env={"MINILLM_WEIGHTS": str(tmp_path / "w")})
    assert_one_line_error(result, "`minillm pull smollm2-135m` fetches it into " + str(tmp_path / "w" / "smollm2-135m"))
