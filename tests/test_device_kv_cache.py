"""The int8 and fp8 KV caches on the device (issue 44): device_model's Transformer keeps them in its own array module
and quantizes there, to the CPU's codes and scales. CuPy has no fp8 dtype, so E4M3 codes are found on the grid
(formats.nearest_e4m3), held here bit for bit to ml_dtypes' cast. The conversion runs with NumPy as the array module
everywhere; the last test runs it on CuPy (skipped without a CUDA device)."""
import numpy as np
import pytest

import minillm
from minillm import llm
from minillm.cuda import available as gpu_available
from minillm.cuda import device_model, gpu_model
from minillm.cuda.device_model import to_device
from minillm.cuda.selfcheck import MODEL_TOL, random_cpu_model, small_config
from minillm.model import formats
from minillm.model.formats import float_dtype, nearest_e4m3, value_table
from minillm.model.kv_cache import Fp8KVCache, Int8KVCache, kv_cache_format
from minillm.model.transformer import Transformer
from test_device_model import logits_error

CACHES = {"int8": (Int8KVCache, np.int8), "fp8": (Fp8KVCache, np.uint8)}


def edge_values() -> np.ndarray:
    """Every E4M3 value, every halfway point between neighbours and the floats either side of it, the overflow
    boundary, infinities, NaNs of both signs, fp32 subnormals, and random values over 22 binades."""
    grid = value_table("e4m3")[:127]                                     # 0 .. 448, ascending
    halfway = (grid[1:] + grid[:-1]) / 2
    near = [np.nextafter(halfway, np.float32(np.inf)), np.nextafter(halfway, np.float32(0))]
    special = [0.0, 448.0, 463.99997, 464.0, 464.00003, 479.0, 480.0, 1e30, np.inf, np.nan, 1e-45, 2.0 ** -10,
               3 * 2.0 ** -11, 2.0 ** -6]
    rng = np.random.default_rng(0)
    random = rng.standard_normal(20000) * np.exp2(rng.uniform(-12, 10, 20000))
    positive = np.concatenate([grid, halfway, *near, special]).astype(np.float32)
    return np.concatenate([positive, -positive, random.astype(np.float32)])


def ml_dtypes_codes(x: np.ndarray) -> np.ndarray:
    return x.astype(float_dtype("e4m3")).view(np.uint8)


def test_the_fp8_encoder_without_ml_dtypes_gives_its_codes_bit_for_bit():
    x = edge_values()
    assert np.array_equal(nearest_e4m3(x), ml_dtypes_codes(x))
    # the cases spelled out: -0 keeps its sign, a tie goes to the even code (464 to 448), above 464 is NaN
    x = np.array([-0.0, 2.0 ** -10, 3 * 2.0 ** -11, 464.0, 464.00003, -np.inf, np.nan], np.float32)
    assert nearest_e4m3(x).tolist() == [0x80, 0x00, 0x01, 0x7E, 0x7F, 0xFF, 0x7F]
    # and over a stride through every fp32 bit pattern
    every = np.arange(0, 2 ** 32, 7919, dtype=np.uint64).astype(np.uint32).view(np.float32)
    assert np.array_equal(nearest_e4m3(every), ml_dtypes_codes(every))


@pytest.mark.parametrize("kv_cache", sorted(CACHES))
def test_on_numpy_device_model_keeps_the_quantized_cache_and_gives_the_cpu_logits(kv_cache):
    """to_device of a model with an int8 or fp8 KV cache (refused before): its cache is the CPU's kind, made in the
    model's array module, holds the CPU engine's very codes and scales, and its logits are the CPU's."""
    cpu = random_cpu_model(small_config("gqa")).with_options(kv_cache=kv_cache)
    gpu = to_device(cpu, xp=np)
    cache_type, codes = CACHES[kv_cache]
    c = cpu.config
    gc, cc = gpu.new_cache(24), cpu.new_cache(24)
    assert type(gc) is cache_type
    assert gc.k.dtype == gc.v.dtype == codes and gc.k.shape == (c.n_layers, c.n_kv_heads, 24, c.head_dim)
    assert gc.k_scale.dtype == np.float32 and gc.k_scale.shape == (c.n_layers, c.n_kv_heads, 24)
    ids = np.random.default_rng(3).integers(0, c.vocab_size, 12)
    gpu.prefill(ids[:9], gc), cpu.prefill(ids[:9], cc)
    for t in ids[9:]:
        gpu.decode(int(t), gc), cpu.decode(int(t), cc)
    for name in ("k", "v", "k_scale", "v_scale"):
        assert np.array_equal(getattr(gc, name), getattr(cc, name)), name
    assert logits_error(gpu, cpu) <= MODEL_TOL["float16"]


def test_a_quantized_cache_is_made_in_the_array_module_of_the_model_weights(monkeypatch):
    """new_cache makes an int8 or fp8 cache with the module its weights live in (CuPy on the device), as it makes
    KVCache: a NumPy stand-in that marks the arrays it makes shows every stored array comes from it."""
    from minillm.model import transformer
    class Marked(np.ndarray):
        pass

    class Module:                                    # numpy, with every new array marked
        def __getattr__(self, name):
            return getattr(np, name)

        def zeros(self, shape, dtype):
            return np.zeros(shape, dtype).view(Marked)

    model = random_cpu_model(small_config("gqa"))
    monkeypatch.setattr(transformer, "array_module", lambda *arrays: Module())   # where new_cache asks
    for kv_cache, (cache_type, _) in CACHES.items():
        cache = model.with_options(kv_cache=kv_cache).new_cache(8)
        assert type(cache) is cache_type
        assert all(isinstance(getattr(cache, n), Marked) for n in ("k", "v", "k_scale", "v_scale"))


def test_fp8_and_int8_kv_caches_are_accepted_on_cuda_and_the_fp8_one_leaves_the_kernels():
    assert kv_cache_format("fp8", "cuda") == "fp8" and kv_cache_format("int8", "cuda") == "int8"
    model = random_cpu_model(small_config("gqa"))
    assert gpu_model.unsupported(model) is None and llm.gpu_path(model) == "GPUTransformer"
    assert llm.gpu_path(model.with_options(kv_cache="int8")) == "GPUTransformer"      # kernels/kv_int8.cu
    fp8 = model.with_options(kv_cache="fp8")
    assert "fp8" in gpu_model.unsupported(fp8) and llm.gpu_path(fp8) == "device_model"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from hf_models import llama_config, save_random_model
    path = tmp_path_factory.mktemp("llama")
    save_random_model(llama_config(), path)
    return path


def test_load_on_cuda_with_an_fp8_kv_cache_runs_device_model(llama, monkeypatch):
    """load(device="cuda", kv_cache="fp8") of a Llama, with the device swapped for NumPy: not GPUTransformer (it has
    no fp8 cache) but the engine's Transformer with its Fp8KVCache, giving the CPU engine's logits."""
    monkeypatch.setattr(llm, "check_device", lambda device: None)
    monkeypatch.setattr(device_model, "_cupy", lambda: np)
    cpu = minillm.load(str(llama), dtype="float16", kv_cache="fp8").model
    on_cuda = minillm.load(str(llama), device="cuda", kv_cache="fp8").model
    assert isinstance(on_cuda, Transformer) and on_cuda.kv_cache == "fp8" and on_cuda.dtype == "float16"
    assert type(on_cuda.new_cache(8)) is Fp8KVCache
    assert logits_error(on_cuda, cpu) <= MODEL_TOL["float16"]


needs_gpu = pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA device")


@needs_gpu
@pytest.mark.parametrize("kv_cache", sorted(CACHES))
def test_on_the_gpu_the_quantized_cache_stays_on_the_device_with_the_cpu_codes(kv_cache, llama):
    import cupy
    x = edge_values()
    assert np.array_equal(formats.encode_e4m3(cupy.asarray(x)).get(), ml_dtypes_codes(x))
    cpu = random_cpu_model(small_config("gqa")).with_options(kv_cache=kv_cache)
    gpu = to_device(cpu)
    gc, cc = gpu.new_cache(24), cpu.new_cache(24)
    assert all(isinstance(getattr(gc, n), cupy.ndarray) for n in ("k", "v", "k_scale", "v_scale"))
    assert gc.k.dtype == CACHES[kv_cache][1]
    ids = np.random.default_rng(3).integers(0, cpu.config.vocab_size, 12)
    gpu.prefill(ids[:9], gc), cpu.prefill(ids[:9], cc)
    for t in ids[9:]:
        gpu.decode(int(t), gc), cpu.decode(int(t), cc)
    # K and V come out of cuBLAS sums in another order: a code flips only where a value sits on a rounding boundary
    for name in ("k", "v"):
        assert np.mean(getattr(gc, name)[:, :, :12].get() == getattr(cc, name)[:, :, :12]) > 0.99, name
        assert np.allclose(getattr(gc, name + "_scale").get(), getattr(cc, name + "_scale"), rtol=1e-3), name
    assert logits_error(gpu, cpu) <= MODEL_TOL["float16"]
    loaded = minillm.load(str(llama), device="cuda", kv_cache="fp8").model
    assert isinstance(loaded, Transformer) and isinstance(loaded.new_cache(8).k, cupy.ndarray)
