"""EXERCISES: every exercise by id ('07'; '17.2' for lesson 17's second one), with the function a student
writes, its lesson, the engine's reference, its cases and its check."""
from __future__ import annotations

from typing import Callable

from minillm.course.cases import Exercise, ExerciseRegistry
from minillm.course.ex_attention import (_check_mask, _check_mla, _check_pool, _mask_cases, _mask_hidden, _mla_cases,
                                         _pool_cases)
from minillm.course.ex_basics import (_check_kv, _check_rmsnorm, _check_rope, _check_top_p, _kv_cases, _rmsnorm_cases,
                        _rope_cases, _top_p_cases, kv_cache_update_reference)
from minillm.course.ex_deploy import (_check_handoff, _check_target, _handoff_cases, _target_cases,
                                     batch_for_target_reference, install_handoff_reference)
from minillm.course.ex_architectures import _check_qk_norm, _qk_cases, qk_norm_reference
from minillm.course.ex_flash import _check_merge, _merge_cases, merge_partials_reference
from minillm.course.ex_constrained import _check_mask as _check_dfa_mask, _mask_cases as _dfa_mask_cases
from minillm.course.ex_constrained import dfa_token_mask_reference
from minillm.course.ex_controls import _check_penalty, _penalty_cases, repetition_penalty_reference
from minillm.course.ex_flashnorm import _check_fold, _fold_cases, fold_rmsnorm_reference
from minillm.course.ex_speculative import _check_spec, _spec_cases, speculative_step_reference
from minillm.course.ex_preemption import _check_schedule, _schedule_cases, schedule_step_reference
from minillm.course.ex_flashnorm_streams import _check_streams, _streams_cases, deferred_plan_reference
from minillm.course.ex_radix import _check_radix, _radix_cases, radix_insert_reference
from minillm.course.ex_kernel import _check_kernel, _kernel_cases, rmsnorm_kernel_reference
from minillm.course.ex_speculative_loop import _check_loop, _loop_cases, speculative_decode_step_reference
from minillm.course.ex_cache_attention import (_cache_attention_cases, _check_cache_attention,
                                               attend_over_cache_reference)
from minillm.course.ex_formats import _block_cases, _check_block, encode_mxfp4_block_reference
from minillm.course.ex_moe import _check_route, _route_cases, top_k_route_reference
from minillm.course.ex_parallel import _check_tp, _tp_cases, tp_partials_reference
from minillm.course.ex_gpu import (_block_sum_cases, _check_block_sum, _check_launches, _check_transfer, _launch_cases,
                                   _launch_hidden, _transfer_cases, _transfer_hidden, block_sum_reference,
                                   decode_launches_reference, transfer_bytes_reference)
from minillm.course.ex_quant import (_check_int4, _check_int4_words, _check_int8, _check_kv_int8, _int4_cases, _int4_word_cases,
                       _int8_cases, _kv_int8_cases, dequantize_int4_words_reference, quantize_int4_reference,
                       quantize_int8_reference, quantize_kv_int8_reference)
from minillm.course.ex_serving import (_check_gather, _check_pack, _check_prefix, _check_sse, _gather_cases, _pack_cases,
                         _prefix_cases, _sse_cases, _sse_hidden, cached_prefix_reference, gather_reference,
                         pack_reference, stream_text_reference)


def _reference(name: str) -> Callable:
    def ref(*args, **kwargs):
        from minillm.model import attention
        from minillm.checkpoints import kv_heads
        from minillm.model import layers
        from minillm.model import mla
        from minillm.engine import sampling
        return {"rmsnorm": layers.rmsnorm, "apply_rope": layers.apply_rope,
                "top_p_filter": sampling.top_p_filter, "pool_heads": kv_heads.pool_heads,
                "absorbed_attention": mla.absorbed_attention,
                "attention_mask": attention.attention_mask}[name](*args, **kwargs)
    ref.__qualname__ = f"minillm reference {name}"
    return ref


EXERCISES: ExerciseRegistry = ExerciseRegistry([
    Exercise(1, "rmsnorm", 1, _reference("rmsnorm"), _rmsnorm_cases, _check_rmsnorm),
    Exercise(2, "kv_cache_update", 2, kv_cache_update_reference, _kv_cases, _check_kv, draws_in_check=True),
    Exercise(2, "attend_over_cache", 2, attend_over_cache_reference, _cache_attention_cases,
             _check_cache_attention, part=2),
    Exercise(3, "apply_rope", 3, _reference("apply_rope"), _rope_cases, _check_rope, draws_in_check=True),
    Exercise(4, "top_p_filter", 4, _reference("top_p_filter"), _top_p_cases, _check_top_p),
    Exercise(5, "mean_pool_kv_heads", 5, _reference("pool_heads"), _pool_cases, _check_pool, draws_in_check=True),
    Exercise(6, "absorbed_attention", 6, _reference("absorbed_attention"), _mla_cases, _check_mla, draws_in_check=True),
    Exercise(7, "sliding_window_mask", 7, _reference("attention_mask"), _mask_cases, _check_mask,
             hidden=_mask_hidden),
    Exercise(8, "quantize_int8_per_row", 8, quantize_int8_reference, _int8_cases, _check_int8),
    Exercise(9, "quantize_int4_groupwise", 9, quantize_int4_reference, _int4_cases, _check_int4),
    Exercise(10, "quantize_kv_int8", 10, quantize_kv_int8_reference, _kv_int8_cases, _check_kv_int8),
    Exercise(11, "transfer_bytes", 11, transfer_bytes_reference, _transfer_cases, _check_transfer,
             hidden=_transfer_hidden),
    Exercise(12, "block_sum", 12, block_sum_reference, _block_sum_cases, _check_block_sum),
    Exercise(12, "rmsnorm_kernel", 12, rmsnorm_kernel_reference, _kernel_cases, _check_kernel, part=2,
             needs_gpu=True),
    Exercise(13, "decode_launches", 13, decode_launches_reference, _launch_cases, _check_launches,
             hidden=_launch_hidden),
    Exercise(14, "dequantize_int4_words", 14, dequantize_int4_words_reference, _int4_word_cases, _check_int4_words),
    Exercise(15, "fold_rmsnorm_into_linear", 15, fold_rmsnorm_reference, _fold_cases, _check_fold),
    Exercise(15, "deferred_plan", 15, deferred_plan_reference, _streams_cases, _check_streams, part=2),
    Exercise(16, "gather_through_block_table", 16, gather_reference, _gather_cases, _check_gather,
             draws_in_check=True),
    Exercise(17, "pack_batch", 17, pack_reference, _pack_cases, _check_pack),
    Exercise(17, "schedule_step", 17, schedule_step_reference, _schedule_cases, _check_schedule, part=2),
    Exercise(18, "cached_prefix_tokens", 18, cached_prefix_reference, _prefix_cases, _check_prefix),
    Exercise(18, "radix_insert", 18, radix_insert_reference, _radix_cases, _check_radix, part=2),
    Exercise(19, "stream_text", 19, stream_text_reference, _sse_cases, _check_sse, hidden=_sse_hidden),
    Exercise(20, "speculative_step", 20, speculative_step_reference, _spec_cases, _check_spec),
    Exercise(20, "speculative_decode_step", 20, speculative_decode_step_reference, _loop_cases, _check_loop,
             part=2),
    Exercise(21, "tp_partials", 21, tp_partials_reference, _tp_cases, _check_tp, draws_in_check=True),
    Exercise(22, "top_k_route", 22, top_k_route_reference, _route_cases, _check_route),
    Exercise(23, "encode_mxfp4_block", 23, encode_mxfp4_block_reference, _block_cases, _check_block),
    Exercise(24, "merge_softmax_partials", 24, merge_partials_reference, _merge_cases, _check_merge),
    Exercise(25, "batch_for_target", 25, batch_for_target_reference, _target_cases, _check_target),
    Exercise(26, "install_handoff", 26, install_handoff_reference, _handoff_cases, _check_handoff),
    Exercise(27, "dfa_token_mask", 27, dfa_token_mask_reference, _dfa_mask_cases, _check_dfa_mask),
    Exercise(28, "repetition_penalty", 28, repetition_penalty_reference, _penalty_cases, _check_penalty),
    Exercise(29, "qk_norm", 29, qk_norm_reference, _qk_cases, _check_qk_norm),
])
