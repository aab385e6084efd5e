"""Speculative decoding: greedy equality with plain decoding for every drafter, the exactness of the
acceptance rule (enumeration and a seeded chi-square test), and rollback in every cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import greedy_checks
import minillm
from hf_models import llama_config, mistral_config, save_random_model
from minillm.engine.generate import generate_ids
from minillm.engine.paged_kv import BlockManager, BlockTableCache, PagedKVCache
from minillm.engine.sampling import SamplingParams, next_token_distribution
from minillm.engine.speculative import (ModelDrafter, NgramDrafter, accept_draft, acceptance_probability,
                                        early_exit_drafter, generate_speculative, int4_drafter, residual_distribution)
from minillm.errors import MiniLLMError
from minillm.llm import LLM
from minillm.model.kv_cache import Int8KVCache, KVCache
from minillm.tools.spec_bench import copy_heavy_prompts

WINDOW = 6          # Mistral's window, shorter than every text below
NEAR_TIE = 1e-3     # the allowance: a verify over k rows rounds unlike a one-row decode


def deepseek_config():
    from transformers import DeepseekV3Config
    from hf_models import SMALL
    return DeepseekV3Config(**(SMALL | dict(
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=SMALL["num_hidden_layers"], rms_norm_eps=1e-5,
        initializer_range=0.1, eos_token_id=None)))


MODELS = {"llama": lambda: llama_config(n_heads=8, n_kv_heads=2, eos_token_id=None),
          "mistral": lambda: mistral_config(sliding_window=WINDOW, eos_token_id=None),
          "mla": deepseek_config}


@pytest.fixture(scope="module", params=sorted(MODELS))
def llm(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_random_model(MODELS[request.param](), path)
    return minillm.load(str(path))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-draft-target")
    save_random_model(MODELS["llama"](), path)
    return minillm.load(str(path))


def _prompt(n=12, seed=0):
    """A prompt that repeats itself, so prompt lookup has something to find."""
    return [int(t) for t in np.random.default_rng(seed).integers(0, 320, n)] * 2


def assert_greedy_equal(model, prompt, plain, spec):
    """spec == plain, or they part at a near-tie of the plain run (top-2 logit gap < NEAR_TIE)."""
    greedy_checks.assert_greedy_equal(model, prompt, plain, spec, NEAR_TIE)


def _drafters(model, kind):
    drafters = [NgramDrafter(), early_exit_drafter(model, 1), ModelDrafter(model, name="self")]
    if kind != "mla":
        drafters.append(int4_drafter(model))
    return drafters


def test_greedy_speculation_gives_the_plain_tokens_for_every_drafter(llm):
    model, prompt, params = llm.model, _prompt(), SamplingParams()
    plain = generate_ids(model, prompt, 30, params).token_ids
    kind = llm.config.attention if llm.config.sliding_window is None else "mistral"
    for drafter in _drafters(model, kind):
        for k in (1, 4):
            g = generate_speculative(model, drafter, prompt, 30, params, k)
            assert_greedy_equal(model, prompt, plain, g.token_ids)
            assert len(g.token_ids) == 30
            stats = g.speculative
            assert stats.target_forwards < 30 or stats.accepted_tokens == 0      # fewer passes when drafts land
            assert 0.0 <= g.acceptance_rate <= 1.0 and 1.0 <= g.mean_accepted_length <= k + 1


def test_a_draft_model_with_the_same_ids_drafts_perfectly_and_saves_passes(llama):
    """The target as its own draft model accepts everything: k + 1 tokens a pass."""
    g = generate_speculative(llama.model, llama.drafter(llama), _prompt(), 21, SamplingParams(), 4)
    assert g.acceptance_rate == 1.0 and g.speculative.target_forwards == 4   # 1 + 4 passes × 5 tokens


def test_stops_inside_an_accepted_run_end_where_plain_decoding_ends(llama):
    model, prompt, params = llama.model, _prompt(), SamplingParams()
    plain = generate_ids(model, prompt, 30, params).token_ids
    eos = plain[9]                                   # pretend the 10th token is EOS
    stop_at = plain.index(eos)
    for k in (2, 5):
        g = generate_speculative(model, ModelDrafter(model), prompt, 30, params, k, stop_ids={eos})
        assert g.token_ids == plain[:stop_at] and g.finish_reason == "stop"
        g = generate_speculative(model, ModelDrafter(model), prompt, 7, params, k)
        assert g.token_ids == plain[:7] and g.finish_reason == "length"


def test_sampling_is_reproducible_with_a_seed(llama):
    params = SamplingParams(temperature=0.8, top_k=50, seed=3)
    runs = [generate_speculative(llama.model, d, _prompt(), 20, params, 3).token_ids
            for d in (ModelDrafter(llama.model), ModelDrafter(llama.model), NgramDrafter())]
    assert runs[0] == runs[1] and len(runs[2]) == 20


# ---- the acceptance rule is exact --------------------------------------------------------------------

def _emitted_first_two(p, q, d_max=2):
    """P(x1, x2) of the first two tokens speculation emits, by enumerating every draft and every branch of
    the rule (the code's acceptance_probability and residual_distribution). p(ctx), q(ctx): [V] for the
    token after context ctx (a tuple). Two drafts a pass; a pass that stops at one token is followed by
    one whose first token is enumerated the same way."""
    V = len(p(()))
    out = np.zeros((V, V))

    def first_token(ctx):                            # the first emitted token of a pass after ctx
        dist = np.zeros(V)
        for d in range(V):
            a = acceptance_probability(p(ctx), q(ctx), d)
            dist[d] += q(ctx)[d] * a
            dist += q(ctx)[d] * (1 - a) * residual_distribution(p(ctx), q(ctx), d)
        return dist

    for d1 in range(V):
        a1 = acceptance_probability(p(()), q(()), d1)
        rejected = q(())[d1] * (1 - a1) * residual_distribution(p(()), q(()), d1)
        for x1 in range(V):                          # rejected: x1 from the residual, x2 from the next pass
            out[x1] += rejected[x1] * first_token((x1,))
        for d2 in range(V):                          # accepted: x1 = d1, then d2 judged by p(.|d1)
            w = q(())[d1] * a1 * q((d1,))[d2]
            a2 = acceptance_probability(p((d1,)), q((d1,)), d2)
            out[d1, d2] += w * a2
            out[d1] += w * (1 - a2) * residual_distribution(p((d1,)), q((d1,)), d2)
    return out


def _bigram(seed, V=5):
    table = np.random.default_rng(seed).dirichlet(np.ones(V) * 0.7, size=V + 1)   # row V: the empty context
    return lambda ctx: table[ctx[-1] if ctx else V]


def test_two_emitted_tokens_follow_the_target_exactly_by_enumeration():
    p, q = _bigram(1), _bigram(2)
    exact = np.array([[p(())[a] * p((a,))[b] for b in range(5)] for a in range(5)])
    np.testing.assert_allclose(_emitted_first_two(p, q), exact, atol=1e-12)
    # a deterministic drafter (q one-hot: ngram, greedy drafts) is exact too
    one_hot = lambda ctx: np.eye(5)[(ctx[-1] + 1) % 5 if ctx else 0]
    np.testing.assert_allclose(_emitted_first_two(p, one_hot), exact, atol=1e-12)


def chi_square_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's goodness-of-fit p-value: the chi-square(k - 1) tail beyond the statistic."""
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = len(observed) - 1
    # the chi-square(k) survival function at x is the regularized upper incomplete gamma Q(k/2, x/2)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def test_accept_draft_samples_the_target_distribution_chi_square():
    """20,000 seeded runs of accept_draft with sampled drafts (temperature and top-k applied to p and q):
    the first two emitted tokens' frequencies match p(x1) p(x2 | x1); a wrong rule (accept always, or no
    residual) fails this at p < 1e-10, so the bound p > 1e-4 leaves room only for chance."""
    V, params = 6, SamplingParams(temperature=0.9, top_k=4, seed=0)
    rng = np.random.default_rng(0)
    target, draft = rng.normal(size=(V + 1, V)) * 1.5, rng.normal(size=(V + 1, V)) * 1.5   # bigram logits
    logits = lambda table, ctx: table[ctx[-1] if ctx else V]
    p = lambda ctx: next_token_distribution(logits(target, ctx), params)
    q_table = np.stack([next_token_distribution(row, params) for row in draft])     # [V + 1, V]
    q_cdf = np.cumsum(q_table, axis=1)
    counts = np.zeros((V, V))
    sampler = np.random.default_rng(params.seed)
    for _ in range(20_000):
        ctx: tuple = ()
        while len(ctx) < 2:
            drafts, qs = [], []
            for _ in range(2):
                last = (ctx + tuple(drafts))[-1] if ctx or drafts else V
                drafts.append(min(int(np.searchsorted(q_cdf[last], sampler.random(), side="right")), V - 1))
                qs.append(q_table[last])                             # the draft token ~ q by inverse CDF
            rows = np.stack([logits(target, ctx + tuple(drafts[:i])) for i in range(3)])
            ctx += tuple(accept_draft(drafts, np.stack(qs), rows, params, sampler))
        counts[ctx[0], ctx[1]] += 1
    exact = np.array([[p(())[a] * p((a,))[b] for b in range(V)] for a in range(V)]).ravel()
    seen = exact > 0
    assert counts.ravel()[~seen].sum() == 0                          # top-k: filtered tokens never appear
    assert chi_square_pvalue(counts.ravel()[seen], exact[seen] * 20_000) > 1e-4


def test_greedy_acceptance_is_the_argmax_comparison():
    rows = np.array([[0, 5, 1], [3, 0, 0], [0, 0, 9.0]])           # argmax: 1, 0, 2
    assert accept_draft([1, 0], None, rows, SamplingParams(), None) == [1, 0, 2]      # all + bonus
    assert accept_draft([1, 2], None, rows, SamplingParams(), None) == [1, 0]         # corrected at 2
    assert accept_draft([], None, rows[:1], SamplingParams(), None) == [1]            # no draft: a decode


# ---- rollback: the cache equals a plain run's ---------------------------------------------------------

def _rolled_back_and_plain(model, make_cache):
    """Two caches at the same position: one ran [pending + 4 drafts] and was truncated past the drafts,
    the other ran the pending token alone."""
    prompt = _prompt(10)
    a, b = make_cache(), make_cache()
    model.prefill(prompt, a)
    model.prefill(prompt, b)
    model.forward(np.array([7, 8, 9, 10, 11]), a)
    a.truncate(len(prompt) + 1)
    model.forward(np.array([7]), b)
    assert a.length == b.length == len(prompt) + 1
    return a, b


def _close(x, y, atol=1e-5):
    np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), atol=atol)


def test_rollback_contiguous_int8_and_mla_caches_equal_a_plain_run(llm):
    model, cfg = llm.model, llm.config
    if cfg.attention == "mla":
        makers, names, axis = [lambda: model.new_cache(64)], ["c_kv", "k_rope"], 1     # [layers, seq, r]
    else:                                                                               # [layers, kv, seq, hd]
        makers, names, axis = [lambda: KVCache(cfg, 64), lambda: Int8KVCache(cfg, 64)], ["k", "v"], 2
    for make in makers:
        a, b = _rolled_back_and_plain(model, make)
        for name in names + [n for n in ("k_scale", "v_scale") if hasattr(a, n)]:
            x, y = getattr(a, name), getattr(b, name)
            if x.dtype == np.int8:                   # a code may round one step apart
                assert np.abs(x.astype(int) - y.astype(int)).max() <= 1
            else:
                _close(x, y)
            assert not np.take(x, range(a.length, x.shape[axis]), axis).any()    # zeros after the rollback


def test_rollback_rolling_window_keeps_the_window(llm):
    if llm.config.sliding_window is None:
        pytest.skip("rolling buffers are for sliding-window models")
    model = llm.model
    a, b = _rolled_back_and_plain(model, lambda: model.new_cache(64, spare=4))      # 4 drafts rolled back
    assert a.n_slots == WINDOW + 4
    slots = np.arange(a.length - WINDOW + 1, a.length) % a.n_slots  # the next query's window, before itself
    _close(a.k[:, :, slots], b.k[:, :, slots])
    _close(a.v[:, :, slots], b.v[:, :, slots])
    # and decoding on continues identically
    _close(model.forward(np.array([3, 4]), a), model.forward(np.array([3, 4]), b), atol=1e-4)
    with pytest.raises(ValueError, match="spare slots"):
        model.forward(np.arange(7), a)
        a.truncate(a.length - 7)


def test_rollback_paged_cache_returns_empty_blocks_to_the_pool(llama):
    model = llama.model
    pools = [PagedKVCache(llama.config, 16, block_size=4, dtype=d) for d in ("float32", "float32")]
    managers = [BlockManager(16), BlockManager(16)]
    a, b = _rolled_back_and_plain(model, lambda: BlockTableCache(pools.pop(0), managers.pop(0)))
    assert a.block_table == b.block_table == [0, 1, 2, 3, 4, 5]     # 25 positions: block 6 came and went
    assert len(a.manager.free) == len(b.manager.free) == 10
    _close(a.pool.k, b.pool.k)
    _close(a.pool.v, b.pool.v)


# ---- errors -------------------------------------------------------------------------------------------

def test_bad_speculative_choices_are_one_line_errors(llm, llama):
    with pytest.raises(MiniLLMError, match="layers:N"):
        early_exit_drafter(llm.model, llm.config.n_layers)
    with pytest.raises(MiniLLMError, match="number of layers"):
        llm.drafter("layers:x")
    if llm.config.attention == "mla":
        with pytest.raises(MiniLLMError, match="int4 self-draft"):
            llm.drafter("int4")
        with pytest.raises(MiniLLMError, match="another tokenizer"):
            llama.drafter(LLM(llm.config.replace(vocab_size=999), llm.model, None, "other"))


# ---- the real model ----------------------------------------------------------------------------------

def test_smollm2_ngram_on_a_copy_heavy_prompt_gives_the_plain_tokens(smollm2_dir):
    llm = minillm.load(str(smollm2_dir))
    prompt = next(p for p in copy_heavy_prompts() if p["kind"] == "edit text")["messages"]
    plain = llm.generate(prompt, max_tokens=16)
    spec = llm.generate(prompt, max_tokens=16, speculative="ngram", draft_tokens=4)
    assert_greedy_equal(llm.model, llm.prompt_ids(prompt), plain.token_ids, spec.token_ids)
    assert spec.text == plain.text if spec.token_ids == plain.token_ids else True
    assert spec.acceptance_rate > 0.5 and spec.speculative.target_forwards < 8       # it copies the email
    ids = llm.prompt_ids(prompt)                                     # and through the engine, in a small pool
    engine = minillm.Engine(llm, speculative="ngram", draft_tokens=4, num_blocks=24, block_size=8)
    served = engine.generate([ids], max_tokens=16)[0]
    assert_greedy_equal(llm.model, ids, plain.token_ids, served.token_ids)
    assert served.acceptance_rate > 0.5 and engine.stats()["blocks_used"] == 0


# ---- the continuous-batching engine ---------------------------------------------------------------

def test_engine_speculation_gives_the_plain_tokens_with_preemption_and_prefix_caching(llm):
    """Four requests sharing a prompt prefix, in a pool so small that drafts force preemptions (Llama;
    Mistral's window gives blocks back instead); every drafter, the draft model's KV in the pool."""
    if llm.config.attention == "mla":
        pytest.skip("the batching engine runs GQA models")
    rng = np.random.default_rng(0)
    shared = [int(t) for t in rng.integers(0, 320, 8)]
    prompts = [shared + [int(t) for t in rng.integers(0, 320, 6)] * 2 for _ in range(4)]
    plain = [g.token_ids for g in minillm.Engine(llm).generate(prompts, max_tokens=20)]
    preempted = 0
    for spec in ("ngram", "int4", "layers:1", llm):
        engine = minillm.Engine(llm, speculative=spec, draft_tokens=3, num_blocks=14, block_size=4)
        gens = engine.generate(prompts, max_tokens=20)
        for p, want, g in zip(prompts, plain, gens):
            assert_greedy_equal(llm.model, p, want, g.token_ids)
        stats = engine.stats()
        preempted += stats["preemptions"]
        assert stats["blocks_used"] == 0 and stats["spec_verify_passes"] > 0 and stats["prefix_hit_tokens"] > 0
        assert 1.0 <= stats["spec_mean_accepted_length"] <= 4.0 and gens[0].acceptance_rate is not None
    assert preempted > 0 or llm.config.sliding_window is not None


def test_engine_speculation_refuses_what_it_cannot_run(llama):
    with pytest.raises(MiniLLMError, match="draft_tokens"):
        minillm.Engine(llama, speculative="ngram", draft_tokens=0)


# ---- the command line ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    """A random 2-layer model with SmolLM2's vocabulary and tokenizer (test_cli's tiny model)."""
    from minillm.checkpoints.tokenizer_files import save_hf, tokenizer_from_hf
    path = tmp_path_factory.mktemp("tiny-spec")
    save_random_model(llama_config(vocab_size=49152, num_hidden_layers=2, max_position_embeddings=512), path)
    save_hf(tokenizer_from_hf(smollm2_dir), path)
    return path


def _cli(*args):
    from click.testing import CliRunner
    from minillm.cli import cli
    return CliRunner().invoke(cli, list(args))


def test_cli_generate_speculative_prints_the_plain_text_and_the_acceptance(tiny_dir):
    args = ["generate", "-m", str(tiny_dir), "-n", "12", "--no-chat", "a b c a b c a b c a b"]
    plain = _cli(*args)
    for spec in (["--speculative", "layers:1", "--draft-tokens", "2"], ["--speculative", str(tiny_dir)]):
        result = _cli(*args, *spec)
        assert result.exit_code == 0, result.output
        assert result.output.split("[prompt")[0] == plain.output.split("[prompt")[0]
        assert "accepted" in result.output and "tokens/pass" in result.output


def test_cli_bad_speculative_flag_is_a_one_line_error(tiny_dir):
    result = _cli("generate", "-m", str(tiny_dir), "-n", "4", "hi", "--speculative", "layers:9")
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code != 0 and len(lines) == 1 and "Traceback" not in result.output, result.output
    assert "layers:N needs 1 <= N < 2" in lines[0]


def test_bench_speculative_prints_plain_vs_speculative(tiny_dir):
    from minillm.tools.spec_bench import bench_speculative, format_table, totals
    llm = minillm.load(str(tiny_dir))
    rows = bench_speculative(llm, "ngram", None, 6, [p for p in copy_heavy_prompts() if "text" in p])
    table = format_table(rows, "ngram")
    assert "speedup" in table and "drafting" in table and all(r.same for r in rows)
    assert totals(rows)["plain_tok_s"] > 0 and len(rows) == 1


def test_served_speculation_answers_as_plain_and_reports_acceptance_in_metrics(tiny_dir):
    httpx = pytest.importorskip("httpx")
    from minillm.engine.engine import Engine
    from minillm.serve.server import create_app, serve_in_thread
    llm = minillm.load(str(tiny_dir))
    prompt = list(range(300, 330))
    want = minillm.Engine(llm).generate([prompt], max_tokens=8)[0].text
    app = create_app(llm, Engine(llm, speculative="layers:1", draft_tokens=3), "tiny")
    with serve_in_thread(app) as url:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        text = httpx.get(f"{url}/metrics").text
    assert answer["choices"][0]["text"] == want
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line.startswith("minillm_spec")}
    assert values["minillm_spec_draft_tokens_total"] > 0 and 0 <= values["minillm_spec_acceptance_rate"] <= 1
    assert values["minillm_spec_mean_accepted_length"] >= 1


def test_a_stop_string_inside_an_accepted_run_cuts_where_plain_decoding_does(tiny_dir):
    llm = minillm.load(str(tiny_dir))
    prompt = "one two three one two three one two"
    plain = llm.generate(prompt, max_tokens=16, chat=False)
    stop = plain.text[len(plain.text) // 2:][:3]                      # text from the middle of the answer
    assert stop.strip()
    want = llm.generate(prompt, max_tokens=16, chat=False, stop=[stop])
    for spec in ("ngram", llm):
        got = llm.generate(prompt, max_tokens=16, chat=False, stop=[stop], speculative=spec, draft_tokens=4)
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason) and stop not in got.text


def test_engine_speculative_sampling_is_reproducible_with_a_seed(llama):
    prompts = [_prompt(8, seed=s) for s in range(3)]
    runs = [[g.token_ids for g in minillm.Engine(llama, speculative=spec, draft_tokens=3).generate(
        prompts, max_tokens=12, temperature=0.8, top_p=0.9, seed=5)] for spec in ("ngram", "ngram", llama, llama)]
    assert runs[0] == runs[1] and runs[2] == runs[3] and all(len(t) == 12 for r in runs for t in r)


# ---- the GPU step-cost projection's arithmetic (minillm.cuda.dev.speculative; its timings need a GPU) ----

def test_tokens_per_pass_and_break_even_alpha():
    from minillm.cuda.dev.speculative import break_even_alpha, tokens_per_pass
    assert tokens_per_pass(0.0, 4) == 1.0 and tokens_per_pass(1.0, 4) == 5.0
    assert tokens_per_pass(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    for k, ratio in ((4, 1.3), (8, 2.0), (2, 1.01)):
        alpha = break_even_alpha(k, ratio)
        assert tokens_per_pass(alpha, k) == pytest.approx(ratio, rel=1e-6)
    assert break_even_alpha(2, 3.5) is None                  # 3 tokens a pass at best cannot pay 3.5 steps


def test_projection_pays_only_when_drafts_cost_less_than_they_save():
    from minillm.cuda.dev.speculative import projection
    costs = {"plain": 4.0, "verify 4": 5.0, "ngram": 0.01, "int4": 2.0, "layers:8": 1.0}
    rows = {r["drafter"]: r for r in projection(costs, {"ngram": 0.5, "int4": 0.63, "layers": 0.04}, ks=(4,),
                                                layer_drafts=(8,))}
    assert rows["ngram"]["speedup"] > 1.4                     # 1.94 tokens for ~5 ms vs 4 ms a token
    assert rows["int4"]["speedup"] < 1 and rows["int4"]["break_even"] > 0.63   # 13 ms for 2.3 tokens
    assert rows["layers:8"]["tokens_per_pass"] == pytest.approx(1.04166, rel=1e-4)
