"""Student mode (`minillm generate --student DIR`): the real SmolLM2 on a student's pieces, compared with
the engine's own pieces layer by layer; a wrong piece found at its layer and position."""
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import minillm
from hf_models import llama_config, save_random_model
from minillm.cli import cli
from minillm.course.student import LOGIT_TOLERANCE, find_pieces, report_lines, run_student, student_model

SOLUTIONS = Path(__file__).resolve().parents[1] / "lessons" / "exercises" / "solutions"
STUBS = SOLUTIONS.parent
PROMPT = "The capital of France is"

WRONG_NORM = '''import numpy as np
def rmsnorm(x, weight, eps):          # eps added after the square root, not inside it
    return x / (np.sqrt(np.mean(x * x, axis=-1, keepdims=True)) + eps) * weight
'''
WRONG_ROPE = '''import numpy as np
def apply_rope(x, cos, sin):          # neighbours paired, not the two halves
    out = np.empty_like(x)
    x1, x2, c, s = x[..., 0::2], x[..., 1::2], cos[:, None, :], sin[:, None, :]
    out[..., 0::2], out[..., 1::2] = x1 * c - x2 * s, x2 * c + x1 * s
    return out
'''
WRONG_INT8 = '''import numpy as np
def quantize_int8_per_row(w):         # one scale for the whole matrix, by 128
    scale = np.abs(w).max() / 128
    return np.clip(np.rint(w / scale), -127, 127).astype(np.int8), np.full(len(w), scale, np.float32)
'''


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    llm = minillm.load(str(smollm2_dir))
    return llm, llm.prompt_ids(PROMPT, chat=False)


def _folder(tmp_path, **files) -> Path:
    for name, text in files.items():
        (tmp_path / f"{name}.py").write_text(text)
    return tmp_path


def test_the_solutions_as_pieces_answer_paris_within_tolerance(smollm2):
    llm, ids = smollm2
    pieces = find_pieces(SOLUTIONS)
    reference, student = student_model(llm.model, pieces)
    run = run_student(reference, student, pieces, ids, max_tokens=2)
    assert run.max_error <= LOGIT_TOLERANCE and run.divergence is None and run.matches
    assert llm.tokenizer.decode(run.tokens).strip().startswith("Paris")
    assert all(pieces.pieces[n].calls > 0 for n in ("01", "02", "03", "04"))      # they did run in the model


@pytest.mark.parametrize("name, text, position", [("ex01_rmsnorm", WRONG_NORM, 0),
                                                  ("ex03_apply_rope", WRONG_ROPE, 1)])   # position 0: angle 0
def test_a_wrong_piece_is_found_at_layer_0_and_its_position(smollm2, tmp_path, name, text, position):
    llm, ids = smollm2
    pieces = find_pieces(_folder(tmp_path, **{name: text}))
    reference, student = student_model(llm.model, pieces)
    run = run_student(reference, student, pieces, ids, max_tokens=1)
    assert not run.matches and run.max_error > LOGIT_TOLERANCE
    assert (run.divergence.layer, run.divergence.position) == (0, position)
    lines = report_lines(run, pieces, ids, llm.tokenizer.decode)
    assert f"first at layer 0, position {position} (token " in lines[1]


def test_the_printout_names_pieces_used_unused_and_stubs(smollm2_dir, tmp_path):
    folder = _folder(tmp_path)
    shutil.copy(SOLUTIONS / "ex01_rmsnorm.py", folder)
    shutil.copy(SOLUTIONS / "ex08_quantize_int8.py", folder)
    shutil.copy(STUBS / "ex03_apply_rope.py", folder)                 # the handout's stub, not written yet
    result = CliRunner().invoke(cli, ["generate", "--student", str(folder), "-m", str(smollm2_dir), "--no-chat",
                                      "--max-tokens", "1", PROMPT])
    assert result.exit_code == 0, result.output
    assert "Paris" in result.stdout
    err = result.stderr
    assert "imported, not isolated" in err and "ungraded" in err
    assert "yours:    01 rmsnorm, 08 quantize_int8_per_row" in err
    assert "not written yet (the engine's own runs): 03 apply_rope" in err
    assert "used by this run: rmsnorm (" in err
    assert "not used by this run: quantize_int8_per_row (needs generate --quant int8)" in err


def test_options_student_mode_does_not_run_are_refused_in_one_line(tmp_path):
    result = CliRunner().invoke(cli, ["generate", "--student", str(tmp_path), "--temperature", "0.7", "hi"])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        "minillm: error: --student runs on the CPU with the default cache, decoding greedily (sampling with "
        "--speculative); it does not run with --temperature"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_random_model(llama_config(n_heads=4, n_kv_heads=2, eos_token_id=None), path)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return minillm.load(str(tiny_dir))


def test_int8_with_the_students_quantizer_matches_the_engines_int8(tiny, tmp_path):
    ids = [1, 5, 9, 2]
    (tmp_path / "good").mkdir()
    shutil.copy(SOLUTIONS / "ex08_quantize_int8.py", tmp_path / "good")
    good = find_pieces(tmp_path / "good")
    reference, student = student_model(tiny.model, good, quant="int8")
    run = run_student(reference, student, good, ids, max_tokens=2)
    assert run.matches and good.pieces["08"].calls == 7 * len(tiny.model.layers)
    plain = student_model(tiny.model, good)[0].prefill(ids, tiny.model.new_cache(8))
    assert not np.allclose(plain, reference.prefill(ids, reference.new_cache(8)), atol=1e-6)   # int8 did run

    (tmp_path / "bad").mkdir()
    bad = find_pieces(_folder(tmp_path / "bad", ex08_quantize_int8=WRONG_INT8))
    reference, student = student_model(tiny.model, bad, quant="int8")
    run = run_student(reference, student, bad, ids, max_tokens=1)
    assert not run.matches and run.divergence.layer == 0


WRONG_PACK = '''import numpy as np
def pack_batch(chunks):               # every chunk's positions from 0, not from its start
    tokens = np.concatenate([np.asarray(t, dtype=np.int64) for t, _ in chunks])
    positions = np.concatenate([np.arange(len(t)) for t, _ in chunks])
    return tokens, positions, np.cumsum([len(t) for t, _ in chunks]) - 1
'''


def test_the_engine_batches_on_the_students_gather_and_packing(tiny, tmp_path):
    from minillm.course.student import student_llm
    from minillm.engine.engine import Engine
    prompts = [[1, 5, 9, 2, 7], [3, 4], [8, 8, 8, 1, 2, 3, 4, 5, 6]]
    want = [r.token_ids for r in Engine(tiny, block_size=4).generate(prompts, max_tokens=4)]
    llm, pieces = student_llm(tiny, SOLUTIONS)
    got = [r.token_ids for r in Engine(llm, block_size=4).generate(prompts, max_tokens=4)]
    assert got == want
    assert all(pieces.pieces[n].calls > 0 for n in ("16", "17", "02.2", "01", "03"))
    assert tiny.model.pieces is not llm.model.pieces              # the engine's own model is untouched

    wrong, _ = student_llm(tiny, _folder(tmp_path, ex17_pack_batch=WRONG_PACK))
    right, ref = (_decode_logits(m) for m in (llm.model, tiny.model))
    assert np.abs(right - ref).max() < 1e-5 and np.abs(_decode_logits(wrong.model) - ref).max() > 1e-4


def _decode_logits(model):
    """A prompt of 5, then one decode step at position 5, through the batching runner.   -> [vocab]"""
    from minillm.engine.batched import BatchedRunner, SeqChunk
    from minillm.engine.paged_kv import PagedKVCache
    runner = BatchedRunner(model, PagedKVCache(model.config, 4, 4))
    runner.forward([SeqChunk([1, 5, 9, 2, 7], 0, [2, 0])])
    return runner.forward([SeqChunk([3], 5, [2, 0])])[0]


def test_serve_student_prints_the_pieces_and_what_ran(tiny_dir, tmp_path, monkeypatch):
    from minillm.engine.engine import Engine
    from minillm.serve import server
    served = {}

    def fake_serve(llm, name, host, port, options, planner=None, **engine_options):   # one request, no HTTP
        served["tokens"] = Engine(llm, block_size=4).generate([[1, 2, 3]], max_tokens=2)[0].token_ids
    monkeypatch.setattr(server, "serve", fake_serve)
    folder = _folder(tmp_path)
    shutil.copy(SOLUTIONS / "ex16_block_table_gather.py", folder)
    shutil.copy(SOLUTIONS / "ex04_top_p_filter.py", folder)
    result = CliRunner().invoke(cli, ["serve", "--student", str(folder), "-m", str(tiny_dir)])
    assert result.exit_code == 0, result.output
    assert len(served["tokens"]) == 2
    assert "yours:    04 top_p_filter, 16 gather_through_block_table" in result.stderr
    assert "used by this run: gather_through_block_table (" in result.stderr
    assert "not used by this run: top_p_filter (needs generate without --speculative)" in result.stderr


def test_a_piece_that_raises_is_named_in_one_line(tiny, tmp_path):
    from minillm.course.student import StudentPieceError
    pieces = find_pieces(_folder(tmp_path, ex03_apply_rope="def apply_rope(x, cos, sin):\n    return x[5]\n"))
    reference, student = student_model(tiny.model, pieces)
    with pytest.raises(StudentPieceError, match=r"^your apply_rope \(ex03_apply_rope.py\) raised IndexError: "):
        run_student(reference, student, pieces, [1, 2, 3], max_tokens=1)


def test_the_handout_readme_says_how_to_run_student_mode(tmp_path):
    result = CliRunner().invoke(cli, ["exercise", "handout", str(tmp_path / "mine")])
    assert result.exit_code == 0, result.output
    readme = (tmp_path / "mine" / "README.md").read_text()
    assert 'minillm generate --student . --no-chat "The capital of France is"' in readme
    assert "local\nand ungraded" in readme or "local and ungraded" in readme
    assert (tmp_path / "mine" / "ex02.2_attend_over_cache.py").exists()       # the student-mode pieces' stubs


ALWAYS_REJECTS = '''import numpy as np
def speculative_step(p, q, token):    # rejects every draft, and draws the correction from p, not p - q
    return 0.0, p.copy()
'''


def test_speculative_sampling_runs_the_students_accept_step(tiny, tmp_path):
    from minillm.course.student import speculative_tokens
    ids = [1, 2, 3, 4, 5, 6]
    params = tiny.sampling_params(temperature=1.0, seed=5)

    def tokens(folder):
        pieces = find_pieces(folder)
        models = student_model(tiny.model, pieces)
        runs = [speculative_tokens(tiny, m, ids, 24, (), "layers:1", 4, params) for m in models]
        return runs, pieces.pieces["20"].calls
    (tmp_path / "good").mkdir()
    shutil.copy(SOLUTIONS / "ex20_speculative_step.py", tmp_path / "good")
    (reference, student), calls = tokens(tmp_path / "good")
    assert student == reference and calls > 0
    (tmp_path / "bad").mkdir()
    (wrong_reference, wrong), calls = tokens(_folder(tmp_path / "bad", ex20_speculative_step=ALWAYS_REJECTS))
    assert wrong_reference == reference and wrong != reference and calls > 0


WRONG_DECODE_WRITE = '''def kv_cache_update(cache_k, cache_v, k_new, v_new, pos):   # decode writes one slot too late
    T = k_new.shape[1]
    at = pos + (1 if T == 1 else 0)
    cache_k[:, at:at + T], cache_v[:, at:at + T] = k_new, v_new
    return cache_k[:, :at + T], cache_v[:, :at + T]
'''


def test_a_piece_wrong_only_at_decode_is_found_at_the_first_decoded_position(tiny, tmp_path):
    pieces = find_pieces(_folder(tmp_path, ex02_kv_cache_update=WRONG_DECODE_WRITE))
    reference, student = student_model(tiny.model, pieces)
    run = run_student(reference, student, pieces, [1, 5, 9, 2], max_tokens=3)
    assert not run.matches and (run.divergence.layer, run.divergence.position) == (0, 4)   # the prompt was fine
