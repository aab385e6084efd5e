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
