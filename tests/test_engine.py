"""The continuous-batching engine: batched outputs equal single-sequence outputs, token for token,
through paging, preemption, chunked prefill, prefix caching and the int8 KV cache."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import minillm
from hf_models import llama_config, mistral_config, save_random_model
from minillm.engine.engine import Engine
from minillm.errors import MiniLLMError
from minillm.engine.generate import generate_ids
from minillm.engine.paged_kv import FREED, BlockManager
from minillm.engine.prefix_cache import PrefixCache
from minillm.engine.sampling import SamplingParams
from minillm.engine.scheduler import Scheduler, Sequence

LENGTHS = [3, 40, 17, 9, 26, 1]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    # No EOS in a random model's vocabulary: every request runs to max_tokens, so a lost or
    # duplicated token cannot hide behind an early stop.
    save_random_model(llama_config(n_heads=8, n_kv_heads=2, eos_token_id=None), path)
    return minillm.load(str(path))


def _prompts(lengths=LENGTHS, prefix=()):
    rng = np.random.default_rng(7)
    return [list(prefix) + rng.integers(3, 320, n).tolist() for n in lengths]


def _alone(llm, prompt, max_tokens=MAX_TOKENS, **sampling):
    """What the single-sequence loop (llm.generate's) produces for this prompt."""
    return generate_ids(llm.model, prompt, max_tokens, SamplingParams(**sampling),
                        stop_ids=llm.config.eos_token_ids).token_ids


@pytest.fixture(scope="module")
def expected(llm):
    return [_alone(llm, p) for p in _prompts()]


@pytest.mark.parametrize("options", [
    dict(),                                                # one big pool
    dict(max_batch=2),                                     # requests join as others finish
    dict(max_batch_tokens=8),                              # chunked prefill: prompts split over steps
    dict(chunked_prefill=False, block_size=4),
    dict(prefix_caching=False),
], ids=["default", "max-batch-2", "chunked-prefill", "whole-prompts", "no-prefix-cache"])
def test_batched_greedy_equals_each_prompt_alone(llm, expected, options):
    engine = Engine(llm, **options)
    results = engine.generate(_prompts(), max_tokens=MAX_TOKENS)
    assert [r.token_ids for r in results] == expected
    assert [r.prompt_tokens for r in results] == LENGTHS
    assert all(r.finish_reason == "length" for r in results)
    assert engine.stats()["blocks_used"] == 0 and not engine.has_unfinished()


def test_the_batch_really_holds_several_sequences(llm):
    engine = Engine(llm)
    for p in _prompts():
        engine.add_request(p, max_tokens=4)
    engine.step()
    s = engine.stats()
    assert s["batch_size"] == len(LENGTHS) and s["running"] == len(LENGTHS) and s["waiting"] == 0
    assert s["blocks_used"] == sum(-(-n // 16) for n in LENGTHS)


def test_a_tiny_pool_forces_preemption_and_loses_nothing(llm, expected):
    engine = Engine(llm, num_blocks=8, block_size=8)       # 64 positions for 6 requests of up to 64
    events = []
    for p in _prompts():
        engine.add_request(p, max_tokens=MAX_TOKENS)
    while engine.has_unfinished():
        events += engine.step()
        s = engine.stats()
        assert s["blocks_used"] + s["blocks_cached"] + s["blocks_free"] == s["blocks_total"] == 8
    assert engine.stats()["preemptions"] > 0
    for rid, want in enumerate(expected):                  # every token once, in order; one finish each
        mine = [e for e in events if e.request_id == rid]
        assert [t for e in mine for t in e.token_ids] == want
        assert [e.finished for e in mine].count(True) == 1 and mine[-1].finished


def test_prefix_caching_skips_the_shared_prefix_and_keeps_the_outputs(llm):
    system = np.random.default_rng(1).integers(3, 320, 37).tolist()   # 2 full blocks of 16, and 5 more
    prompts = _prompts([4, 11, 20], prefix=system)
    want = [_alone(llm, p, 8) for p in prompts]
    engine = Engine(llm)
    first = engine.generate(prompts[:1], max_tokens=8)
    before = engine.stats()
    rest = engine.generate(prompts[1:], max_tokens=8)
    after = engine.stats()
    assert [g.token_ids for g in first + rest] == want
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == 2 * 32
    computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    assert computed == sum(len(p) for p in prompts[1:]) - 2 * 32
    assert after["blocks_cached"] >= 2


def test_a_prompt_that_is_all_cached_still_computes_its_last_token(llm):
    prompt = _prompts([32])[0]                             # exactly two blocks
    engine = Engine(llm)
    a, b = engine.generate([prompt], max_tokens=5)[0], engine.generate([prompt], max_tokens=5)[0]
    assert a.token_ids == b.token_ids == _alone(llm, prompt, 5)
    assert engine.stats()["prefix_hit_tokens"] == 16       # block 2 holds the last token: recomputed


def test_int8_kv_engine_equals_the_int8_single_sequence_cache(llm):
    prompts = _prompts()[:3]
    want = [_alone(llm.with_options(kv_cache="int8"), p, 12) for p in prompts]
    engine = Engine(llm, kv_cache="int8")
    assert [g.token_ids for g in engine.generate(prompts, max_tokens=12)] == want
    assert engine.pool.k.dtype == np.int8


# ---- sliding window: blocks behind the window go back to the pool -------------------------------------
WINDOW, SMALL_BLOCK = 10, 4


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral")
    save_random_model(mistral_config(sliding_window=WINDOW, eos_token_id=None), path)
    return minillm.load(str(path))


@pytest.mark.parametrize("options", [
    dict(),
    dict(max_batch_tokens=8),                              # chunked prefill across the window's edge
    dict(num_blocks=8, max_batch_tokens=8),                # 32 positions for six 64-position requests:
], ids=["default", "chunked-prefill", "tiny-pool"])           # preemption, then recompute from scratch
def test_sliding_window_engine_equals_alone_and_holds_only_the_window(windowed, options):
    """Mistral-style: each sequence gives back the blocks every later query is past, and the outputs stay
    those of the single-sequence path (its rolling buffer). After each step a running sequence holds at
    most the blocks spanning its last window - 1 keys: ceil((window - 1) / block_size) + 1 = 4 here, where
    a 64-position sequence would otherwise hold 16."""
    prompts = _prompts()
    want = [_alone(windowed, p) for p in prompts]
    engine = Engine(windowed, block_size=SMALL_BLOCK, **options)
    for p in prompts:
        engine.add_request(p, max_tokens=MAX_TOKENS)
    events, most = [], 0
    while engine.has_unfinished():
        events += engine.step()
        held = [sum(b != FREED for b in seq.block_table) for seq in engine.scheduler.running]
        most = max([most] + held)
    assert most <= -(-(WINDOW - 1) // SMALL_BLOCK) + 1
    assert engine.stats()["preemptions"] > 0 or "num_blocks" not in options
    for rid, expected in enumerate(want):
        assert [t for e in events if e.request_id == rid for t in e.token_ids] == expected
    assert engine.stats()["blocks_used"] == 0


def test_sliding_window_with_a_cached_prefix_longer_than_the_window(windowed):
    system = np.random.default_rng(2).integers(3, 320, 3 * 16).tolist()   # 3 full blocks of 16 > window
    prompts = _prompts([5, 9], prefix=system)
    want = [_alone(windowed, p, 8) for p in prompts]
    engine = Engine(windowed)
    got = engine.generate(prompts[:1], max_tokens=8) + engine.generate(prompts[1:], max_tokens=8)
    assert [g.token_ids for g in got] == want
    assert engine.stats()["prefix_hit_tokens"] == 3 * 16                 # dropped by the first, still cached


def test_seeded_sampling_in_a_batch_equals_the_same_seed_alone(llm):
    prompts = _prompts()[:4]
    sampling = dict(temperature=0.9, top_k=50, top_p=0.95, seed=123)
    want = [_alone(llm, p, 16, **sampling) for p in prompts]
    got = Engine(llm).generate(prompts, max_tokens=16, **sampling)
    assert [g.token_ids for g in got] == want
    assert len({tuple(w) for w in want}) == len(want)


def _counting_greedy_calls(engine) -> list:
    """Wrap the engine's runner.forward_greedy; -> the list each call appends its batch size to."""
    calls, forward_greedy = [], engine.runner.forward_greedy

    def counted(chunks):
        calls.append(len(chunks))
        return forward_greedy(chunks)
    engine.runner.forward_greedy = counted
    return calls


def _run(engine, prompts, stop_token=None, **first) -> list:
    """Every prompt through engine.step() (one request each; stop_token: a stop id for the first, `first`: its
    add_request options) -> (token ids, finish reason, streamed text) per request."""
    rids = [engine.add_request(p, **(dict(max_tokens=MAX_TOKENS) | (first if i == 0 else {})))
            for i, p in enumerate(prompts)]
    if stop_token is not None:
        engine.requests[rids[0]].stop_ids = {stop_token}
    out = {rid: ([], None, []) for rid in rids}
    while engine.has_unfinished():
        for e in engine.step():
            out[e.request_id][0].extend(e.token_ids)
            out[e.request_id][2].append(e.text)
            if e.finished:
                out[e.request_id] = (out[e.request_id][0], e.finish_reason, out[e.request_id][2])
    return [(ids, reason, "".join(text)) for ids, reason, text in out.values()]


@pytest.mark.parametrize("options", [dict(), dict(max_batch_tokens=8), dict(num_blocks=8, block_size=8)],
                         ids=["default", "chunked-prefill", "tiny-pool-preempts"])
def test_greedy_steps_take_token_ids_from_the_runner_and_emit_the_same_tokens(llm, expected, options):
    """device_greedy (the default): every step of an all-greedy batch asks the runner for ids (forward_greedy),
    never for logits, and the streams, stops and texts are those of the logits path (device_greedy=False),
    which never asks for ids. A stop token met midway stops both at the same place."""
    assert Engine(llm).device_greedy
    on, off = Engine(llm, **options), Engine(llm, device_greedy=False, **options)
    on_calls, off_calls = _counting_greedy_calls(on), _counting_greedy_calls(off)
    stop = expected[0][5]                                     # request 0's sixth greedy token
    got, want = _run(on, _prompts(), stop), _run(off, _prompts(), stop)
    assert got == want and not off_calls
    assert len(on_calls) == on.stats()["steps"] - (on.stats()["batch_size"] == 0)   # the last step may be empty
    assert want[0][1] == "stop" and want[0][0] == expected[0][:expected[0].index(stop)]
    assert [ids for ids, _, _ in want[1:]] == expected[1:]


def test_a_step_with_a_sampled_request_stays_on_the_logits(llm, monkeypatch):
    """One request with a temperature among greedy ones: its 4 steps take logits (the sampler draws from them),
    the all-greedy steps after it finished take ids; the seeded outputs equal the logits path's all along.
    device_greedy=False turns the ids path off."""
    on = Engine(llm)
    calls = _counting_greedy_calls(on)
    sampled = dict(temperature=0.9, seed=5, max_tokens=4)
    prompts = _prompts()
    got = _run(on, prompts, **sampled)
    off = Engine(llm, device_greedy=False)
    assert not off.device_greedy
    assert got == _run(off, prompts, **sampled)
    assert [ids for ids, _, _ in got[1:]] == [_alone(llm, p) for p in prompts[1:]]
    assert calls == [len(prompts) - 1] * (MAX_TOKENS - 4)         # every step after the sampled request's 4


def test_abort_frees_the_blocks_at_once_and_reports_it_next_step(llm):
    engine = Engine(llm)
    keep, drop = (engine.add_request(p, max_tokens=10) for p in _prompts([20, 40]))
    engine.step()
    used = engine.stats()["blocks_used"]
    assert engine.abort(drop) and not engine.abort(drop)
    assert engine.stats()["blocks_used"] == used - 3       # 40 positions = 3 blocks, freed before any step
    events = engine.step()
    assert [(e.request_id, e.finished, e.finish_reason) for e in events if e.request_id == drop] == \
        [(drop, True, "abort")]
    while engine.has_unfinished():
        events += engine.step()
    assert sum(len(e.token_ids) for e in events if e.request_id == keep) == 9
    assert engine.stats()["blocks_used"] == 0


def test_requests_that_cannot_run_are_refused_with_one_line(llm):
    engine = Engine(llm, num_blocks=2, block_size=8)
    with pytest.raises(MiniLLMError, match="needs 3 KV blocks"):
        engine.add_request(_prompts([10])[0], max_tokens=10)
    for bad, match in [(dict(prompt=[]), "empty"), (dict(temperature=-1), "temperature"), (dict(top_p=1.5), "top-p"),
                       (dict(prompt=[5, 999]), "token ids"), (dict(max_tokens=0), "max_tokens"),
                       (dict(prompt=[1] * 300), "context")]:
        with pytest.raises(MiniLLMError, match=match):
            engine.add_request(**({"prompt": [1, 2]} | bad))
    with pytest.raises(MiniLLMError, match="list of prompts"):
        engine.generate([1, 2, 3])
    assert not engine.has_unfinished()


def test_mla_models_are_not_supported_yet(llm):
    from minillm.model.transformer import Transformer
    mla = Transformer.__new__(Transformer)
    mla.config = llm.config.replace(attention="mla", kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                    v_head_dim=8)
    with pytest.raises(MiniLLMError, match="MLA attention is not supported by the batching engine yet"):
        Engine(minillm.LLM(mla.config, mla))



# ---- the scheduler alone, under random traffic (no model: a step "computes" by bookkeeping) --------

class _PromptBudget:
    """A step budget that always allows `n` prompt tokens beside decodes (the StepBudget's interface)."""
    def __init__(self, n: int):
        self.n = n

    def prompt_tokens(self, decode_tokens: int) -> int:
        return self.n


@settings(max_examples=120, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 10), st.integers(0, 2)), min_size=1, max_size=10),
       n_blocks=st.integers(3, 14), max_batch=st.integers(1, 4), budget=st.integers(1, 40),
       aborted=st.sets(st.integers(0, 9)), prompt_budget=st.one_of(st.none(), st.integers(1, 12)),
       arrival_order=st.booleans())
def test_scheduler_never_loses_or_duplicates_a_request(requests, n_blocks, max_batch, budget, aborted, prompt_budget,
                                                        arrival_order):
    """Whatever the traffic, pool and budgets (decodes first with a fixed or a step budget, or arrival order),
    every request finishes exactly once, and beside decodes no step takes more prompt tokens than allowed."""
    bs, cache = 4, PrefixCache()
    blocks = BlockManager(n_blocks, cache)
    scheduler = Scheduler(blocks, bs, max_batch, budget, cache, arrival_order=arrival_order,
                          budget=None if prompt_budget is None else _PromptBudget(prompt_budget))
    seqs = []
    for rid, (prompt_len, max_tokens, prefix) in enumerate(requests):
        if -(-(prompt_len + max_tokens - 1) // bs) > n_blocks:
            continue                                       # the engine refuses these up front
        seqs.append(Sequence(rid, list(range(100 * prefix, 100 * prefix + prompt_len)), prompt_len, max_tokens))
        scheduler.add(seqs[-1])
    done = []
    for step in range(3000):
        if not scheduler.running and not scheduler.waiting:
            break
        batch = scheduler.schedule()
        assert len({id(seq) for seq, _ in batch}) == len(batch) and (batch or not scheduler.running)
        assert sum(n for _, n in batch) <= budget
        if prompt_budget is not None and not arrival_order and any(seq.decoding for seq, _ in batch):
            assert sum(n for seq, n in batch if not seq.decoding) <= prompt_budget
        for seq, n in batch:
            assert 0 < n <= seq.num_pending
            scheduler.advance(seq, n)
            if seq.num_pending == 0:
                seq.tokens.append(7)                       # "sampled"
                if len(seq.output_ids) == seq.max_tokens:
                    scheduler.finish(seq)
                    done.append(seq.request_id)
        if step == 2:                                      # clients that hang up
            for seq in seqs:
                if seq.request_id in aborted and not seq.finished:
                    scheduler.finish(seq)
                    done.append(seq.request_id)
        _check_queues(scheduler, blocks, seqs)
    assert sorted(done) == [s.request_id for s in seqs]   # every request finished, exactly once
    assert all(len(s.output_ids) == s.max_tokens for s in seqs if s.request_id not in aborted)
    assert all(r == 0 for r in blocks.refcount)
    assert sorted(blocks.free + list(cache.unused)) == list(range(n_blocks))


def _check_queues(scheduler, blocks, seqs):
    for seq in seqs:
        places = [seq.finished, seq in scheduler.running, seq in scheduler.waiting]
        assert sum(places) == 1, f"request {seq.request_id} is in {places} (finished, running, waiting)"
        assert seq in scheduler.running or not seq.block_table       # only running sequences hold blocks
    owners = [b for seq in scheduler.running for b in seq.block_table]
    for b in range(blocks.num_blocks):
        assert blocks.refcount[b] == owners.count(b)

def test_engine_is_exported():
    assert minillm.Engine is Engine


# ---- the real SmolLM2: text, stop strings, chat, streaming --------------------------------------

@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return minillm.load(str(smollm2_dir))


def test_smollm2_batched_text_equals_llm_generate(smollm2):
    jobs = [dict(prompt="The capital of France is", stop=("\n\n",), max_tokens=6),   # stops at " Paris."
            dict(prompt="def fibonacci(n):\n   ", stop=("return",), max_tokens=10),  # "re" held back, then cut
            dict(prompt="What is 2 + 2?", chat=True, stop=(), max_tokens=4)]
    want = [smollm2.generate(**j) for j in jobs]
    engine = Engine(smollm2)
    rids = [engine.add_request(**j) for j in jobs]
    text, ids, reasons = dict.fromkeys(rids, ""), {rid: [] for rid in rids}, {}
    while engine.has_unfinished():
        for e in engine.step():                            # streamed pieces add up to the whole text
            text[e.request_id] += e.text
            ids[e.request_id] += e.token_ids
            if e.finished:
                reasons[e.request_id] = e.finish_reason
    assert [text[r] for r in rids] == [w.text for w in want]
    assert [ids[r] for r in rids] == [w.token_ids for w in want]
    assert [reasons[r] for r in rids] == [w.finish_reason for w in want] == ["stop", "stop", "length"]
