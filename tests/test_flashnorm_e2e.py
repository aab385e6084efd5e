"""FlashNorm at every norm site of the GPU decode step, checked without a GPU: the NumPy twin of the step
(flashnorm.reference_decode, the kernels' order of operations) equals Transformer(flashnorm=True), and the
step's Python launches what it should, in order (the CPU launch recorder of tests/test_decode_launches.py).
The kernels themselves compile in tests/test_kernels_compile.py; on a GPU, tests/test_flashnorm_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest

from hf_models import llama_config, mistral_config, save_random_model
from minillm.checkpoints.weights import load_hf_dir
from minillm.course.gpu_parts import record_decode_launches, recording_model, shaped
from minillm.cuda.dev import flashnorm as fn_dev
from minillm.cuda.dev.flashnorm import FlashNormDecodeTransformer, FlashNormKernels, TwoStreamNorm, reference_decode
from minillm.model.config import PRESETS
from minillm.model.flashnorm import fold_checkpoint
from minillm.model.transformer import Transformer

MISTRAL, SMOLLM2 = PRESETS["mistral-7b"].config, PRESETS["smollm2-135m"].config


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module", params=["llama-tied", "mistral-window"])
def folded(request, tmp_path_factory):
    """(original Transformer, Transformer(flashnorm=True) on the folded, untied weights)."""
    path = tmp_path_factory.mktemp(request.param)
    hf_config = llama_config(tied=True) if request.param == "llama-tied" else mistral_config(sliding_window=6)
    save_random_model(hf_config, path, seed=26)
    config, tensors = load_hf_dir(path)
    original = Transformer(config, tensors)
    config, tensors, _ = fold_checkpoint(config, tensors, untie=True)
    return original, Transformer(config, tensors, flashnorm=True)


@pytest.mark.parametrize("mode", fn_dev.MODES)
def test_numpy_twin_of_the_gpu_step_is_the_flashnorm_transformer(folded, mode):
    """RoPE before the scale, the up path's scale after down (fused) or before SwiGLU (deferred): the same
    logits as Transformer(flashnorm=True), step by step past the sliding window, and as the original model."""
    original, fn = folded
    ids = np.random.default_rng(1).integers(0, fn.config.vocab_size, 14).tolist()
    twin_cache, fn_cache, orig_cache = (m.new_cache(len(ids)) for m in (fn, fn, original))
    fn.prefill(ids[:4], twin_cache)
    fn.prefill(ids[:4], fn_cache)
    original.prefill(ids[:4], orig_cache)
    for t in ids[4:]:
        got = reference_decode(fn, t, twin_cache, mode)
        assert rel(got, fn.decode(t, fn_cache)) <= 1e-5
        assert rel(got, original.decode(t, orig_cache)) <= 1e-4
    assert twin_cache.length == fn_cache.length == len(ids)


def test_numpy_twin_refuses_an_unknown_mode(folded):
    with pytest.raises(ValueError, match="mode is one of"):
        reference_decode(folded[1], 0, folded[1].new_cache(4), "eager")


# ---- the launches, recorded on the CPU -----------------------------------------------------------------

class MarkedBranches(TwoStreamNorm):
    """The real fork_join on one stream (no CuPy needed), with "fork" and "join" marked among the launches."""
    parallel = False

    def __init__(self, fk, launches):          # no streams or events: nothing runs
        self.fk, self.launches, self.delay_ns = fk, launches, 0

    def fork_join(self, project, x, inv_rms, eps):
        self.launches.append("fork")
        super().fork_join(project, x, inv_rms, eps)
        self.launches.append("join")


def recorded(config, mode: str) -> list[str]:
    """The launches of one FlashNormDecodeTransformer decode step (fork/join marked), recorded on the CPU."""
    m, cache, launches = recording_model(config, cls=FlashNormDecodeTransformer)
    fk = FlashNormKernels.__new__(FlashNormKernels)         # no __init__: nothing to compile
    fk.fn, fk._nil = {}, None
    fk.timer = lambda name, launch: launches.append(name)
    m.mode, m.fk, m.two, m.site_inv_rms = mode, fk, MarkedBranches(fk, launches), shaped(1)
    m.decode_step(cache)
    return launches


def layers_of(launches: list[str], n_layers: int, head: int) -> list[list[str]]:
    assert launches[0] == "embed"
    body = launches[1:-head]
    assert len(body) % n_layers == 0, launches
    n = len(body) // n_layers
    return [body[i * n:(i + 1) * n] for i in range(n_layers)]


@pytest.mark.parametrize("config", [MISTRAL, SMOLLM2], ids=["mistral-7b", "smollm2-135m"])
def test_fused_step_is_as_many_launches_as_production(config):
    launches = recorded(config, "fused")
    assert launches[-1] == "flashnorm_gemv lm_head"
    layers = layers_of(launches, config.n_layers, 1)
    assert all(layer == layers[0] for layer in layers)
    assert layers[0] == ["flashnorm_gemv_qkv qkv", "attention_gqa4", "gemv_v4 o", "flashnorm_gemv_swiglu gate_up",
                         "gemv_scaled down"]
    assert len(launches) == len(record_decode_launches(config)) == 5 * config.n_layers + 2


@pytest.mark.parametrize("config", [MISTRAL, SMOLLM2], ids=["mistral-7b", "smollm2-135m"])
def test_deferred_step_forks_the_projection_and_the_norm_then_scales(config):
    launches = recorded(config, "deferred")
    head = ["fork", "gemv_v4 lm_head", "flashnorm_inv_rms", "join", "flashnorm_scale_rows"]
    assert launches[-5:] == head
    layers = layers_of(launches, config.n_layers, 5)
    assert all(layer == layers[0] for layer in layers)
    # q|k|v rotated but not appended (k_cache None): the cache gets k and v after the scale
    assert layers[0] == ["fork", "gemv_qkv_v4 qkv", "flashnorm_inv_rms", "join", "flashnorm_scale_rows", "kv_append",
                         "attention_gqa4", "gemv_v4 o",
                         "fork", "gemv_v4 gate_up", "flashnorm_inv_rms", "join", "flashnorm_scale_rows", "swiglu",
                         "gemv_v4 down"]
    kernels = [name for name in launches if name not in ("fork", "join")]
    assert len(kernels) == 11 * config.n_layers + 4


def test_e2e_cli_refuses_bad_arguments_in_one_line(capsys):
    assert fn_dev.main(["--e2e", "--presets", "smollm2-135m,nope"]) == 2
    assert fn_dev.main(["--e2e", "--tokens", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["minillm.cuda.dev.flashnorm: unknown preset(s) nope",
                   "minillm.cuda.dev.flashnorm: --tokens and --repeats must be at least 1"]
