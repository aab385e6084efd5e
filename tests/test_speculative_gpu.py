"""Speculative decoding with the GPU model as the target (issue 23, item 3): the same loop as on the CPU
(engine/speculative), its verify pass through GPUTransformer.prefill (cuBLAS, every row's logits), the
`int4` draft as the GPU model's int4 copy and `layers:N` as its first N layers in their own decode graph,
rollback by the device caches' truncate. Greedy decoding gives the plain GPU tokens, or parts from them
only at a near-tie: the verify GEMMs read activations rounded to 16 bits where a decode GEMV keeps fp32."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_skip import cupy_with_a_device

cp = cupy_with_a_device()

import greedy_checks  # noqa: E402
import minillm  # noqa: E402
from hf_models import llama_config, save_random_model  # noqa: E402
from minillm.engine.generate import generate_ids  # noqa: E402
from minillm.engine.sampling import SamplingParams  # noqa: E402
from minillm.engine.speculative import generate_speculative  # noqa: E402
from minillm.errors import MiniLLMError  # noqa: E402
from minillm.tools.spec_bench import bench_speculative, copy_heavy_prompts, format_table  # noqa: E402

NEAR_TIE = 1e-2     # of the largest logit: fp16 verify rows vs an fp32-activation GEMV (test_cuda: 5e-3)


@pytest.fixture(scope="module", params=["auto", "int8"])
def gpu_llm(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("spec-gpu")
    save_random_model(llama_config(n_heads=8, n_kv_heads=2, eos_token_id=None), path)
    return minillm.load(str(path), device="cuda", kv_cache=request.param)


def _prompt(n=12, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 320, n)] * 2


def assert_greedy_equal(model, prompt, plain, spec):
    greedy_checks.assert_greedy_equal(model, prompt, plain, spec, NEAR_TIE, relative=True)


@pytest.mark.parametrize("spec", ["ngram", "int4", "layers:1"])
def test_greedy_speculation_on_the_gpu_gives_the_plain_tokens(gpu_llm, spec):
    model, prompt, params = gpu_llm.model, _prompt(), SamplingParams()
    plain = generate_ids(model, prompt, 30, params).token_ids
    drafter = gpu_llm.drafter(spec)
    for k in (1, 4):
        g = generate_speculative(model, drafter, prompt, 30, params, k)
        assert len(g.token_ids) == 30
        assert_greedy_equal(model, prompt, plain, g.token_ids)
        assert 1.0 <= g.speculative.mean_accepted_length <= k + 1


def test_a_verify_pass_rolled_back_leaves_the_cache_as_a_plain_prefill_does(gpu_llm):
    """The drafts' positions written by a verify pass, then truncated: zeros again, and the prompt's
    positions untouched (codes and scales too, for the int8 cache)."""
    model, prompt = gpu_llm.model, _prompt()
    plain, spec = model.new_cache(64), model.new_cache(64)
    model.prefill(prompt, plain)
    model.prefill(prompt, spec)
    model.prefill([5, 6, 7, 8], spec, all_logits=True)
    spec.truncate(len(prompt))
    assert spec.length == plain.length == len(prompt)
    for name in ("k", "v", "k_scale", "v_scale"):
        if hasattr(plain, name):
            assert cp.array_equal(getattr(spec, name), getattr(plain, name)), name


def test_a_verify_pass_replays_as_a_graph_with_the_eager_numbers(gpu_llm):
    """A few rows with every row's logits (the verify pass) replay a captured forward + head (cuBLAS inside
    the graph): the same launches as the eager prefill path, so the same numbers, bit for bit."""
    model, prompt, rows = gpu_llm.model, _prompt(), [5, 6, 7, 8, 9]
    eager = model.with_options(use_graph=False)       # the same weights and kernels, launched one by one
    graphed, plain = model.new_cache(64), model.new_cache(64)
    model.prefill(prompt, graphed)
    model.prefill(prompt, plain)
    for _ in range(2):                                # the second replays the graph the first captured
        got = model.prefill(rows, graphed, all_logits=True)
        want = eager.prefill(rows, plain, all_logits=True)
        assert np.array_equal(got, want) and graphed.length == plain.length
    if model.kv_cache == "int8":                      # its prefill widens length + T positions: eager only
        assert graphed.rows_graphs == {}
    else:
        assert model.rows_graph_error is None and len(rows) in graphed.rows_graphs


def test_the_int4_draft_shares_the_targets_embedding_and_head(gpu_llm):
    draft = gpu_llm.drafter("int4").model
    target = gpu_llm.model
    assert draft.quant == "int4" and draft.embed is target.embed and draft.lm_head is target.lm_head


def test_the_int4_draft_of_a_quantized_target_is_refused(tmp_path):
    save_random_model(llama_config(n_heads=8, n_kv_heads=2, eos_token_id=None), tmp_path)
    llm = minillm.load(str(tmp_path), device="cuda", quant="int8")
    with pytest.raises(MiniLLMError, match="already int8"):
        llm.drafter("int4")


# ---- SmolLM2, real weights (MINILLM_TEST_SMOLLM2 on the GPU machine: the whole model, two pieces) ------

def test_smollm2_on_the_gpu_speculates_the_plain_tokens(smollm2_dir):
    """The copy-heavy prompts (minillm bench --speculative), greedy: every drafter's tokens are the
    plain GPU tokens (or part at a near-tie); prints the table bench prints."""
    llm = minillm.load(str(smollm2_dir), device="cuda")
    prompts = copy_heavy_prompts()[:3]
    for spec in ("ngram", "int4", "layers:20"):
        rows = bench_speculative(llm, spec, max_tokens=32, prompts=prompts)
        print(format_table(rows, spec))
        for row, p in zip(rows, prompts):
            if not row.same:
                g = llm.generate(p.get("messages") or p["text"], max_tokens=32)
                s = llm.generate(p.get("messages") or p["text"], max_tokens=32, speculative=spec)
                ids = llm.prompt_ids(p.get("messages") or p["text"])
                assert_greedy_equal(llm.model, ids, g.token_ids, s.token_ids)
