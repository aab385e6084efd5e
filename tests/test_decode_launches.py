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


def test_the_fallback_kernels_take_the_head_dims_the_winners_cannot():
    """Decode attention v3 needs head_dim % 8 == 0 (else v2, attention_fused), its 16-codes-a-lane int8 kernel
    head_dim % 16 == 0 (else 8 codes a lane)."""
    from minillm.model.config import ModelConfig
    hd36 = ModelConfig(vocab_size=512, dim=144, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
    hd40 = ModelConfig(vocab_size=512, dim=160, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
    assert per_layer(record_decode_launches(hd36), 2)[0][1] == "attention_fused"
    assert per_layer(record_decode_launches(hd40), 2)[0][1] == "attention_gqa2"
    assert per_layer(record_decode_launches(hd40, kv_cache="int8"), 2)[0][2] == "attention_gqa2_int8"


def test_the_labs_settings_reach_the_launches():
    """minillm/cuda/dev/lab.py's LabSettings launch the fallbacks everywhere: attention v2 (a block per query
    head) instead of v3, the int8 cache's first kernel (8 codes a lane) instead of 16."""
    from minillm.cuda.dev.lab import lab_settings
    v2 = per_layer(record_decode_launches(MISTRAL, settings=lab_settings(attention_version=2)), MISTRAL.n_layers)
    assert v2[0][1] == "attention_fused"
    first_int8 = lab_settings(attention_int8_codes_per_lane=8)
    eight = per_layer(record_decode_launches(MISTRAL, kv_cache="int8", settings=first_int8), MISTRAL.n_layers)
    assert eight[0][2] == "attention_gqa4_int8"
    same = per_layer(record_decode_launches(MISTRAL, settings=lab_settings()), MISTRAL.n_layers)
    assert same == per_layer(record_decode_launches(MISTRAL), MISTRAL.n_layers)    # the lab's defaults: shipped


def test_a_settings_variant_leaves_the_original_as_it_was():
    """with_settings / with_options give a copy (the dev sweeps' variants); nothing shared is changed."""
    import dataclasses

    from minillm.cuda.gpu_model import GPUTransformer
    from minillm.cuda.kernels import Kernels, KernelSettings
    k = Kernels.__new__(Kernels)                       # no __init__: no CuPy needed for the plumbing
    k.settings, k.fn = KernelSettings(), {"gemv_v4": "loaded"}
    gpu = GPUTransformer.__new__(GPUTransformer)
    gpu.config, gpu.k, gpu.kv_cache, gpu.prefill_chunk, gpu.use_graph = MISTRAL, k, "auto", 1024, True
    gpu.quant = None
    variant = gpu.with_settings(quant_blocks_per_sm=1, pdl=False)
    assert (variant.settings.quant_blocks_per_sm, variant.settings.pdl) == (1, False)
    assert gpu.settings == KernelSettings() and variant.k.fn is k.fn            # the loaded kernels are shared
    assert variant.settings != gpu.settings and hash(variant.settings)          # hashable: a graph key of its own
    with pytest.raises(dataclasses.FrozenInstanceError):
        gpu.settings.pdl = False
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
    with pytest.raises(TypeError, match="unknown option"):
        gpu.with_options(prefill_attention="decode")   # one prefill attention ships (its fallback is by head size)
    with pytest.raises(TypeError, match="unknown option"):
        gpu.with_options(gemv_version=2)            # the earlier decode steps are the lab's (below), not a switch
    from minillm.cuda.dev.lab import LabTransformer
    lab = LabTransformer.__new__(LabTransformer)    # LabTransformer.of without its kernels' compile
    lab.__dict__.update(gpu.__dict__)
    lab._set_ladder(4, True)
    first = lab.with_options(gemv_version=2, fuse_norm=False)                     # the first kernels
    assert (first.gemv_version, first.fuse_norm) == (2, False)
    assert (lab.gemv_version, lab.fuse_norm, first.use_graph) == (4, True, True)
    lab.quant = "int8"
    with pytest.raises(ValueError, match="v4-shaped kernels only"):
        lab.with_options(gemv_version=2)
