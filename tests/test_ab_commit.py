"""minillm/cuda/dev/ab_commit.py (this checkout against an earlier one on the GPU) on the CPU: its --cpu run
drives the same worker protocol and comparisons on a tiny CPU model, and it reads bench serve's own table."""
import importlib.util
from pathlib import Path

import numpy as np

from minillm.tools.serve_bench import Result, format_table

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ab_commit", ROOT / "minillm/cuda/dev/ab_commit.py")
ab_commit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab_commit)


def test_a_checkout_against_itself_is_bit_identical_and_timed_in_alternating_rounds(tmp_path, capsys):
    rc = ab_commit.main(["--cpu", "--base", str(ROOT), "--new", str(ROOT), "--out", str(tmp_path / "out"),
                         "--logits", str(tmp_path / "logits"), "--shapes", "mistral-7b", "--formats", "float16",
                         "--rounds", "3", "--new-tokens", "4", "--serve-runs", "0"])
    out = capsys.readouterr().out
    assert rc == 0 and "bit identity holds" in out
    for run in ("greedy ", "greedy_kv_int8", "prefill_512"):       # Mistral-7B fp16: also the int8 KV and TTFT runs
        assert any(run in line and "equal" in line for line in out.splitlines()), run
    assert "decode tok/s" in out and "TTFT 512 ms" in out
    logits = np.load(tmp_path / "logits" / "new" / "mistral-7b-float16" / "greedy.npy")
    assert logits.shape == (ab_commit.STEPS + 1, 512)              # the prompt's logits, then each greedy step's


def test_differing_logits_are_reported_with_where_they_part(tmp_path):
    for label, bump in (("base", 0.0), ("new", 1e-3)):
        d = tmp_path / label / "m"
        d.mkdir(parents=True)
        a = np.zeros((4, 8), np.float32)
        a[2, 5] += bump
        np.save(d / "greedy.npy", a)
    (row,) = ab_commit.compare_logits(tmp_path, "m")
    assert row[2] == "DIFFERENT" and "first differing row 2" in row[3]


def test_the_serve_ratio_comes_from_bench_serves_table():
    rows = [Result("random", mode, wall_s=1.0, output_tokens=tokens, ttft_s=[0.1], itl_s=[0.01], peak_kv_bytes=0)
            for mode, tokens in (("sequential", 200), ("continuous batching", 4600), ("+ prefix caching", 5000))]
    assert ab_commit.serve_ratio("load average ...\n" + format_table(rows)) == 23.0
    assert ab_commit.serve_ratio("Traceback (most recent call last): ...") is None
