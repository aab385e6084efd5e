"""The helpers of the lessons with GPU parts (11-15): run each part under its heading or list it as
skipped without a GPU, and record a decode step's kernel launches on the CPU (lesson and exercise 13)."""
from __future__ import annotations

import sys
from typing import Callable, Sequence

import numpy as np

from minillm.resources import install_hint


def why_no_gpu() -> str | None:
    """None when CuPy can use a CUDA device; else one line saying why a lesson's GPU parts are skipped."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - any import failure means the same thing here
        return f"CuPy is not importable ({type(e).__name__}); {install_hint('gpu')} on a GPU machine"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver, no device: the message says which
        return f"CuPy {cupy.__version__} finds no usable CUDA device ({str(e).splitlines()[0]})"
    return None if n > 0 else f"CuPy {cupy.__version__} sees no CUDA device"


def gpu_description() -> str:
    """One line naming the GPU, for the top of a lesson's GPU measurements."""
    import cupy as cp
    from minillm.cuda.timing import device_name
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    return (f"{device_name()} (sm_{props['major']}{props['minor']}, {props['multiProcessorCount']} SMs, "
            f"{props['totalGlobalMem'] / 2**30:.0f} GiB), CuPy {cp.__version__}")


def run_gpu_parts(parts: Sequence[tuple[str, Callable[[], None]]]) -> list[str]:
    """Run a lesson's GPU parts in order, each under a numbered heading, or list them as skipped.

    A part that raises prints its traceback and the next part still runs, so one run on a GPU machine
    shows every failure next to the part it belongs to.   -> the names of the parts that failed"""
    import traceback
    why = why_no_gpu()
    if why is not None:
        print(f"\nGPU parts skipped: {why}. On a machine with a GPU this lesson also measures:")
        for i, (name, _) in enumerate(parts, 1):
            print(f"  [GPU {i}/{len(parts)}] {name}: skipped (no GPU)")
        return []
    print(f"\nGPU: {gpu_description()}")
    failed = []
    for i, (name, part) in enumerate(parts, 1):
        print(f"\n[GPU {i}/{len(parts)}] {name}", flush=True)
        try:
            part()
        except Exception:  # noqa: BLE001 - report it under its heading and go on
            traceback.print_exc(file=sys.stdout)
            print(f"[GPU {i}/{len(parts)}] {name}: FAILED (traceback above)", flush=True)
            failed.append(name)
    return failed


# ---- a decode step's kernel launches, recorded on the CPU (lesson 13, exercise 13) ---------------------

def record_decode_launches(config, gemv_version: int = 4, fuse_norm: bool = True,
                           capacity: int = 256, kv_cache: str = "auto", settings=None,
                           n_layers: int | None = None) -> list[str]:
    """The kernel launches of one GPUTransformer decode step, in order ("embed", "gemv_v4 o", ...),
    recorded on the CPU by `recording_decode_step` (n_layers: an early-exit step, as a draft runs it)."""
    step, launches = recording_decode_step(config, gemv_version, fuse_norm, capacity, kv_cache, settings, n_layers)
    step()
    return launches


def recording_decode_step(config, gemv_version: int = 4, fuse_norm: bool = True, capacity: int = 256,
                          kv_cache: str = "auto", settings=None,
                          n_layers: int | None = None) -> tuple[Callable[[], None], list[str]]:
    """(step, launches): step() runs the engine's own `GPUTransformer.decode_step` on the CPU (or, for
    gemv_version 2 or fuse_norm off, the earlier steps kept in minillm/cuda/dev/lab.py) and appends the name
    of each kernel it would launch to `launches`. settings: a kernels.KernelSettings (default: the engine's).

    Its `Kernels` records each launch through the `timer` hook (the one the selfcheck times kernels
    with) instead of running it, and every array is a shape-only NumPy view (np.broadcast_to: no
    memory). No GPU, no CuPy: everything the engine's Python does per launch runs, the launch does not."""
    m, cache, launches = recording_model(config, gemv_version, fuse_norm, capacity, kv_cache, settings=settings)
    return (lambda: m.decode_step(cache, n_layers)), launches


def shaped(*shape, dtype=np.float32) -> np.ndarray:
    """A shape-only stand-in for a device array (np.broadcast_to of one zero: no memory)."""
    return np.broadcast_to(np.zeros((), dtype), shape)


def recording_model(config, gemv_version: int = 4, fuse_norm: bool = True, capacity: int = 256,
                    kv_cache: str = "auto", cls=None, record=None, settings=None) -> tuple[object, object, list[str]]:
    """(model, cache, launches) behind `recording_decode_step`: a `cls` (GPUTransformer or a subclass; the
    lab's LabTransformer for an earlier decode step) made without __init__, its arrays shape-only, its Kernels
    recording into `launches` through `record(name)` (default: launches.append). A subclass sets what its own
    __init__ would on top. The recorded device is a Hopper one (arch 90: PDL on)."""
    from collections import defaultdict

    from minillm.cuda.dev.lab import LabKernels, LabTransformer, lab_settings
    from minillm.cuda.gpu_kv_cache import GPUKVCache
    from minillm.cuda.gpu_model import GPULayer, GPUTransformer
    from minillm.cuda.kernels import Kernels, KernelSettings, n_splits_for

    launches: list[str] = []
    record = record or launches.append
    from minillm.cuda.dev.lab import LabSettings
    ladder = gemv_version < 4 or not fuse_norm or isinstance(settings, LabSettings)   # the lab's step or settings
    kind = LabKernels if ladder else Kernels
    k = kind.__new__(kind)                             # no __init__: nothing to compile, no CuPy
    k.dtype, k.fn, k.settings = "float16", defaultdict(lambda: None), settings or KernelSettings()
    if ladder:
        k.settings = lab_settings(k.settings)
    k._nil_f32 = k._nil_u16 = k._nil_i32 = None
    k.arch, k.n_sms = 90, 132                          # an H100's
    k.timer = lambda name, launch: record(name)                    # record; never call launch()
    c, hd, w16 = config, config.head_dim, np.float16
    cls = cls or (LabTransformer if ladder else GPUTransformer)
    m = cls.__new__(cls)
    m.config, m.k, m.dtype, m.use_graph, m.quant = c, k, "float16", False, None     # 16-bit weights
    m.gemv_version, m.fuse_norm, m.kv_cache = gemv_version, fuse_norm, kv_cache
    m.q_width, m.qkv_width = c.n_heads * hd, (c.n_heads + 2 * c.n_kv_heads) * hd
    m.layers = [GPULayer(shaped(c.dim), shaped(m.qkv_width, c.dim, dtype=w16), shaped(c.dim, m.q_width, dtype=w16),
                         shaped(c.dim), shaped(2 * c.ffn_dim, c.dim, dtype=w16), shaped(c.dim, c.ffn_dim, dtype=w16))
                for _ in range(c.n_layers)]
    m.embed = shaped(c.vocab_size, c.dim, dtype=w16)
    m.lm_head = m.embed if c.tie_embeddings else shaped(c.vocab_size, c.dim, dtype=w16)
    m.final_norm, m.inv_freq = shaped(c.dim), shaped(hd // 2)
    m.step = shaped(2, dtype=np.int32)
    m.step_tokens, m.step_pos = m.step[0:1], m.step[1:2]
    m.x, m.h, m.qkv, m.attn = shaped(1, c.dim), shaped(1, c.dim), shaped(1, m.qkv_width), shaped(1, m.q_width)
    m.gu, m.act, m.logits = shaped(1, 2 * c.ffn_dim), shaped(1, c.ffn_dim), shaped(c.vocab_size)
    s = n_splits_for(c.n_heads, capacity)
    parts = (shaped(1, c.n_heads, s), shaped(1, c.n_heads, s), shaped(1, c.n_heads, s, hd),
             shaped(1, c.n_heads, dtype=np.uint32))
    m._decode_parts = lambda cache: parts              # the engine's allocates on the device
    if kv_cache == "int8":                             # codes, and a scale per (layer, KV head, position)
        cache = GPUKVCache.__new__(GPUKVCache)
        cache.int8 = True
        cache.k = cache.v = shaped(c.n_layers, c.n_kv_heads, capacity, hd, dtype=np.int8)
        cache.k_scale = cache.v_scale = shaped(c.n_layers, c.n_kv_heads, capacity)
    else:
        cache = GPUKVCache.__new__(GPUKVCache)
        cache.int8 = False
        cache.k = cache.v = shaped(c.n_layers, c.n_kv_heads, capacity, hd, dtype=w16)
    cache.max_seq_len, cache.length = capacity, 0
    return m, cache, launches
