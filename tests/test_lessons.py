"""Every lesson runs end to end (tiny sizes) and prints its table of measurements.

Lessons run on the real SmolLM2 weights when they are already pulled, else on random weights of
the same shape: the test never downloads anything.
"""
import pytest

from minillm.course import QUICK_ENV, default_lesson_model, find_lesson, list_lessons, run_lesson
from minillm.errors import MiniLLMError

LESSONS = list_lessons()
# What a lesson's own table must show, beyond its title (lessons without an entry: the title is enough).
EVIDENCE = {3: ["decode tok/s", "reference: "],
            5: ["MQA-1 (KV heads mean-pooled)", "perplexity", "median (min-max)", "load average"],
            6: ["max |naive - absorbed|", "convert_to_mla", "SmolLM2 GQA -> MLA"],
            7: ["max |rolling - full|", "users (rolling)", "H200-SXM"],
            8: ["error <= scale/2", "decode tok/s", "int8 -> fp32 widening", "reference: "],
            9: ["element 2j (low)", "int4 asymmetric", "bits/weight"],
            10: ["per token+head", "users int8", "Int8KVCache", "attention from the int8 codes"],
            16: ["paged, blocks of 16", "users in 4 GiB", "PagedKVCache.read", "outputs identical"],
            17: ["preempted", "recompute", "continuous, batch", "equal each request run alone: 5/5"],
            18: ["served from cache", "radix tree", "LRU eviction"],
            11: ["crosses the bus", "exercise 11's formula (course.transfer_bytes_reference)", "bytes: match",
                 "same top-1"],
            12: ["block of 256: strided + xor tree (v2)", "registers/thread", "v1 vs v2 vs the engine"],
            13: ["launches/token", "v4 + norm fused (default)", "what the CUDA graph saves"],
            14: ["roofline tok/s", "int4: magic-number codes vs unpack_int4", "% of issue rate", "GPU 2/2"],
            15: ["max |folded - original|", "one step late", "Prop. 3", "Prop. 3 on a Gemma-3 shape", "[GPU 1/5] the race", "[GPU 5/5] the whole decode step"],
            19: ["data: [DONE]", "Engine via HTTP", "client - server", "largest batch"],
            20: ["max |emitted - p|", "W-blocks @ xᵀ (engine)", "verify pass", "same tokens"],
            22: ["max |sparse - dense|", "busiest / balanced", "time / dense time", "DeepSeek-V3"],
            23: ["the value grids", "MXFP4 (E8M0 / 32)", "bits per weight vs perplexity", "NF4",
                 "GPT-OSS-120B (116.83 B parameters)", "MXFP4 experts, rest bf16"],
            24: ["max |tiled - attend|", "tiled 64×64", "score table", "prefill_attention.cu", "[GPU 1/1]"],
            25: ["cheapest first", "most tokens per GPU at the target", "largest batch that keeps the promise",
                 "load average"],
            26: ["handoff MB", "same tokens", "when disaggregation pays", "load average"],
            27: ["as a DFA: the tokens each state allows", "after the space"],   # steps 2-4 need SmolLM2's tokenizer
            28: ["what each control does", "min_p 0.1", "distinct / tokens", "is still the reported top-1",
                 "blocks copied", "4 choices, prompt shared"],
            29: ["keys added", "lines of model/", "without qk_norm", "without sandwich_norms", "5 windowed : 1 global"]}


def test_lessons_are_numbered_in_order():
    # Numbers are assigned, never reused (students' exNN files keep theirs): unique and increasing, 01..19
    # with no gap, later ones as they land.
    numbers = [l.number for l in LESSONS]
    assert numbers == sorted(set(numbers)) and numbers[:19] == list(range(1, 20))
    assert all(l.title.startswith(f"Lesson {l.number:02d}") for l in LESSONS)


def _lesson_module(number: int):
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"lesson_{number:02d}", find_lesson(number).path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("T,cached,q_tile,k_tile,window", [(1, 0, 32, 32, None), (5, 0, 4, 2, None),
                                                           (37, 0, 32, 32, None), (33, 20, 8, 16, None),
                                                           (70, 0, 16, 64, None), (64, 30, 32, 32, 24)])
def test_flash_attention_tiles_equal_minillm_attention(T, cached, q_tile, k_tile, window):
    import numpy as np
    from minillm.model.attention import attend
    flash = _lesson_module(24).flash_attention
    rng = np.random.default_rng(T)
    q = rng.standard_normal((T, 6, 32)).astype(np.float32)                 # 6 query heads, 2 KV heads
    k, v = ((rng.standard_normal((2, cached + T, 32)) * 2).astype(np.float32) for _ in range(2))
    got = flash(q, k, v, q_tile, k_tile, window)
    assert np.abs(got - attend(q, k, v, window)).max() < 1e-5


def test_flash_attention_traffic_count_matches_its_formula():
    import numpy as np
    lesson = _lesson_module(24)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((19, 8, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, 19, 16)).astype(np.float16) for _ in range(2))
    counted = {}
    lesson.flash_attention(q, k, v, 8, 4, traffic=counted)
    assert counted["k, v tiles"] == lesson.tiled_traffic(19, 8, 2, 16, 8, 4)["k, v tiles"]
    tiles = lesson.kernel_tiles()                                          # read from prefill_attention.cu
    assert set(tiles) == {"PF_ROWS", "PF_WARPS", "PF_KT"} and tiles["PF_ROWS"] % tiles["PF_WARPS"] == 0


@pytest.mark.parametrize("lesson", LESSONS, ids=[l.path.stem for l in LESSONS])
def test_lesson_runs_quickly_and_prints_its_table(lesson, capfd, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    code = run_lesson(lesson.number, quick=True, model=default_lesson_model())
    out, err = capfd.readouterr()
    assert code == 0, f"lesson {lesson.number:02d} failed:\n{out}\n{err}"
    assert f"Lesson {lesson.number:02d} — " in out        # the title of its table of measurements
    assert "-----" in out and "Traceback" not in err
    for words in EVIDENCE.get(lesson.number, []):
        assert words in out, f"lesson {lesson.number:02d} did not print {words!r}:\n{out}"


def test_unknown_lesson_is_a_clear_error():
    with pytest.raises(MiniLLMError, match="no lesson 99"):
        find_lesson(99)


def test_quick_flag_reaches_the_lesson(monkeypatch):
    from minillm import course
    monkeypatch.setenv(QUICK_ENV, "1")
    assert course.quick()
    monkeypatch.setenv(QUICK_ENV, "0")
    assert not course.quick()


def test_the_tests_plots_go_to_a_temporary_folder_not_lessons_out(capfd):
    """lessons/out/ is the student's folder: under the tests a lesson (a subprocess, inheriting the
    environment conftest sets) writes its plot to the temporary folder, and lessons/out/ is untouched."""
    import os
    from pathlib import Path
    from minillm.course import LESSONS_DIR, OUT_ENV, out_dir
    pytest.importorskip("matplotlib")
    student = LESSONS_DIR / "out" / "22_load_balance.png"
    before = student.stat().st_mtime_ns if student.exists() else None
    assert out_dir() == Path(os.environ[OUT_ENV]) and LESSONS_DIR not in out_dir().parents
    assert run_lesson(22, quick=True) == 0                   # the quickest lesson with a plot (3 s)
    assert f"plot: {out_dir() / '22_load_balance.png'}" in capfd.readouterr().out
    assert (out_dir() / "22_load_balance.png").exists()
    assert (student.stat().st_mtime_ns if student.exists() else None) == before


def test_arguments_after_the_lesson_number_reach_the_lesson(capfd):
    """`minillm lesson 21 --model-tables`: the modelled GPU tables print only when asked (issue 42), and asking
    through the CLI reaches the lesson's own argv."""
    from click.testing import CliRunner
    from minillm.cli import cli
    plain = CliRunner().invoke(cli, ["lesson", "21", "--quick"])
    without = capfd.readouterr().out
    asked = CliRunner().invoke(cli, ["lesson", "21", "--quick", "--model-tables"])
    with_tables = capfd.readouterr().out
    assert plain.exit_code == 0 and asked.exit_code == 0, (plain.output, asked.output)
    assert "minillm lesson 21 --model-tables" in without and "Llama-3-70B shape" not in without
    assert "Llama-3-70B shape" in with_tables and "minillm lesson 21 --model-tables" not in with_tables
