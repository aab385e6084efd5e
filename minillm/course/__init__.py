"""The course: the numbered lessons, what they share, and the exercise grader.

Lessons live in `lessons/NN_name.py` and exercises in `lessons/exercises/exNN_name.py` of a source
checkout; a student works on a copy of the exercises (`minillm exercise handout DIR`). Every exercise's
reference solution is the engine's own code (`minillm.model.layers.rmsnorm`,
`minillm.model.kv_cache.KVCache.append`, ...), so a student who passes has written what the engine runs.

    lessons.py       finding and running lessons; what every lesson shares (its model, tables, plots, ABOUT)
    measure.py       timing honestly on a busy machine: load, interleaved rounds, spread, reference, verdict
    gpu_parts.py     the lessons' GPU parts (run, or skipped without a GPU); a decode step's launches
    cases.py         Case, Exercise, CaseFailed and the expect_* checks the exercises are written in
    ex_basics.py     exercises 01-04: RMSNorm, the KV cache write, RoPE, top-p
    ex_attention.py  exercises 05-07: pooled KV heads, MLA in latent space, the sliding-window mask
    ex_quant.py      exercises 08-10, 14: int8 rows, int4 groups, int8 KV vectors, int4 as 32-bit words
    ex_gpu.py        exercises 11-13: bytes over the bus, a block's fp32 sum, launches per token
    ex_flashnorm.py  exercise 15: the RMSNorm gain folded into the next projection
    ex_serving.py    exercises 16-19: the block table, the packed batch, the prefix cache, SSE streams
    ex_parallel.py   exercise 21: one rank's shard of a block and its partial outputs (tensor parallelism)
    ex_deploy.py     exercises 25-26: the batch for a latency target, installing a KV handoff
    ex_flash.py      exercise 24: merging two online-softmax partials (FlashAttention, split-K decode)
    ex_architectures.py  exercise 29: QK-norm, each head's query and key normed on its own (Qwen3, Gemma 3)
    registry.py      EXERCISES: every exercise by id ('07'; '17.2' for a lesson's second exercise)
    grader.py        check_exercise: find a student's file (their handout folder) and grade it, case by case
    behaviour.py     replay: a student's policy decides as data, the grader replays it on engine objects
    ex_preemption.py, ex_radix.py, ex_speculative_loop.py, ex_flashnorm_streams.py   behaviour exercises
                     17.2, 18.2, 20.2, 15.2; ex_cache_attention.py 02.2; ex_kernel.py 12.2 (a GPU kernel)
    student.py       student mode: the engine on a student's pieces (`generate --student DIR`), compared
    classroom.py     a teacher's tools: the exercise list, the handout (stubs and a README), the solutions
    grading.py       grading a class: each exercise in a confined process, hidden cases, CSV, feedback
    remote.py        the grader's side of a student's process: calls over a data-only channel
    sandbox.py       the student's process: loads their file, answers calls (.npy + JSON, never pickle)
    confine.py       Landlock + seccomp: what the student's process may read, write and call
    reports.py       Markdown and HTML reports, class statistics, Gradescope's results.json

Everything a lesson, a test or the CLI uses is importable from `minillm.course` itself.
"""
from minillm.course.cases import Case, CaseFailed, Exercise, expect_close, expect_unchanged
from minillm.course.ex_basics import kv_cache_update_reference
from minillm.course.ex_constrained import dfa_token_mask_reference, digits_unit_dfa, token_table
from minillm.course.ex_controls import repetition_penalty_reference
from minillm.course.ex_architectures import qk_norm_reference
from minillm.course.ex_flash import merge_partials_reference
from minillm.course.ex_flashnorm import fold_rmsnorm_reference
from minillm.course.ex_parallel import tp_partials_reference
from minillm.course.ex_gpu import (_warps_reduced, _xor_shuffle_sum, block_sum_reference, decode_launches_reference,
                     transfer_bytes_reference)
from minillm.course.ex_quant import (dequantize_int4_words_reference, quantize_int4_reference, quantize_int8_reference,
                       quantize_kv_int8_reference)
from minillm.course.ex_serving import cached_prefix_reference, gather_reference, pack_reference, stream_text_reference
from minillm.course.gpu_parts import gpu_description, record_decode_launches, recording_decode_step, run_gpu_parts, why_no_gpu
from minillm.course.grader import (CaseResult, Report, check_exercise, exercise_path, load_exercise, student_file,
                                   student_folder)
from minillm.course.lessons import (DEFAULT_LESSON_MODEL, EXERCISES_DIR, LESSONS_DIR, MODEL_ENV, OUT_ENV, QUICK_ENV, Lesson,
                      StandInTokenizer, best_time, default_lesson_model, find_lesson, hf_tensors, lesson_model,
                      list_lessons, out_dir, print_table, quick, run_lesson, save_plot)
from minillm.course.registry import EXERCISES

__all__ = [
    # lessons
    "DEFAULT_LESSON_MODEL", "EXERCISES_DIR", "LESSONS_DIR", "MODEL_ENV", "OUT_ENV", "QUICK_ENV", "Lesson",
    "StandInTokenizer", "best_time", "default_lesson_model", "find_lesson", "hf_tensors", "lesson_model",
    "list_lessons", "out_dir", "print_table", "quick", "run_lesson", "save_plot",
    # GPU parts
    "gpu_description", "record_decode_launches", "recording_decode_step", "run_gpu_parts", "why_no_gpu",
    # exercises and the grader
    "Case", "CaseFailed", "CaseResult", "EXERCISES", "Exercise", "Report", "check_exercise", "exercise_path",
    "expect_close", "expect_unchanged", "load_exercise", "student_file", "student_folder",
    # the engine's references (the lessons measure with some of them)
    "block_sum_reference", "cached_prefix_reference", "decode_launches_reference", "dfa_token_mask_reference",
    "digits_unit_dfa", "token_table",
    "dequantize_int4_words_reference", "fold_rmsnorm_reference", "gather_reference", "merge_partials_reference", "qk_norm_reference",
    "kv_cache_update_reference", "pack_reference", "repetition_penalty_reference", "quantize_int4_reference", "quantize_int8_reference",
    "quantize_kv_int8_reference", "stream_text_reference", "tp_partials_reference", "transfer_bytes_reference",
    # private, but tests/test_exercises.py checks the block-sum emulation's steps directly
    "_warps_reduced", "_xor_shuffle_sum",
]
