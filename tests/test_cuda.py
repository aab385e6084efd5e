"""GPU kernels against their NumPy references, and the GPU model against the CPU model.

Skipped where there is no CuPy or no CUDA device. The checks themselves live in
minillm.cuda.dev (the selfcheck runs a subset of them before timing).
"""
from __future__ import annotations

import numpy as np
import pytest

from gpu_skip import DTYPES, cupy_with_a_device, ok

cp = cupy_with_a_device()

from minillm.cuda.dev.attention import check_attention, check_kv_append, check_prefill_attention  # noqa: E402
from minillm.cuda.dev.common import rel_err  # noqa: E402
from minillm.cuda.dev.elementwise import check_embed_cast, check_rmsnorm, check_rope, check_swiglu  # noqa: E402
from minillm.cuda.dev.gemv import check_gemv, check_gemv_qkv, check_gemv_rmsnorm, check_gemv_swiglu  # noqa: E402
from minillm.cuda.dev.lab import as_lab  # noqa: E402
from minillm.cuda.dev.model import (check_graph_equals_eager, check_greedy, check_model_logits,  # noqa: E402
                                    random_cpu_model, small_config)
from minillm.cuda.gpu_model import GPUTransformer  # noqa: E402
from minillm.cuda.kernels import Kernels  # noqa: E402



@pytest.mark.parametrize("T,dim", [(1, 64), (3, 576), (2, 4096), (5, 100)])
@pytest.mark.parametrize("to_narrow", [False, True])
def test_rmsnorm_matches_numpy(k, T, dim, to_narrow):
    ok(check_rmsnorm(k, T, dim, to_narrow))


@pytest.mark.parametrize("rows,n_in", [(1, 8), (13, 64), (100, 136), (4096, 1024), (257, 4096), (64, 14336)])
@pytest.mark.parametrize("version", [1, 2, 4])
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemv_matches_numpy(k, rows, n_in, version, accumulate):
    ok(check_gemv(k, rows, n_in, version, accumulate))


@pytest.mark.parametrize("rows,n_in", [(1, 8), (13, 64), (100, 576), (4096, 4096), (33, 12000)])
def test_gemv_with_fused_rmsnorm_matches_numpy(k, rows, n_in):
    ok(check_gemv_rmsnorm(k, rows, n_in))


@pytest.mark.parametrize("rows,n_in", [(1, 8), (13, 64), (100, 576), (4096, 4096), (33, 12000), (7, 14336)])
def test_gemv_v4_with_fused_rmsnorm_matches_numpy(k, rows, n_in):
    ok(check_gemv_rmsnorm(k, rows, n_in, version=4))


@pytest.mark.parametrize("ffn,n_in", [(1, 8), (7, 64), (300, 4096), (1000, 576)])
@pytest.mark.parametrize("norm", [False, True])
def test_gemv_v4_swiglu_matches_numpy(k, ffn, n_in, norm):
    ok(check_gemv_swiglu(k, ffn, n_in, norm))


@pytest.mark.parametrize("n_heads,n_kv,hd,n_in,pos0,capacity", [(32, 8, 128, 4096, 4000, 4100), (9, 3, 64, 576, 17, 40),
                                                                (4, 1, 256, 264, 0, 5), (4, 4, 16, 64, 39, 40),
                                                                (8, 2, 64, 128, 50, 50)])   # last: past the capacity
@pytest.mark.parametrize("norm", [False, True])
def test_gemv_v4_qkv_rope_kv_append_matches_numpy(k, n_heads, n_kv, hd, n_in, pos0, capacity, norm):
    ok(check_gemv_qkv(k, n_heads, n_kv, hd, n_in, pos0, capacity, norm))


def test_gemv_rejects_rows_whose_width_is_not_a_multiple_of_8(k):
    with pytest.raises(ValueError):
        k.gemv(cp.zeros((4, 12), cp.float16), cp.zeros(12, cp.float32), cp.zeros(4, cp.float32))


@pytest.mark.parametrize("T,n_heads,n_kv,hd,pos0", [(1, 8, 2, 64, 0), (1, 32, 8, 128, 4000), (7, 4, 4, 16, 3),
                                                   (3, 9, 3, 64, 100), (2, 2, 1, 256, 17)])
def test_rope_matches_numpy(k, T, n_heads, n_kv, hd, pos0):
    ok(check_rope(k, T, n_heads, n_kv, hd, pos0))


@pytest.mark.parametrize("T,n_heads,n_kv,hd,capacity,pos0", [(1, 8, 2, 64, 16, 0), (1, 8, 2, 64, 16, 15),
                                                              (5, 4, 1, 128, 40, 7), (3, 6, 6, 8, 9, 2)])
def test_kv_append_writes_only_the_new_positions(k, T, n_heads, n_kv, hd, capacity, pos0):
    ok(check_kv_append(k, T, n_heads, n_kv, hd, capacity, pos0))


@pytest.mark.parametrize("T,n_heads,n_kv,hd,length,n_splits,window", [
    (1, 8, 2, 64, 1, 1, None),           # the first token: one key
    (1, 8, 2, 64, 37, 1, None),
    (1, 8, 2, 64, 37, 4, None),          # flash-decoding splits
    (1, 8, 2, 64, 37, 64, None),         # more splits than keys: empty splits must add nothing
    (1, 32, 8, 128, 3000, 16, None),     # long context
    (1, 8, 1, 32, 200, 8, None),         # MQA
    (1, 4, 4, 256, 50, 3, None),         # MHA, the largest head_dim
    (1, 8, 2, 16, 100, 5, 6),            # sliding window
    (1, 8, 2, 64, 5000, 16, 4096),       # Mistral-sized window
    (6, 8, 2, 64, 6, 1, None),           # prefill from empty: causal within the chunk
    (9, 9, 3, 64, 40, 2, None),          # prefill after a cached prefix (SmolLM2 heads)
    (9, 8, 2, 16, 40, 2, 6),             # prefill with a window
])
@pytest.mark.parametrize("version", [1, 2, 3], ids=["v1 split+combine", "v2 fused", "v3 gqa"])
def test_attention_matches_numpy(k, T, n_heads, n_kv, hd, length, n_splits, window, version):
    k = attention_version(k, version)
    ok(check_attention(k, T, n_heads, n_kv, hd, length, n_splits, window, fused=version >= 2))


def attention_version(k: Kernels, version: int, split_keys: int = 0, one_wave: bool = True) -> Kernels:
    """k launching the fused-combine attention as the lab's LabSettings.attention_version = version (3: the
    shipped kernel; 2: its fallback everywhere), with v3's attention_split_keys and attention_one_wave."""
    return as_lab(k).with_settings(attention_version=version, attention_split_keys=split_keys,
                                   attention_one_wave=one_wave)


# v3 (attention_gqa*): a block per KV head serving up to 4 query heads, splits chosen at run time
@pytest.mark.parametrize("T,n_heads,n_kv,hd,length,n_splits,window,split_keys", [
    (1, 32, 8, 128, 144, 17, None, 0),   # the benchmark's shape: 3 of 17 splits used (64 keys each)
    (1, 32, 8, 128, 64, 17, None, 0),    # exactly one tile: one split, no combine
    (1, 32, 8, 128, 65, 17, None, 0),    # one key past the tile: two splits
    (1, 32, 8, 128, 640, 17, None, 0),   # 10 splits of 64
    (1, 32, 8, 128, 5000, 17, 4096, 0),  # long, windowed: all 17 splits, several tiles each
    (1, 12, 2, 128, 3000, 64, None, 0),  # group 6: two blocks per KV head (4 + 2 heads), 47 splits
    (1, 9, 3, 64, 300, 8, None, 0),      # group 3 (SmolLM2): one block serves 3 heads
    (1, 8, 1, 32, 1000, 16, None, 0),    # MQA, group 8: two blocks of 4
    (1, 4, 2, 96, 200, 8, None, 0),      # hd 96: 12 pieces on 16 lanes (4 idle)
    (1, 6, 2, 40, 150, 8, None, 0),      # hd 40: 5 pieces on 8 lanes
    (1, 8, 8, 256, 90, 4, None, 0),      # MHA hd 256: 32 lanes a key, 32-key tiles
    (1, 8, 2, 16, 2000, 8, 700, 0),      # hd 16: 2 lanes a key, 512-key tiles, window
    (1, 8, 2, 64, 9, 4, None, 1),        # split_keys 1: 4 splits of 3 keys, the last one empty
    (1, 8, 2, 64, 700, 64, None, 10),    # split_keys 10: all 64 splits (the combine's 2 splits a lane)
    (5, 8, 2, 64, 300, 3, 100, 0),       # several queries (prefill through the decode kernel), window
])
def test_attention_v3_matches_numpy(k, T, n_heads, n_kv, hd, length, n_splits, window, split_keys):
    ok(check_attention(attention_version(k, 3, split_keys), T, n_heads, n_kv, hd, length, n_splits, window, fused=True))


@pytest.mark.parametrize("length", [65, 2100])
def test_attention_v3_without_the_one_wave_cap_gives_the_same_result(k, length):
    """The grid not capped at one wave of blocks (17 splits on 8 KV heads: 136 blocks): the same attention."""
    ok(check_attention(attention_version(k, 3, 0, one_wave=False), 1, 32, 8, 128, length, 17, fused=True))


def test_attention_v3_falls_back_to_v2_when_head_dim_is_not_a_multiple_of_8(k):
    launched = []
    k.timer = lambda name, launch: (launched.append(name), launch())
    try:
        ok(check_attention(k, 1, 4, 2, 36, 50, 3, fused=True))
    finally:
        k.timer = None
    assert launched and set(launched) == {"attention_fused"}     # check_attention launches twice


def test_attention_v3_in_a_graph_follows_the_length():
    """One captured launch, replayed at lengths that need 1, 2, 10 and all 17 splits: the kernel picks
    the split count from pos at each replay, and leaves the counters at zero for the next."""
    from minillm.model.attention import attend
    k, rng = Kernels("float16"), np.random.default_rng(5)
    H, Hkv, hd, S, cap = 32, 8, 128, 17, 1200
    qkv = rng.standard_normal((1, (H + 2 * Hkv) * hd)).astype(np.float32)
    kc = rng.standard_normal((Hkv, cap, hd)).astype(np.float16)
    vc = rng.standard_normal((Hkv, cap, hd)).astype(np.float16)
    parts = (cp.zeros((1, H, S), cp.float32), cp.zeros((1, H, S), cp.float32), cp.zeros((1, H, S, hd), cp.float32),
             cp.zeros((1, H), cp.uint32))
    pos, out = cp.zeros(1, cp.int32), cp.zeros((1, H * hd), cp.float32)
    d_qkv, d_kc, d_vc = cp.asarray(qkv), cp.asarray(kc), cp.asarray(vc)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        k.attention(d_qkv, 1, H, Hkv, hd, d_kc, d_vc, pos, None, parts, out)
        graph = stream.end_capture()
        for length in (1, 100, 640, 1200, 64):
            pos.set(np.array([length - 1], np.int32))
            out.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            want = attend(qkv[:, :H * hd].reshape(1, H, hd), kc[:, :length].astype(np.float32),
                          vc[:, :length].astype(np.float32), None)
            assert rel_err(cp.asnumpy(out), want) <= 1e-4, length
            assert int(parts[3].max()) == 0


@pytest.mark.parametrize("T,n_heads,n_kv,hd,length,window", [
    (1, 8, 2, 64, 1, None),              # one token, one key
    (6, 8, 2, 64, 6, None),              # from empty: causal within the chunk
    (37, 8, 2, 64, 37, None),            # T not a multiple of the 32-row tile
    (9, 9, 3, 64, 40, None),             # cache offset 31, group 3 (rows of a tile straddle tokens)
    (45, 4, 4, 128, 100, None),          # MHA hd 128 after 55 cached
    (70, 32, 8, 128, 70, None),          # Mistral heads
    (33, 8, 1, 128, 50, None),           # MQA
    (50, 8, 1, 32, 200, 17),             # MQA hd 32, window
    (9, 8, 2, 16, 40, 6),                # hd 16 (padded to 32), window 6
    (100, 4, 2, 64, 300, 40),            # window shorter than the chunk, offset 200
    (40, 8, 2, 128, 140, 64),            # window across key tiles
    (5, 2, 1, 100, 9, None),             # hd 100 (padded to 128)
    (3, 12, 4, 128, 1000, None),         # few queries, long cache
    (130, 8, 8, 64, 130, None),          # several row tiles, MHA
    (512, 32, 8, 128, 512, 4096),        # the Mistral-7B TTFT shape
])
@pytest.mark.parametrize("version", [1, 2])   # 2: prefill_attention_mma.cu for hd 64 / 128, else 1
def test_prefill_attention_matches_numpy(k, T, n_heads, n_kv, hd, length, window, version):
    ok(check_prefill_attention(k, T, n_heads, n_kv, hd, length, window, version=version))


@pytest.mark.parametrize("hd", [132, 256])
def test_prefill_attention_rejects_large_heads(k, hd):
    assert not k.prefill_attention_supported(hd)
    with pytest.raises(ValueError):
        k.prefill_attention(cp.zeros((1, 3 * hd), cp.float32), 1, 1, 1, hd, cp.zeros((1, 4, hd), cp.float16),
                            cp.zeros((1, 4, hd), cp.float16), cp.zeros(1, cp.int32), None, cp.zeros((1, hd), cp.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_logits_match_cpu_where_prefill_falls_back_to_the_decode_kernel(dtype):
    """head_dim 192: the tiled prefill kernels stop at 128, so prefill runs the decode kernel a query per token."""
    ok(check_model_logits("hd192", dtype))


@pytest.mark.parametrize("T,ffn", [(1, 160), (4, 1536), (1, 14336)])
@pytest.mark.parametrize("to_narrow", [False, True])
def test_swiglu_matches_numpy(k, T, ffn, to_narrow):
    ok(check_swiglu(k, T, ffn, to_narrow))


def test_embed_and_cast_are_exact(k):
    ok(check_embed_cast(k, 300, 72))


# ---- the model ------------------------------------------------------------------------------------
KINDS = ["gqa", "mha", "mqa", "tied", "mistral", "hd64", "llama3"]


@pytest.mark.parametrize("fuse_norm", [False, True], ids=["norm", "fused-norm"])
@pytest.mark.parametrize("gemv_version", [2, 4], ids=["v2", "v4"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_logits_match_cpu(kind, dtype, gemv_version, fuse_norm):
    ok(check_model_logits(kind, dtype, fuse_norm=fuse_norm, gemv_version=gemv_version))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["gqa", "mistral", "tied"])
def test_greedy_continuation_matches_cpu(kind, dtype):
    same, detail = check_greedy(kind, dtype, n=16)
    assert same, detail


@pytest.mark.parametrize("fuse_norm", [False, True], ids=["norm", "fused-norm"])
@pytest.mark.parametrize("gemv_version", [2, 4], ids=["v2", "v4"])
@pytest.mark.parametrize("kind", ["gqa", "mistral"])
def test_graph_replay_equals_eager(kind, gemv_version, fuse_norm):
    same, detail = check_graph_equals_eager(kind, "float16", fuse_norm=fuse_norm, gemv_version=gemv_version)
    assert same, detail


def test_chunked_prefill_equals_one_pass():
    cpu = random_cpu_model(small_config("mistral"), "float16")
    gpu = GPUTransformer.from_cpu(cpu, "float16")
    ids = np.arange(3, 40)
    whole = gpu.prefill(ids, gpu.new_cache(64), all_logits=True)
    chunked = gpu.with_options(prefill_chunk=7).prefill(ids, gpu.new_cache(64), all_logits=True)
    assert rel_err(chunked, whole) < 5e-3     # cuBLAS may pick other algorithms per T


def test_generate_ids_runs_unchanged_on_the_gpu_model():
    from minillm.engine.generate import generate_ids
    from minillm.engine.sampling import SamplingParams
    cpu = random_cpu_model(small_config("gqa"), "float16")
    gpu = GPUTransformer.from_cpu(cpu, "float16")
    g = generate_ids(gpu, [1, 2, 3, 4], 10, SamplingParams(temperature=0.0))
    assert len(g.token_ids) == 10


def test_full_cache_is_refused():
    gpu = GPUTransformer.from_cpu(random_cpu_model(small_config("gqa"), "float16"), "float16")
    cache = gpu.new_cache(4)
    gpu.prefill([1, 2, 3, 4], cache)
    with pytest.raises(ValueError, match="full"):
        gpu.decode(5, cache)


# ---- SmolLM2, real weights (MINILLM_TEST_SMOLLM2 on the GPU machine, whose network is closed) -------------
SMOLLM2_PROMPT = [1, 504, 3458, 282, 253, 1351, 28, 665, 253, 2754, 282]     # ids of a short English prompt


@pytest.mark.parametrize("dtype", DTYPES)
def test_smollm2_logits_match_cpu(smollm2_dir, dtype):
    import minillm
    cpu = minillm.load(str(smollm2_dir), dtype=dtype).model
    ok(check_model_logits("", dtype, n_prompt=24, n_decode=16, fuse_norm=True, cpu=cpu))


def test_smollm2_greedy_16_tokens_match_cpu(smollm2_dir):
    import minillm
    cpu = minillm.load(str(smollm2_dir), dtype="float16").model
    same, detail = check_greedy("", "float16", n=16, cpu=cpu, prompt=np.array(SMOLLM2_PROMPT))
    assert same, detail
