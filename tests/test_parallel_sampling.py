"""n > 1 (parallel sampling): the prompt is prefilled once, its KV blocks shared copy-on-write by the n
choices; seeded choices differ and repeat; each choice equals a request of its own with its seed; the
`openai` client sees n indexed choices, streamed or not, and a pool too small for them is a 400 naming n."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import minillm
from hf_models import llama_config, save_random_model
from minillm.engine.choices import blocks_for_choices, choice_seed
from minillm.engine.engine import Engine
from minillm.engine.generate import generate_ids
from minillm.engine.paged_kv import BlockManager
from minillm.engine.prefix_cache import PrefixCache
from minillm.engine.sampling import SamplingParams
from minillm.engine.scheduler import Scheduler, Sequence
from minillm.errors import MiniLLMError

BS = 4


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_random_model(llama_config(n_heads=8, n_kv_heads=2, eos_token_id=None), path)   # no EOS: full lengths
    return minillm.load(str(path))


def _prompt(n: int, seed: int = 3) -> list[int]:
    return np.random.default_rng(seed).integers(3, 320, n).tolist()


def _alone(llm, prompt, max_tokens, **sampling) -> list[int]:
    """The single-sequence loop's tokens (llm.generate's, its own contiguous cache): the reference."""
    return generate_ids(llm.model, prompt, max_tokens, SamplingParams(**sampling)).token_ids


# ---- the block pool: shared, copied on the first write, freed with the last owner ----------------------

def _prefilled(prompt_len: int, n_blocks: int = 32) -> tuple[Scheduler, BlockManager, Sequence]:
    blocks = BlockManager(n_blocks, PrefixCache())
    scheduler = Scheduler(blocks, BS, max_batch=8, max_batch_tokens=64)
    parent = Sequence(0, list(range(10, 10 + prompt_len)), prompt_len, 8)
    scheduler.add(parent)
    [(seq, n)] = scheduler.schedule()
    scheduler.advance(seq, n)
    return scheduler, blocks, parent


def _step(scheduler: Scheduler, token: int = 7) -> list:
    for seq in scheduler.running:
        seq.tokens.append(token)                            # each choice "sampled" its next token
    batch = scheduler.schedule()
    for seq, n in batch:
        scheduler.advance(seq, n)
    return batch


def test_forked_choices_share_every_prompt_block_and_copy_the_partial_one_on_first_write():
    scheduler, blocks, parent = _prefilled(10)              # blocks of 4: two full, the third holds 2 positions
    children = [Sequence(i, list(parent.tokens), 10, 8) for i in (1, 2)]
    assert scheduler.fork(parent, children) == 2
    table = list(parent.block_table)
    assert [c.block_table for c in children] == [table, table]
    assert [blocks.refcount[b] for b in table] == [3, 3, 3] and blocks.num_used == 3    # nothing copied yet

    _step(scheduler)                                        # each writes position 10, in the shared third block
    assert len(scheduler.copies) == 2                       # two copy; the last writer keeps the original
    assert [src for src, _ in scheduler.copies] == [table[2]] * 2
    thirds = {seq.block_table[2] for seq in scheduler.running}
    assert len(thirds) == 3 and all(blocks.refcount[b] == 1 for b in thirds)
    assert [blocks.refcount[b] for b in table[:2]] == [3, 3]           # the full blocks stay shared
    assert blocks.num_used == 2 + 3

    _step(scheduler)                                        # position 11: each writes its own block now
    assert scheduler.copies == []
    for seq in list(scheduler.running):
        scheduler.finish(seq)
    assert all(r == 0 for r in blocks.refcount) and blocks.num_used == 0


def test_a_prompt_of_whole_blocks_is_shared_and_never_copied():
    scheduler, blocks, parent = _prefilled(8)
    children = [Sequence(i, list(parent.tokens), 8, 8) for i in (1, 2, 3)]
    scheduler.fork(parent, children)
    _step(scheduler)                                        # position 8 starts a new block for each
    assert scheduler.copies == []
    assert [blocks.refcount[b] for b in parent.block_table[:2]] == [4, 4] and blocks.num_used == 2 + 4


def test_choices_past_max_batch_wait_their_turn_as_requests_of_their_own():
    scheduler, blocks, parent = _prefilled(10)
    scheduler.max_batch = 2
    children = [Sequence(i, list(parent.tokens), 10, 8) for i in (1, 2, 3)]
    assert scheduler.fork(parent, children) == 1
    assert list(scheduler.waiting) == children[1:] and not children[1].block_table


@settings(max_examples=60, deadline=None)
@given(prompt_len=st.integers(1, 14), n=st.integers(2, 5), n_blocks=st.integers(6, 16),
       max_tokens=st.integers(1, 9), aborted=st.sets(st.integers(0, 4)))
def test_refcounts_stay_exact_and_the_pool_is_never_overcommitted(prompt_len, n, n_blocks, max_tokens, aborted):
    """Forks, copy-on-write, preemption under a tiny pool, aborts: every block's refcount is the number of
    tables holding it, and every block is back when all choices are done."""
    if blocks_for_choices(prompt_len, max_tokens, 1, BS) > n_blocks:
        return                                              # the engine refuses these up front
    blocks = BlockManager(n_blocks, PrefixCache())
    scheduler = Scheduler(blocks, BS, max_batch=4, max_batch_tokens=16)
    seqs = [Sequence(i, list(range(prompt_len)), prompt_len, max_tokens) for i in range(n)]
    scheduler.add(seqs[0])
    forked = False
    for step in range(500):
        if not scheduler.running and not scheduler.waiting:
            break
        batch = scheduler.schedule()
        sampled = []
        for seq, k in batch:
            scheduler.advance(seq, k)
            if seq.num_pending == 0:
                if seq is seqs[0] and not forked:           # its prompt is computed: the others fork from it
                    forked = True
                    scheduler.fork(seq, seqs[1:])
                    sampled += [s for s in seqs[1:] if s in scheduler.running]
                sampled.append(seq)
        for seq in sampled:
            seq.tokens.append(7 + seq.request_id)           # choices differ
            if len(seq.output_ids) == seq.max_tokens:
                scheduler.finish(seq)
        if step == 3:
            for seq in seqs:
                if seq.request_id in aborted and not seq.finished and seq is not seqs[0]:
                    scheduler.finish(seq)
        owners = [b for seq in scheduler.running for b in seq.block_table]
        assert [blocks.refcount[b] for b in range(n_blocks)] == [owners.count(b) for b in range(n_blocks)]
        assert blocks.num_used <= n_blocks
    assert all(seq.finished for seq in seqs)
    assert all(r == 0 for r in blocks.refcount) and blocks.num_used == 0


@pytest.mark.parametrize("pool", ["float32", "int8", "device-layout"])
def test_copy_blocks_copies_every_layer_of_a_block_keys_values_and_scales(llm, pool):
    from minillm.cuda.paged_pool import DevicePagedKV
    from minillm.engine.paged_kv import PagedKVCache
    cfg = llm.config
    kv = (DevicePagedKV(cfg, 6, BS, "int8", xp=np) if pool == "device-layout" else PagedKVCache(cfg, 6, BS, pool))
    arrays = [a for a in (kv.k, kv.v, getattr(kv, "k_scale", None), getattr(kv, "v_scale", None)) if a is not None]
    for i, a in enumerate(arrays):
        a[...] = np.arange(a.size).reshape(a.shape) % 97 + i              # every block, layer and slot distinct
    before = [a.copy() for a in arrays]
    kv.copy_blocks([(1, 4), (3, 5)])
    for a, old in zip(arrays, before):
        np.testing.assert_array_equal(a[:, [4, 5]], old[:, [1, 3]])
        np.testing.assert_array_equal(a[:, :4], old[:, :4])               # the sources and the rest untouched


# ---- the engine --------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt_len", [21, 20], ids=["partial-last-block", "whole-blocks"])
def test_each_choice_equals_a_request_of_its_own_with_its_seed(llm, prompt_len):
    """Choice i samples what a single request seeded choice_seed(seed, i) samples, on the single-sequence
    loop: the shared blocks (and the copied partial one) hold each choice's keys, and nobody else's."""
    prompt, sampling = _prompt(prompt_len), dict(temperature=1.0, seed=11)
    engine = Engine(llm, block_size=BS)
    got = engine.generate_choices(prompt, 4, max_tokens=10, **sampling)
    want = [_alone(llm, prompt, 10, temperature=1.0, seed=choice_seed(11, i)) for i in range(4)]
    assert [g.token_ids for g in got] == want
    stats = engine.stats()
    assert stats["prompt_tokens_computed"] == prompt_len                  # the prompt was prefilled once
    assert stats["peak_kv_bytes"] == blocks_for_choices(prompt_len, 10, 4, BS) * stats["kv_bytes_per_block"]
    assert blocks_for_choices(prompt_len, 10, 4, BS) < 4 * blocks_for_choices(prompt_len, 10, 1, BS)
    assert stats["blocks_used"] == 0 and not engine.has_unfinished()


def test_seeded_choices_differ_from_each_other_and_repeat_exactly(llm):
    prompt = _prompt(13)
    first = Engine(llm).generate_choices(prompt, 3, max_tokens=8, temperature=1.0, seed=5)
    again = Engine(llm).generate_choices(prompt, 3, max_tokens=8, temperature=1.0, seed=5)
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert len({tuple(g.token_ids) for g in first}) == 3
    assert first[0].token_ids == _alone(llm, prompt, 8, temperature=1.0, seed=5)   # choice 0: the seed itself


def test_unseeded_choices_differ(llm):
    got = Engine(llm).generate_choices(_prompt(13), 3, max_tokens=8, temperature=1.0)
    assert len({tuple(g.token_ids) for g in got}) == 3


def test_greedy_choices_all_equal_plain_greedy(llm):
    prompt = _prompt(9)
    got = Engine(llm, block_size=BS).generate_choices(prompt, 3, max_tokens=8)
    assert [g.token_ids for g in got] == [_alone(llm, prompt, 8)] * 3


def test_choices_that_wait_for_room_still_equal_their_own_request(llm):
    """max_batch 2: two choices fork, the others queue and recompute (their full prompt blocks cached)."""
    prompt = _prompt(18)
    got = Engine(llm, block_size=BS, max_batch=2).generate_choices(prompt, 4, max_tokens=6, temperature=1.0, seed=2)
    assert [g.token_ids for g in got] == [_alone(llm, prompt, 6, temperature=1.0, seed=choice_seed(2, i))
                                          for i in range(4)]


def test_aborting_the_first_choice_before_its_prefill_hands_the_prompt_to_the_next(llm):
    engine = Engine(llm, block_size=BS)
    rids = engine.add_choices(_prompt(10), 3, max_tokens=4, temperature=1.0, seed=1)
    engine.abort(rids[0])
    done = {}
    while engine.has_unfinished():
        for e in engine.step():
            if e.finished:
                done[e.request_id] = e.finish_reason
    assert done == {rids[0]: "abort", rids[1]: "length", rids[2]: "length"}
    assert engine.stats()["blocks_used"] == 0
    rids = engine.add_choices(_prompt(10), 3, max_tokens=20, temperature=1.0)
    for _ in range(3):
        engine.step()                                       # forked, shared and copied blocks in use
    assert engine.stats()["blocks_used"] > 0
    for rid in rids:                                        # a client hanging up aborts every choice
        assert engine.abort(rid)
    assert engine.stats()["blocks_used"] == 0 and len(engine.step()) == 3 and not engine.has_unfinished()


def test_choices_over_the_pool_and_unsupported_combinations_are_refused_naming_n(llm):
    engine = Engine(llm, block_size=BS, num_blocks=12)
    with pytest.raises(MiniLLMError, match=r"n=4 choices .* need 14 KV blocks .* the pool has 12") as e:
        engine.add_choices(_prompt(10), 4, max_tokens=8)     # 2 shared + 4 x 3
    assert e.value.param == "n" and not engine.has_unfinished()
    assert len(engine.add_choices(_prompt(10), 3, max_tokens=8)) == 3   # 2 + 3 x 3 = 11 fit
    with pytest.raises(MiniLLMError, match="n must be an integer >= 1"):
        engine.add_choices(_prompt(10), 0)
    with pytest.raises(MiniLLMError, match="speculative") as e:
        Engine(llm, speculative="ngram").add_choices(_prompt(10), 2)
    assert e.value.param == "n"


def test_choices_with_tensor_parallelism_are_refused_in_one_line(llm, monkeypatch):
    engine = Engine(llm)
    monkeypatch.setattr(llm.model, "comm", object(), raising=False)     # what a --tp rank's model carries
    with pytest.raises(MiniLLMError, match="tensor parallelism") as e:
        engine.add_choices(_prompt(10), 2)
    assert e.value.param == "n" and not engine.has_unfinished()


def test_cli_choices_prints_each_continuation_labelled(served):
    from click.testing import CliRunner
    from minillm.cli import cli
    path = served.path
    result = CliRunner().invoke(cli, ["generate", "-m", path, "--choices", "3", "-n", "5", "-t", "1", "--seed", "2",
                                      "--no-chat", "Once upon a time"])
    assert result.exit_code == 0, result.output
    want = served.llm.generate_choices("Once upon a time", 3, max_tokens=5, temperature=1, seed=2, chat=False)
    assert result.stdout == "".join(f"--- choice {i} ---\n{g.text}\n" for i, g in enumerate(want))
    assert "prefilled once for 3 choices" in result.stderr
    for flags, named in [(["--speculative", "ngram"], "--speculative"), (["--tp", "2"], "--tp")]:
        result = CliRunner().invoke(cli, ["generate", "-m", path, "--choices", "2", *flags, "Hi"])
        assert result.exit_code != 0 and "Traceback" not in result.output
        assert result.output.strip().splitlines() == [f"minillm: error: --choices > 1 does not run with {named} (yet)"]


# ---- the server, through the official client -----------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_dir):
    """A server on a random 2-layer model that speaks SmolLM2's vocabulary, its pool 40 blocks of 16."""
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from types import SimpleNamespace
    from minillm.checkpoints.tokenizer_files import save_hf, tokenizer_from_hf
    from minillm.serve.server import create_app, serve_in_thread
    path = tmp_path_factory.mktemp("tiny-smollm2-vocab")
    save_random_model(llama_config(vocab_size=49152, num_hidden_layers=2, max_position_embeddings=64), path)
    save_hf(tokenizer_from_hf(smollm2_dir), path)
    tiny = minillm.load(str(path))
    engine = Engine(tiny, num_blocks=40)
    with serve_in_thread(create_app(tiny, engine, "tiny")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        yield SimpleNamespace(client=client, llm=tiny, engine=engine, openai=openai, path=str(path))


def test_openai_completions_with_n_are_indexed_choices_each_as_its_own_seed_alone(served):
    prompt = "Once upon a time"
    got = served.client.completions.create(model="tiny", prompt=prompt, n=3, max_tokens=6, temperature=1, seed=9)
    assert [c.index for c in got.choices] == [0, 1, 2]
    want = [served.llm.generate(prompt, max_tokens=6, temperature=1, seed=choice_seed(9, i), chat=False)
            for i in range(3)]
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert [c.finish_reason for c in got.choices] == [w.finish_reason for w in want]
    assert got.usage.prompt_tokens == len(served.llm.prompt_ids(prompt, chat=False))     # counted once
    assert got.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    assert len({c.text for c in got.choices}) == 3


def test_openai_chat_stream_with_n_carries_each_choice_index(served):
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = served.client.chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=8,
                                                  temperature=1, seed=4)
    stream = served.client.chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=8, temperature=1,
                                                   seed=4, stream=True, stream_options={"include_usage": True})
    texts, finish, roles, usage = ["", ""], [None, None], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            roles += [choice.index] if choice.delta.role else []
            texts[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert sorted(roles) == [0, 1]
    assert texts == [c.message.content for c in whole.choices] and texts[0] != texts[1]
    assert finish == [c.finish_reason for c in whole.choices]
    assert usage.prompt_tokens == whole.usage.prompt_tokens and usage.completion_tokens == whole.usage.completion_tokens


def test_n_over_the_pool_or_the_limit_is_a_400_naming_n_and_nothing_is_held(served):
    for n, max_tokens in [(16, 40), (17, 2), (0, 2)]:               # 16 x 4 blocks > 40; past MAX_CHOICES; < 1
        with pytest.raises(served.openai.BadRequestError) as e:
            served.client.completions.create(model="tiny", prompt="Hello there", n=n, max_tokens=max_tokens)
        assert e.value.body["param"] == "n", e.value.body
    got = served.client.completions.create(model="tiny", prompt="Hello there", n=16, temperature=1, seed=1)
    assert len(got.choices) == 16                                   # no max_tokens: what the pool holds of each
    assert served.engine.stats()["blocks_used"] == 0
