"""The step budget (issue 40): a long prompt beside a decoding request is prefilled in chunks the budget
bounds, the decode gets a token every step, a short prompt that arrives meanwhile goes first, a prompt alone
still takes whole chunks, and the chunked tokens and logits are those of a one-shot prefill. The adaptive
budget is checked under a fake clock (the step time a + b * tokens), never against the real one."""
import numpy as np
import pytest

import minillm
from hf_models import llama_config, save_random_model
from minillm.engine.engine import Engine
from minillm.engine.generate import generate_ids
from minillm.engine.sampling import SamplingParams
from minillm.engine.step_budget import MIN_PROMPT_TOKENS, STEP_CAP, StepBudget

LONG, CHAT = 1500, 6                     # prompt tokens: the long one (3 chunks of 512) and a chat's


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_random_model(llama_config(eos_token_id=None, max_position_embeddings=2048), path)   # no EOS: full lengths
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return minillm.load(str(model_dir))


def _prompt(n, seed):
    return np.random.default_rng(seed).integers(3, 320, n).tolist()


def _alone(llm, prompt, max_tokens):
    """The single-sequence loop's greedy tokens: a contiguous cache, the prompt in one prefill."""
    return generate_ids(llm.model, prompt, max_tokens, SamplingParams(), stop_ids=llm.config.eos_token_ids).token_ids


def _record_steps(engine) -> list:
    """Wrap engine.scheduler.schedule; -> the list each step appends {request id: (tokens, decoding?)} to, where
    a decode is a request computing past its prompt."""
    steps, schedule = [], engine.scheduler.schedule

    def recorded():
        batch = schedule()
        steps.append({seq.request_id: (n, seq.num_computed >= seq.prompt_len) for seq, n in batch})
        return batch
    engine.scheduler.schedule = recorded
    return steps


def _run(engine, tokens: dict) -> None:
    while engine.has_unfinished():
        for e in engine.step():
            tokens.setdefault(e.request_id, []).extend(e.token_ids)


class FakeClock:
    """Seconds that pass only when the wrapped runner "computes": a + b * (tokens in the step)."""

    def __init__(self, engine, a: float, b: float):
        self.now, forward = 0.0, engine.runner.forward_greedy

        def timed(chunks):
            self.now += a + b * sum(len(c.token_ids) for c in chunks)
            return forward(chunks)
        engine.runner.forward_greedy = timed

    def __call__(self) -> float:
        return self.now


# ---- the bound: decodes keep flowing, the shortest prompt goes first ---------------------------------

def test_beside_a_decode_each_step_takes_at_most_the_budget_and_the_decode_never_waits(llm):
    """A 1500-token prompt starts alone; a chat arrives after its first chunk. With a fixed budget of 64
    tokens a step, the chat is admitted the very next step (before the longer prompt in progress), then decodes
    in every step until the long prompt's first token, each step at most 64 tokens. (Before: the older
    prompt's chunks took the whole budget, and the chat waited for all of its prefill.) Both outputs are
    those of each prompt alone."""
    budget = 64
    long, chat = _prompt(LONG, 1), _prompt(CHAT, 2)
    engine = Engine(llm, max_batch_tokens=budget)
    steps, tokens = _record_steps(engine), {}
    long_id = engine.add_request(long, max_tokens=4)
    engine.step()
    assert steps[0] == {long_id: (budget, False)}               # alone: a whole chunk
    chat_id = engine.add_request(chat, max_tokens=40)
    _run(engine, tokens)
    assert steps[1] == {chat_id: (CHAT, False), long_id: (budget - CHAT, False)}   # the newcomer first
    prefill = [s for s in steps[2:] if long_id in s and not s[long_id][1]]
    assert len(prefill) >= (LONG - budget) // budget                               # many chunks
    for step in prefill:                                                           # beside the decode
        assert step[chat_id] == (1, True) and sum(n for n, _ in step.values()) <= budget
    assert tokens == {long_id: _alone(llm, long, 4), chat_id: _alone(llm, chat, 40)}


def test_a_short_prompt_arriving_mid_prefill_gets_its_first_token_before_the_long_one(llm):
    """Prompt work goes to the prompt with the fewest tokens left, a newcomer included: a 50-token prompt
    arriving while a long one prefills in 32-token steps takes the next step whole, its last 18 tokens the
    step after, and its 8 tokens are out before the long prompt's first."""
    engine = Engine(llm, max_batch_tokens=32)
    steps, first, tokens = _record_steps(engine), {}, {}
    long_id = engine.add_request(_prompt(LONG, 1), max_tokens=2)
    for _ in range(3):
        engine.step()
    chat_id = engine.add_request(_prompt(50, 2), max_tokens=8)
    n = 0
    while engine.has_unfinished():
        n += 1
        for e in engine.step():
            tokens.setdefault(e.request_id, []).extend(e.token_ids)
            first.setdefault(e.request_id, n)
    assert steps[3] == {chat_id: (32, False)} and steps[4] == {chat_id: (18, False), long_id: (14, False)}
    assert first[chat_id] == 2 and first[long_id] > 2 + 8


def test_max_batch_tokens_0_is_the_arrival_order_scheduler_that_stalled_the_chat(llm):
    """`max_batch_tokens=0` (bench serve's `before`): the backend's 512-token chunks in arrival order, so a
    chat arriving after a long prompt's first chunk waits until a chunk leaves room, here the last: the
    stall of issue 40. The tokens are the same either way."""
    long, chat = _prompt(LONG, 1), _prompt(CHAT, 2)
    engine = Engine(llm, max_batch_tokens=0)
    steps, tokens = _record_steps(engine), {}
    long_id = engine.add_request(long, max_tokens=2)
    engine.step()
    chat_id = engine.add_request(chat, max_tokens=4)
    _run(engine, tokens)
    assert steps[:3] == [{long_id: (512, False)}, {long_id: (512, False)},            # no room for the chat
                         {long_id: (LONG - 1024, False), chat_id: (CHAT, False)}]   # until the last chunk
    assert tokens == {long_id: _alone(llm, long, 2), chat_id: _alone(llm, chat, 4)}


# ---- the adaptive budget, under a fake clock -----------------------------------------------------------

A, B, TARGET = 1 / 32, 1 / 512, 0.25       # a step costs A + B * tokens; exact in binary floating point


def _pair(budget, decodes=1) -> float:
    """The budget's size for the next two steps, on average (chunks alternate a fifth above and below it)."""
    return (budget.prompt_tokens(decodes) + budget.prompt_tokens(decodes)) / 2


def test_the_budget_converges_to_what_fits_the_target():
    """Step time a + b * (decodes + prompt tokens): the prompt tokens that fit a target T beside d decodes are
    (T - a) / b - d. From a first untimed step the budget fits the line as soon as two chunk sizes were timed,
    and follows a machine that gets twice as slow per token. Where a alone is half the target, the prompt
    still gets 3a of each step (else its first token would come ever later); no budget passes max_tokens."""
    def run(budget, steps, a=A, b=B, decodes=1):
        sizes = []
        for _ in range(steps):
            sizes.append(budget.prompt_tokens(decodes))
            budget.record(decodes, sizes[-1], a + b * (decodes + sizes[-1]))
        return sizes

    want = (TARGET - A) / B - 1                                 # 111 prompt tokens beside one decode
    budget = StepBudget(TARGET, 512)
    sizes = run(budget, 4)
    assert sizes[0] == 512 - 1 and sizes[1] < want and budget.fit() == pytest.approx((A, B))   # untimed: all
    assert abs(_pair(budget) - want) <= 1 and abs(_pair(budget, 8) - (want - 7)) <= 1    # more decodes, fewer
    assert max(sizes[2:]) <= 1.2 * want and min(sizes[2:]) >= 0.8 * want - 1                # a fifth either way
    run(budget, 60, b=2 * B)
    assert abs(_pair(budget) - ((TARGET - A) / (2 * B) - 1)) <= 2                            # half as many
    slow = StepBudget(TARGET, 512)
    run(slow, 4, a=4 * A)
    assert abs(_pair(slow) - 3 * 4 * A / B) <= 1 and 3 * 4 * A / B > (TARGET - 4 * A) / B    # 3a, not what fits
    slower = StepBudget(TARGET, 1024)                           # a alone longer than the target: 3a would make
    run(slower, 4, a=0.3)                                       # 1.2 s steps; they stop at STEP_CAP targets
    cap = (STEP_CAP * TARGET - 0.3) / B - 1
    assert abs(_pair(slower) - cap) <= 1 and 3 * 0.3 / B > cap
    tiny = StepBudget(0.001, 512)                               # a target no step can meet:
    run(tiny, 2, a=0.0)
    assert _pair(tiny) == pytest.approx(MIN_PROMPT_TOKENS, abs=1)  # a floor: prompts move on
    generous = StepBudget(10.0, 512)
    generous.record(1, 100, A + B * 101)
    assert generous.prompt_tokens(3) == 512 - 3                 # never past the step's max_batch_tokens


def test_the_engine_leaves_a_lone_prompt_whole_however_slow_a_token_is(llm):
    """Under a fake clock where a 512-token step takes 8 s, a prompt with nobody beside it still takes
    512-token chunks (small steps would only delay its own first token); once a chat arrives beside it, the
    step shrinks to about the budget's floor of 16 tokens: the chat's 6, the rest the long prompt's."""
    engine = Engine(llm)
    engine.scheduler.budget = StepBudget(TARGET, 512, FakeClock(engine, A, 1 / 64))
    steps, tokens = _record_steps(engine), {}
    long_id = engine.add_request(_prompt(LONG, 1), max_tokens=2)
    engine.step()
    engine.step()
    chat_id = engine.add_request(_prompt(CHAT, 2), max_tokens=4)
    _run(engine, tokens)
    assert steps[:2] == [{long_id: (512, False)}, {long_id: (512, False)}]
    assert steps[2][chat_id] == (CHAT, False) and CHAT + steps[2][long_id][0] <= 1.2 * MIN_PROMPT_TOKENS
    assert tokens == {long_id: _alone(llm, _prompt(LONG, 1), 2), chat_id: _alone(llm, _prompt(CHAT, 2), 4)}


def test_the_engine_sizes_chunks_beside_a_decode_to_the_target(llm):
    """The engine's wiring, under the fake clock (a + b * tokens): with a chat decoding, a long prompt's
    chunks grow from the first guess to (T - a) / b - 1 = 111 tokens on average, the most that fits 250 ms
    (alternating a fifth above and below), the chat decoding in every step."""
    engine = Engine(llm, target_step_ms=TARGET * 1e3)
    engine.scheduler.budget = budget = StepBudget(TARGET, 512, FakeClock(engine, A, B))
    steps, tokens = _record_steps(engine), {}
    chat_id = engine.add_request(_prompt(CHAT, 2), max_tokens=60)
    for _ in range(4):                                          # its prefill, then decode-only steps
        engine.step()
    long_id = engine.add_request(_prompt(LONG, 1), max_tokens=2)
    _run(engine, tokens)
    beside = [s[long_id][0] for s in steps if long_id in s and not s[long_id][1] and chat_id in s]
    assert len(beside) >= 10 and beside[0] < 50                 # a first guess from the chat's 6-token prefill
    assert budget.fit() == pytest.approx((A, B))
    assert abs(sum(beside[-5:-1]) / 4 - 111) <= 1 and max(beside) <= 1.2 * 111   # the last is what was left
    assert all(s.get(chat_id, (1, True)) == (1, True) for s in steps[4:])


# ---- correctness on the real model: chunks beside a decode, one-shot tokens and logits ----------------------

def test_smollm2_prompt_prefilled_beside_a_decode_gives_the_one_shot_tokens_and_logits(smollm2_dir):
    """SmolLM2 on ~750 tokens of real text, in 48-token steps beside a decoding chat (47 prompt tokens each):
    its greedy tokens equal the single-sequence loop's (one prefill), its first-token logits equal
    `llm.logits` (one prefill) to fp32 rounding, and the chat decoded in every one of those steps."""
    from minillm.tools.evaluate import eval_text
    llm = minillm.load(str(smollm2_dir))
    long = llm.prompt_ids(eval_text(3000))
    chat = llm.prompt_ids("What is 2 + 2?", chat=True)
    engine = Engine(llm, max_batch_tokens=48, device_greedy=False)
    steps, tokens, rows = _record_steps(engine), {}, []
    forward = engine.runner.forward

    def logged(chunks):                                         # the long prompt's last chunk: its first token's row
        logits = forward(chunks)
        rows.extend(logits[i] for i, c in enumerate(chunks) if c.end == len(long) and len(c.token_ids) > 1)
        return logits
    engine.runner.forward = logged
    long_id = engine.add_request(long, max_tokens=8)
    engine.step()
    chat_id = engine.add_request(chat, max_tokens=40, ignore_eos=True)              # it outlasts the prefill
    _run(engine, tokens)
    prefill = [s for s in steps[2:] if long_id in s and not s[long_id][1]]
    assert len(prefill) >= len(long) // 48 - 2, steps
    assert all(s.get(chat_id) == (1, True) and s[long_id][0] <= 47 for s in prefill), steps
    assert tokens[long_id] == _alone(llm, long, 8)
    assert tokens[chat_id] == generate_ids(llm.model, chat, 40, SamplingParams()).token_ids   # no stop ids
    assert len(rows) == 1
    np.testing.assert_allclose(rows[0], llm.logits(long)[-1], rtol=0, atol=1e-3)


# ---- `minillm serve`'s options ---------------------------------------------------------------------------

def test_serve_passes_the_budget_options_to_the_engine_and_refuses_both_in_one_line(model_dir, monkeypatch):
    """--max-batch-tokens N (fixed, 0: arrival order) and --target-step-ms T reach the Engine the server builds;
    given together they are one line on stderr and exit 2, before the model loads."""
    from click.testing import CliRunner
    from minillm.cli import cli
    from minillm.serve import server
    built = []
    monkeypatch.setattr(server, "serve", lambda llm, *args, **options: built.append(Engine(llm, **{
        k: v for k, v in options.items() if k not in ("planner",)})))
    for flags in (["--max-batch-tokens", "64"], ["--max-batch-tokens", "0"], ["--target-step-ms", "120"], []):
        result = CliRunner().invoke(cli, ["serve", "--model", str(model_dir), *flags])
        assert result.exit_code == 0, result.output
    fixed, arrival, faster, default = (engine.scheduler for engine in built)
    assert (fixed.max_batch_tokens, fixed.budget, fixed.arrival_order) == (64, None, False)
    assert (arrival.max_batch_tokens, arrival.budget, arrival.arrival_order) == (512, None, True)
    assert faster.budget.target_s == pytest.approx(0.12) and default.budget.target_s == pytest.approx(0.2)
    result = CliRunner().invoke(cli, ["serve", "--model", str(model_dir), "--max-batch-tokens", "64",
                                      "--target-step-ms", "120"])
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "give one" in result.output
    assert len(built) == 4
