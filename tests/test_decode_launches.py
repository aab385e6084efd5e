"""The GPU decode step's Python, run on the CPU: every launch GPUTransformer.decode_step would make, in order
(minillm.course.record_decode_launches: the kernels record instead of launching; no GPU needed). What the
kernels compute is checked on the GPU (tests/test_cuda*.py); this checks which of them a step calls."""
import pytest

from minillm.model.config import PRESETS
from minillm.course import record_decode_launches

MISTRAL, SMOLLM2 = PRESETS["mistral-7b"].config, PRESETS["smollm2-135m"].config


def per_layer(launches: list[str], n_layers: int) -> list[list[str]]:
    """The launches between the embedding and the LM head (with its own RMSNorm launch when the norm is
    not fused), cut into equal runs, one per layer."""
    assert launches[0] == "embed" and launches[-1].endswith("lm_head")
    head = 2 if launches[-2] == "rmsnorm" else 1
    body = launches[1:-head]
    assert len(body) % n_layers == 0, launches
    n = len(body) // n_layers
    return [body[i * n:(i + 1) * n] for i in range(n_layers)]


def test_the_16_bit_cache_step_is_five_launches_a_layer():
    layers = per_layer(record_decode_launches(MISTRAL), MISTRAL.n_layers)
    assert all(layer == layers[0] for layer in layers)
    assert layers[0] == ["gemv_rmsnorm_qkv_v4 qkv", "attention_gqa4", "gemv_v4 o",
                         "gemv_rmsnorm_swiglu_v4 gate_up", "gemv_v4 down"]


@pytest.mark.parametrize("config,group_kernel", [(MISTRAL, "attention_gqa4_int8x16"), (SMOLLM2, "attention_gqa4_int8x16")])
def test_the_int8_cache_quantizes_after_the_qkv_gemv_and_attends_over_codes(config, group_kernel):
    layers = per_layer(record_decode_launches(config, kv_cache="int8"), config.n_layers)
    assert all(layer == layers[0] for layer in layers)
    assert layers[0] == ["gemv_rmsnorm_qkv_v4 qkv", "kv_append_int8", group_kernel, "gemv_v4 o",
                         "gemv_rmsnorm_swiglu_v4 gate_up", "gemv_v4 down"]


def test_the_int8_cache_with_the_first_gemv_version():
    layers = per_layer(record_decode_launches(SMOLLM2, gemv_version=2, fuse_norm=False, kv_cache="int8"),
                       SMOLLM2.n_layers)
    assert "kv_append" not in layers[0] and layers[0].count("kv_append_int8") == 1
    assert layers[0].index("rope") < layers[0].index("kv_append_int8") < layers[0].index("attention_gqa4_int8x16")


@pytest.mark.parametrize("n_layers", [1, 8])
def test_an_early_exit_step_runs_the_first_layers_then_the_head(n_layers):
    """Speculative decoding's `layers:N` draft on the GPU: its own graph of the first N layers' launches,
    then the final norm and LM head, the same five launches a layer as the full step."""
    full = per_layer(record_decode_launches(SMOLLM2), SMOLLM2.n_layers)
    layers = per_layer(record_decode_launches(SMOLLM2, n_layers=n_layers), n_layers)
    assert layers == full[:n_layers]


def test_kernel_settings_reach_the_launches():
    """KernelSettings choose the kernel: attention v2 (a block per query head) instead of v3, and the int8
    cache's first kernel (8 codes a lane) instead of 16."""
    from minillm.cuda.kernels import KernelSettings
    v2 = per_layer(record_decode_launches(MISTRAL, settings=KernelSettings(attention_version=2)), MISTRAL.n_layers)
    assert v2[0][1] == "attention_fused"
    first_int8 = KernelSettings(attention_int8_codes_per_lane=8)
    eight = per_layer(record_decode_launches(MISTRAL, kv_cache="int8", settings=first_int8), MISTRAL.n_layers)
    assert eight[0][2] == "attention_gqa4_int8"


def test_a_settings_variant_leaves_the_original_as_it_was():
    """with_settings / with_options give a copy (the dev sweeps' variants); nothing shared is changed."""
    import dataclasses

    from minillm.cuda.gpu_model import GPUTransformer
    from minillm.cuda.kernels import Kernels, KernelSettings
    k = Kernels.__new__(Kernels)                       # no __init__: no CuPy needed for the plumbing
    k.settings, k.fn = KernelSettings(), {"gemv_v4": "loaded"}
    gpu = GPUTransformer.__new__(GPUTransformer)
    gpu.config, gpu.k, gpu.kv_cache, gpu.prefill_chunk, gpu.use_graph = MISTRAL, k, "auto", 1024, True
    gpu.quant, gpu.gemv_version, gpu.fuse_norm, gpu.prefill_attention = None, 4, True, "tiled"
    variant = gpu.with_settings(quant_flags=1, prefetch_next=True)
    assert (variant.settings.quant_flags, variant.settings.prefetch_next) == (1, True)
    assert gpu.settings == KernelSettings() and variant.k.fn is k.fn            # the loaded kernels are shared
    assert variant.settings != gpu.settings and hash(variant.settings)          # hashable: a graph key of its own
    with pytest.raises(dataclasses.FrozenInstanceError):
        gpu.settings.quant_flags = 1
    with pytest.raises(TypeError, match="no_such_knob"):
        gpu.with_settings(no_such_knob=1)
    other = gpu.with_options(kv_cache="int8", prefill_chunk=7)
    assert (other.kv_cache, other.prefill_chunk, gpu.kv_cache, gpu.prefill_chunk) == ("int8", 7, "auto", 1024)
    eager = gpu.with_options(use_graph=False)
    assert (eager.use_graph, gpu.use_graph, eager.kv_cache) == (False, True, "auto")
    with pytest.raises(ValueError, match="kv_cache is one of"):
        gpu.with_options(kv_cache="fp8")
    with pytest.raises(ValueError, match="prefill_chunk must be >= 1"):
        gpu.with_options(prefill_chunk=0)
    first = gpu.with_options(gemv_version=2, fuse_norm=False, prefill_attention="decode")    # the first kernels
    assert (first.gemv_version, first.fuse_norm, first.prefill_attention) == (2, False, "decode")
    assert (gpu.gemv_version, gpu.fuse_norm, gpu.prefill_attention, first.use_graph) == (4, True, "tiled", True)
    with pytest.raises(ValueError, match="prefill_attention is 'tiled' or 'decode'"):
        gpu.with_options(prefill_attention="flash")
    gpu.quant = "int8"
    with pytest.raises(ValueError, match="v4-shaped kernels only"):
        gpu.with_options(gemv_version=2)
    with pytest.raises(TypeError, match="unknown option"):
        gpu.with_options(gemv=2)
