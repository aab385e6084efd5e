"""The sampling controls (engine/sampling.py): logit_bias, repetition/presence/frequency penalties, min-p and
stop_token_ids, in the order the module documents, against HF transformers' logits processors applied in
that order (and a direct formula for presence/frequency, which HF does not have); then through generate,
the Engine (never its device-side greedy path), the CLI and `minillm serve` with the official client."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

import minillm
from hf_models import llama_config, save_random_model
from minillm.engine.engine import Engine
from minillm.engine.generate import generate_ids
from minillm.engine.sampling import (Sampler, SamplingParams, TokenHistory, apply_presence_frequency,
                                     next_token_distribution, processed_logits)
from minillm.errors import MiniLLMError

VOCAB = 300


def _case(seed: int):
    """Random logits [VOCAB], a prompt and an output with repeats (ids from a small range, so they overlap)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, VOCAB).astype(np.float32)
    prompt = rng.integers(0, 60, 25).tolist()
    output = rng.integers(30, 90, 15).tolist()
    return logits, prompt, output


def _history(prompt, output) -> TokenHistory:
    history = TokenHistory(prompt)
    for token in output:
        history.append(token)
    return history


def _presence_frequency_reference(scores: torch.Tensor, output: list[int], presence: float, frequency: float):
    """OpenAI's formula, one token at a time: l[j] -= count[j] * frequency + (count[j] > 0) * presence,
    count over the generated tokens only (vLLM's reading too: its output bin counts, not the prompt's)."""
    scores = scores.clone()
    for j in set(output):
        count = output.count(j)
        scores[0, j] -= count * frequency + presence
    return scores


def _hf_distribution(logits, prompt, output, p: SamplingParams) -> np.ndarray:
    """HF's processors in the documented order: bias, repetition penalty, (presence/frequency: the formula),
    temperature, top-k, top-p, min-p."""
    scores = torch.tensor(logits, dtype=torch.float64)[None]
    ids = torch.tensor([prompt + output])
    if p.logit_bias:
        scores = SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias.items()])(ids, scores)
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    scores = _presence_frequency_reference(scores, output, p.presence_penalty, p.frequency_penalty)
    warpers = [TemperatureLogitsWarper(p.temperature)]
    if p.top_k is not None:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p is not None:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p:
        warpers.append(MinPLogitsWarper(p.min_p))
    for w in warpers:
        scores = w(ids, scores)
    return torch.softmax(scores, -1)[0].numpy()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("controls", [
    dict(repetition_penalty=1.3), dict(repetition_penalty=0.7), dict(min_p=0.05), dict(min_p=0.3, temperature=0.6),
    dict(logit_bias={3: 5.0, 7: -100.0, 40: 2.5}), dict(presence_penalty=0.8, frequency_penalty=0.4),
    dict(presence_penalty=-1.0, frequency_penalty=-0.5),
    dict(logit_bias={35: 4.0}, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3, temperature=0.8,
         top_k=40, top_p=0.9, min_p=0.02),
], ids=["rep-1.3", "rep-0.7", "min-p", "min-p-cold", "bias", "presence-frequency", "negative-penalties", "all"])
def test_controls_match_hf_processors_in_the_documented_order(seed, controls):
    logits, prompt, output = _case(seed)
    params = SamplingParams(**{"temperature": 1.0, **controls})
    ours = next_token_distribution(processed_logits(logits, params, _history(prompt, output)), params)
    np.testing.assert_allclose(ours, _hf_distribution(logits, prompt, output, params), atol=1e-6)


def test_presence_and_frequency_count_only_generated_tokens():
    """OpenAI's and vLLM's definition: a token only in the prompt is untouched; each output token loses
    presence once and frequency per occurrence. The repetition penalty, like HF's and vLLM's, covers both."""
    logits = np.full(10, 2.0, dtype=np.float32)
    history = _history(prompt=[1, 2], output=[2, 3, 3, 3])
    out = processed_logits(logits, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), history)
    np.testing.assert_allclose(out, [2, 2, 2 - 0.5 - 0.25, 2 - 0.5 - 0.75, 2, 2, 2, 2, 2, 2])
    out = processed_logits(logits, SamplingParams(repetition_penalty=2.0), history)
    np.testing.assert_allclose(out, [2, 1, 1, 1, 2, 2, 2, 2, 2, 2])
    ids, counts = history.output()
    np.testing.assert_allclose(apply_presence_frequency(logits, ids, counts, 0.0, 1.0)[3], -1.0)


def test_sampler_counts_its_own_picks_for_the_penalties():
    """Greedy with a frequency penalty: the top token is picked until its penalty drops it below the second."""
    logits = np.array([3.0, 2.0, 0.0], dtype=np.float32)
    sampler = Sampler(SamplingParams(frequency_penalty=0.6))
    assert [sampler(logits) for _ in range(4)] == [0, 0, 1, 0]      # 3 -> 2.4 -> 1.8 < 2; then 1.4 vs 1.8 -> 0


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"), (dict(logit_bias={5: 101.0}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"), (dict(logprobs=21), "logprobs"),
])
def test_bad_control_values_are_refused_by_name(kwargs, fragment):
    with pytest.raises(MiniLLMError, match=fragment):
        SamplingParams(**kwargs)


# ---- through generate and the Engine (a tiny random model) ----------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_random_model(llama_config(n_heads=8, n_kv_heads=2, eos_token_id=None), path)
    return minillm.load(str(path))


def _prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(3, 320, n).tolist() for n in (4, 23, 11)]


CONTROLS = dict(presence_penalty=1.2, frequency_penalty=0.7, repetition_penalty=1.4, logit_bias={9: 2.0, 17: -3.0})


def test_engine_with_controls_equals_each_prompt_alone(tiny):
    """Batched, with chunked prefill: every request's penalties count its own tokens, as generate's do."""
    want = [generate_ids(tiny.model, p, 10, SamplingParams(**CONTROLS)).token_ids for p in _prompts()]
    plain = [generate_ids(tiny.model, p, 10, SamplingParams()).token_ids for p in _prompts()]
    assert want != plain                                   # the controls changed the answers
    got = Engine(tiny, max_batch_tokens=8).generate(_prompts(), max_tokens=10, **CONTROLS)
    assert [g.token_ids for g in got] == want


def test_stop_token_ids_end_the_answer_like_eos(tiny):
    prompt = _prompts()[1]
    free = generate_ids(tiny.model, prompt, 10, SamplingParams()).token_ids
    stop = free[4]
    cut = free[:free.index(stop)]
    alone = generate_ids(tiny.model, prompt, 10, SamplingParams(stop_token_ids=[stop]))
    engine = Engine(tiny).generate([prompt], max_tokens=10, stop_token_ids=[stop])[0]
    assert alone.token_ids == engine.token_ids == cut
    assert alone.finish_reason == engine.finish_reason == "stop"


def _recording(engine):
    """Record which runner path each step asks for: 'greedy' (ids picked on the device) or 'logits'."""
    calls, greedy, forward, inside = [], engine.runner.forward_greedy, engine.runner.forward, []

    def ids_path(chunks):
        calls.append("greedy")
        inside.append(True)                    # the CPU runner's forward_greedy calls forward: not a logits step
        try:
            return greedy(chunks)
        finally:
            inside.pop()

    def logits_path(chunks, *args, **kwargs):
        if not inside:
            calls.append("logits")
        return forward(chunks, *args, **kwargs)
    engine.runner.forward_greedy, engine.runner.forward = ids_path, logits_path
    return calls


@pytest.mark.parametrize("controls", [dict(presence_penalty=0.5), dict(frequency_penalty=0.1),
                                      dict(repetition_penalty=1.1), dict(logit_bias={3: 1.0}), dict(logprobs=0)],
                         ids=["presence", "frequency", "repetition", "bias", "logprobs"])
def test_a_request_with_controls_never_takes_the_device_greedy_path(tiny, controls):
    """Temperature 0 yet not a plain argmax: every step of it asks the runner for logits, and the tokens are
    those generate picks; a plain greedy request beside it would take the ids path alone."""
    engine = Engine(tiny)
    calls = _recording(engine)
    prompt = _prompts()[0]
    got = engine.generate([prompt], max_tokens=5, temperature=0.0, **controls)[0]
    assert calls and set(calls) == {"logits"}
    assert got.token_ids == generate_ids(tiny.model, prompt, 5, SamplingParams(**controls)).token_ids
    calls.clear()
    engine.generate([prompt], max_tokens=5, temperature=0.0)
    assert set(calls) == {"greedy"}


def test_unknown_token_ids_and_speculative_conflicts_are_one_line_errors(tiny):
    with pytest.raises(MiniLLMError, match="logit_bias: token id 5000 is outside the vocabulary"):
        Engine(tiny).add_request([1, 2, 3], logit_bias={5000: 1.0})
    with pytest.raises(MiniLLMError, match="stop_token_ids"):
        Engine(tiny).add_request([1, 2, 3], stop_token_ids=[10 ** 6])
    with pytest.raises(MiniLLMError, match="presence_penalty does not run with speculative decoding"):
        Engine(tiny, speculative="ngram").add_request([1, 2, 3], presence_penalty=1.0)
    with pytest.raises(MiniLLMError, match="logit_bias does not run with speculative decoding"):
        tiny.generate([{"role": "user", "content": "x"}], speculative="ngram", logit_bias={1: 1.0})


def test_min_p_and_stop_token_ids_run_with_speculative_decoding(tiny):
    """min-p filters both the target's and the draft's distributions (next_token_distribution), so it is
    supported with a drafter; greedy speculative output equals plain greedy with the same stop ids."""
    prompt = _prompts()[1]
    stop = generate_ids(tiny.model, prompt, 10, SamplingParams()).token_ids[6]
    want = Engine(tiny).generate([prompt], max_tokens=10, stop_token_ids=[stop], min_p=0.1)[0]
    got = Engine(tiny, speculative="ngram").generate([prompt], max_tokens=10, stop_token_ids=[stop], min_p=0.1)[0]
    assert got.token_ids == want.token_ids and got.finish_reason == "stop"


# ---- the CLI (SmolLM2) --------------------------------------------------------------------------------

def _cli(*args):
    from minillm.cli import cli
    return CliRunner().invoke(cli, list(args))


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return minillm.load(smollm2_dir)


def test_generate_flags_equal_the_python_api(smollm2_dir, smollm2):
    llm = smollm2
    want = llm.generate("The list: apples, apples,", max_tokens=8, chat=False, repetition_penalty=1.5,
                        presence_penalty=0.5, frequency_penalty=0.5, min_p=0.1, logit_bias={28: -100.0})
    result = _cli("generate", "The list: apples, apples,", "--model", str(smollm2_dir), "-n", "8", "--no-chat",
                  "--repetition-penalty", "1.5", "--presence-penalty", "0.5", "--frequency-penalty", "0.5",
                  "--min-p", "0.1", "--logit-bias", "28=-100")
    assert result.exit_code == 0, result.output
    assert want.text in result.output
    plain = llm.generate("The list: apples, apples,", max_tokens=8, chat=False).text
    assert plain != want.text


@pytest.mark.parametrize("args,fragment", [
    (["--min-p", "1.5"], "Invalid value for '--min-p'"),
    (["--presence-penalty", "3"], "Invalid value for '--presence-penalty'"),
    (["--repetition-penalty", "0"], "Invalid value for '--repetition-penalty'"),
    (["--logit-bias", "28"], "'28' is not ID=V"), (["--logit-bias", "28=abc"], "'28=abc' is not ID=V"),
    (["--logit-bias", "28=500"], "the bias in [-100, 100]"), (["--logprobs", "21"], "Invalid value for '--logprobs'"),
    (["--stop-token-id", "-1"], "Invalid value for '--stop-token-id'"),
    (["--presence-penalty", "1", "--speculative", "ngram"], "presence_penalty does not run with speculative decoding"),
])
def test_bad_control_flags_are_one_line_errors(smollm2_dir, args, fragment):
    result = _cli("generate", "Hi", "--model", str(smollm2_dir), "-n", "2", *args)
    assert result.exit_code != 0
    assert fragment in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output


# ---- the server: fields supported, fields refused (SmolLM2, the official client) ----------------------

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def served(smollm2):
    from minillm.serve.server import create_app, serve_in_thread
    llm = smollm2
    app = create_app(llm, Engine(llm), "smollm2")
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        yield SimpleNamespace(url=url, client=client, llm=llm)


def test_served_controls_equal_generate(served):
    controls = dict(presence_penalty=0.6, frequency_penalty=0.4, logit_bias={"28": -100})
    extra = dict(repetition_penalty=1.3, min_p=0.05)
    want = served.llm.generate("The list: apples, apples,", max_tokens=8, chat=False, repetition_penalty=1.3,
                               min_p=0.05, presence_penalty=0.6, frequency_penalty=0.4, logit_bias={28: -100.0})
    got = served.client.completions.create(model="smollm2", prompt="The list: apples, apples,", max_tokens=8,
                                           temperature=0, extra_body=extra, **controls)
    assert got.choices[0].text == want.text
    plain = served.client.completions.create(model="smollm2", prompt="The list: apples, apples,", max_tokens=8,
                                             temperature=0)
    assert plain.choices[0].text != want.text


def test_served_stop_token_ids_stop_the_answer(served):
    messages = [{"role": "user", "content": "Count: one, two, three"}]
    full = served.llm.generate(messages, max_tokens=8)
    stop = full.token_ids[3]
    want = served.llm.generate(messages, max_tokens=8, stop_token_ids=[stop])
    got = served.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0,
                                                extra_body={"stop_token_ids": [stop]})
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == "stop" and got.usage.completion_tokens == 3


@pytest.mark.parametrize("field", [
    {"mirostat": 2}, {"typical_p": 0.5}, {"functions": [{"name": "f"}]}, {"audio": {"voice": "x"}},
    {"reasoning_effort": "high"},
])
def test_unimplemented_fields_are_400s_naming_them_and_metadata_is_accepted(served, field):
    name = next(iter(field))
    metadata = dict(user="u-1", metadata={"k": "v"}, store=False, service_tier="auto")
    with pytest.raises(openai.BadRequestError) as e:
        served.client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=1, extra_body=field, **metadata)
    assert e.value.body["param"] == name and name in e.value.body["message"]
    got = served.client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=1, temperature=0, **metadata)
    assert got.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body,param,fragment", [
    ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"frequency_penalty": -3}, "frequency_penalty", "greater than or equal to -2"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"repetition_penalty": -1}, "repetition_penalty", "greater than 0"),
    ({"min_p": 1.1}, "min_p", "less than or equal to 1"),
    ({"logit_bias": {"5": 150}}, "logit_bias", "less than or equal to 100"),
    ({"logit_bias": {"hello": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"49152": 1}}, "logit_bias", "outside the vocabulary"),
    ({"stop_token_ids": [49152]}, "stop_token_ids", "outside the vocabulary"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "greater than or equal to 0"),
    ({"messages": [{"role": "user", "content": "Hi", "name": "bob"}]}, "messages", "messages.0.name"),
])
def test_bad_controls_are_400s_naming_the_field(served, body, param, fragment):
    request = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **body}
    r = httpx.post(f"{served.url}/v1/chat/completions", json=request, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and fragment in r.json()["error"]["message"]
    ok = served.client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=1, temperature=0)
    assert ok.choices[0].message.content                      # the server goes on


def test_controls_and_logprobs_run_under_tensor_parallelism(tmp_path):
    """--tp: the pick is made on the host from the all-reduced logits, so generate's every rank and the Engine's
    rank 0 give tp=1's tokens and logprobs with penalties, bias, min-p, stop ids and prompt logprobs."""
    from minillm.engine.parallel.communicator import run_ranks
    from minillm.engine.parallel.serving import follow
    save_random_model(llama_config(eos_token_id=None), tmp_path)
    prompt, controls = [3, 17, 99, 250, 5], dict(CONTROLS, min_p=0.05, logprobs=2)
    alone = minillm.load(tmp_path)
    want = generate_ids(alone.model, prompt, 8, SamplingParams(temperature=0.9, seed=3, **controls))
    want_engine = Engine(alone, max_kv_bytes=1 << 20).generate([prompt], max_tokens=8, prompt_logprobs=1, **controls)[0]

    def rank(comm):
        llm = minillm.load(tmp_path, comm=comm)
        g = generate_ids(llm.model, prompt, 8, SamplingParams(temperature=0.9, seed=3, **controls))
        if comm.rank != 0:
            return g, follow(llm)
        engine = Engine(llm, max_kv_bytes=1 << 20)
        out = engine.generate([prompt], max_tokens=8, prompt_logprobs=1, **controls)[0]
        engine.runner.release()
        return g, out

    (g0, engine_out), (g1, _) = run_ranks(2, rank)
    assert g0.token_ids == g1.token_ids == want.token_ids
    np.testing.assert_allclose([e.logprob for e in g0.logprobs], [e.logprob for e in want.logprobs], atol=1e-4)
    assert engine_out.token_ids == want_engine.token_ids
    np.testing.assert_allclose([e.logprob for e in engine_out.prompt_logprobs[1:]],
                               [e.logprob for e in want_engine.prompt_logprobs[1:]], atol=1e-4)


@pytest.mark.parametrize("penalty", [5e-324, 1e-40, 1e308])
def test_an_extreme_repetition_penalty_pushes_logits_to_the_float_edge_not_to_nan(penalty):
    """Dividing by a tiny penalty would overflow a float32 logit to inf (and the softmax to NaN): it stops at
    the largest float instead, and a draw still picks a token; a masked -inf stays -inf."""
    logits = np.array([3.0, -2.0, -np.inf, 1.0], dtype=np.float32)
    params = SamplingParams(temperature=1.0, repetition_penalty=penalty, seed=0)
    with np.errstate(over="raise", invalid="raise"):         # an inf or a NaN anywhere would raise
        out = processed_logits(logits, params, _history([0, 1, 2], []))
        assert np.isneginf(out[2]) and np.isfinite(out[[0, 1, 3]]).all()
        assert Sampler(params, [0, 1, 2])(logits) in (0, 3)
