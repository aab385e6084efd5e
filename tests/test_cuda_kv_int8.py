"""The int8 KV cache on the GPU (kernels/kv_int8.cu, decode_attention.cu's attention_gqa*_int8): each
kernel against Int8KVCache / NumPy, then whole models GPU vs CPU with both sides quantizing K and V.
Skipped where there is no CuPy or no CUDA device (CI); run on the GPU machine."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_skip import DTYPES, cupy_with_a_device, ok

cp = cupy_with_a_device()

from minillm.cuda.dev.lab import as_lab  # noqa: E402
from minillm.cuda.dev.attention import check_attention_int8, check_kv_append_int8, check_kv_dequantize  # noqa: E402
from minillm.cuda.dev.model import (MODEL_TOL, check_graph_equals_eager, check_greedy,  # noqa: E402
                                    check_model_logits, small_config)
from minillm.cuda.gpu_kv_cache import GPUKVCache  # noqa: E402
from minillm.cuda.gpu_model import GPUTransformer  # noqa: E402



# ---- the kernels ------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,n_heads,n_kv,hd,capacity,pos0", [
    (1, 32, 8, 128, 300, 144),    # Mistral's decode step
    (7, 9, 3, 64, 40, 0),         # SmolLM2's heads, a prefill at position 0
    (3, 4, 1, 40, 10, 7),         # MQA, hd 40 (lanes past hd idle), the last three slots
    (2, 8, 8, 256, 5, 1),         # MHA, hd 256: 8 values a lane
])
def test_kv_append_int8_quantizes_like_the_cpu_cache(k, T, n_heads, n_kv, hd, capacity, pos0):
    ok(check_kv_append_int8(k, T, n_heads, n_kv, hd, capacity, pos0))


@pytest.mark.parametrize("T,n_heads,n_kv,hd,length,n_splits,window", [
    (1, 32, 8, 128, 144, 17, None),   # the benchmark's shape
    (1, 32, 8, 128, 64, 17, None),    # one tile: one split, no combine
    (1, 32, 8, 128, 5000, 17, 4096),  # long and windowed: every split, several tiles each
    (1, 9, 3, 64, 300, 8, None),      # SmolLM2: one block serves a group of 3
    (1, 8, 1, 32, 1000, 16, None),    # MQA: two blocks of 4 heads
    (1, 6, 2, 40, 150, 8, None),      # hd 40: 5 pieces on 8 lanes
    (1, 8, 8, 256, 90, 4, None),      # MHA hd 256
    (5, 8, 2, 64, 300, 3, 100),       # several queries (prefill through the decode kernel), window
    (1, 6, 2, 48, 150, 8, None),      # hd 48: 3 pieces of 16 codes on 4 lanes
])
@pytest.mark.parametrize("codes_per_lane", [16, 8])   # 16: attention_gqa*_int8x16 where hd % 16 == 0
def test_attention_over_int8_cache_matches_numpy(k, T, n_heads, n_kv, hd, length, n_splits, window, codes_per_lane):
    k = as_lab(k).with_settings(attention_int8_codes_per_lane=codes_per_lane)
    ok(check_attention_int8(k, T, n_heads, n_kv, hd, length, n_splits, window))


@pytest.mark.parametrize("n", [1, 37, 50])
def test_kv_dequantize_writes_the_first_positions(k, n):
    ok(check_kv_dequantize(k, 3, 64, 50, n))


# ---- the model ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["gqa", "mha", "mqa", "mistral", "hd64", "llama3", "hd192"])
def test_gpu_logits_with_int8_kv_match_cpu(kind, dtype):
    ok(check_model_logits(kind, dtype, kv_cache="int8"))


@pytest.mark.parametrize("quant,gemv_version", [(None, 2), (None, 4), ("int8", 4), ("int4", 4)])
def test_int8_kv_with_every_weight_format(quant, gemv_version):
    ok(check_model_logits("gqa", "float16", gemv_version=gemv_version, quant=quant, kv_cache="int8"))


@pytest.mark.parametrize("kind", ["gqa", "mistral"])
def test_greedy_with_int8_kv_matches_cpu(kind):
    same, detail = check_greedy(kind, "float16", n=16, kv_cache="int8")
    assert same, detail


def test_graph_replay_with_int8_kv_equals_eager():
    same, detail = check_graph_equals_eager("gqa", "float16", kv_cache="int8")
    assert same, detail


def test_int8_cache_holds_about_half_the_bytes():
    cfg = small_config("hd64")
    gpu = GPUTransformer.random(cfg, kv_cache="int8")
    cache = gpu.new_cache(100)
    sixteen = GPUTransformer.random(cfg).new_cache(100)
    assert isinstance(cache, GPUKVCache) and cache.int8 and cache.k.dtype == cp.int8
    # per vector: hd codes + a 4-byte scale, against 2 hd bytes (hd 64: 68 / 128)
    assert cache.nbytes / sixteen.nbytes == pytest.approx((64 + 4) / 128)


def test_load_on_cuda_with_int8_kv_generates_like_the_cpu(tmp_path):
    import minillm
    from hf_models import llama_config, save_random_model
    save_random_model(llama_config(), tmp_path)
    ids = np.random.default_rng(0).integers(0, 100, 30).tolist()
    cpu = minillm.load(str(tmp_path), dtype="float16", kv_cache="int8").logits(ids)
    gpu = minillm.load(str(tmp_path), device="cuda", kv_cache="int8").logits(ids)
    assert np.abs(gpu - cpu).max() <= MODEL_TOL["float16"] * np.abs(cpu).max()


def test_int8_kv_needs_a_head_dim_that_is_a_multiple_of_8():
    cfg = small_config("gqa", dim=96, n_heads=8, n_kv_heads=2)     # hd 12
    with pytest.raises(ValueError, match="head_dim % 8"):
        GPUTransformer.random(cfg, kv_cache="int8")


# ---- SmolLM2, real weights (MINILLM_TEST_SMOLLM2 on the GPU machine) ------------------------------------
# Rounding to int8 amplifies the GPU's fp16-sized differences in K and V: a value near a rounding boundary
# flips to the next code, a step of 1/127 of its vector's largest |value|. A CPU emulation (2026-11-29: K and
# V times 1 + 2^-11·noise before quantizing) moves SmolLM2's logits by 2.0e-2 of their largest value with the
# int8 cache, 2.6e-3 with the fp32 one; the int8 cache itself moves them by 4.2e-2 from the fp32 cache. The
# fp16 model bound (5e-3) failed on the H200 the same day; this bound is 1.5x the emulation, still below what
# int8 itself moves, and the greedy tokens must agree (a divergence only at a near-tie).
INT8_KV_MODEL_TOL = 3e-2


def test_smollm2_with_int8_kv_matches_cpu(smollm2_dir):
    import minillm
    cpu = minillm.load(str(smollm2_dir), dtype="float16", kv_cache="int8").model
    err, _ = check_model_logits("", "float16", n_prompt=24, n_decode=16, fuse_norm=True, cpu=cpu,
                                       kv_cache="int8")
    print(f"error {err:.3e} (tolerance {INT8_KV_MODEL_TOL:.1e})")
    assert err <= INT8_KV_MODEL_TOL, f"error {err:.3e} > tolerance {INT8_KV_MODEL_TOL:.1e}"
    prompt = [1, 504, 3458, 282, 253, 1351, 28, 665, 253, 2754, 282]     # ids of a short English prompt
    same, detail = check_greedy("", "float16", n=16, cpu=cpu, prompt=np.array(prompt), kv_cache="int8")
    assert same, detail
