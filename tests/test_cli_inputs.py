"""Every input class that used to end in a traceback: one line, a non-zero exit (issue 16).

The CLI's option types refuse what the library would choke on (NaN, inf, negative seeds, empty paths),
the library refuses the same values from Python with an InvalidValue (a MiniLLMError), and a student's
file that does not import is a failed check that names its line."""
import math
import shutil

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
