"""Structured output: a grammar masks every token it cannot accept, so the answer parses whatever the temperature.

Real SmolLM2 on the CPU: the same seed writes text that is not JSON without the mask and JSON that matches the
schema with it, through `llm.generate`, the `Engine`, and the official `openai` client against a real server.
Grammars are compiled once per module (the llguidance tokenizer for SmolLM2's 49k tokens takes ~0.3 s).
"""
import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest

from minillm.engine.structured import GrammarError, GrammarSource, compile_grammar, constrained_pick, grammar_source

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "legs"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "legs": {"type": "integer", "minimum": 0, "maximum": 8}}}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "animal", "schema": SCHEMA, "strict": False}}
ASK = [{"role": "user", "content": "Describe a cat as a JSON object with its name and number of legs."}]
SEED = 1


def parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def matches_schema(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"name", "legs"} and isinstance(value["name"], str)
            and len(value["name"]) <= 16 and isinstance(value["legs"], int) and 0 <= value["legs"] <= 8)


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    import minillm
    return minillm.load(smollm2_dir)


@pytest.fixture(scope="module")
def animal(llm):
    return llm.grammar(JSON_SCHEMA)


# ---- the mask holds --------------------------------------------------------------------------------------

def test_same_seed_is_not_json_without_the_mask_and_valid_json_with_it(llm):
    free = llm.generate(ASK, max_tokens=48, temperature=1.0, seed=SEED)
    held = llm.generate(ASK, max_tokens=48, temperature=1.0, seed=SEED, response_format=JSON_SCHEMA)
    assert not parses(free.text)                          # the test can fail: unmasked, this seed is not JSON
    assert held.finish_reason == "stop"
    assert matches_schema(json.loads(held.text))


def test_every_token_of_a_hot_sample_is_one_the_grammar_allowed(llm, animal):
    """At temperature 2 nearly any token is likely: each pick still lies inside its step's mask."""
    from minillm.engine.sampling import Sampler, SamplingParams
    state, sampler = animal.start(), Sampler(SamplingParams(temperature=2.0, seed=0))
    rng = np.random.default_rng(0)
    for _ in range(40):
        allowed = state.allowed()
        if state.finished:
            break
        logits = rng.normal(size=llm.config.vocab_size).astype(np.float32) * 5
        token = constrained_pick(sampler, logits, state)
        assert allowed[token]
    assert allowed.sum() < llm.config.vocab_size              # the mask did exclude tokens


def test_regex_choice_and_lark_grammar_through_generate(llm):
    weight = llm.generate("The parcel weighs", max_tokens=12, temperature=1.5, seed=0,
                          structured_outputs={"regex": r" [0-9]{1,3} (kg|g)"})
    assert weight.finish_reason == "stop"
    assert weight.text.split()[0].isdigit() and weight.text.split()[1] in ("kg", "g")
    answer = llm.generate("Is the sky blue?", max_tokens=5, temperature=1.0, seed=0,
                          structured_outputs={"choice": ["yes", "no", "maybe"]})
    assert answer.text in ("yes", "no", "maybe")
    lark = 'start: "colour: " COLOUR\nCOLOUR: "red" | "green" | "blue"'
    colour = llm.generate("Name a colour.", max_tokens=8, temperature=1.0, seed=0,
                          structured_outputs={"grammar": lark})
    assert colour.text in ("colour: red", "colour: green", "colour: blue")


def test_engine_batch_mixes_constrained_and_free_requests(llm, animal):
    from minillm.engine.engine import Engine
    engine = Engine(llm, max_kv_bytes=32 << 20)
    held = engine.add_request(ASK, max_tokens=48, temperature=1.0, seed=SEED, chat=True, grammar=animal)
    free = engine.add_request(ASK, max_tokens=16, temperature=1.0, seed=SEED, chat=True)
    results = {}
    while engine.has_unfinished():
        for event in engine.step():
            results.setdefault(event.request_id, []).append(event.text)
    want = llm.generate(ASK, max_tokens=48, temperature=1.0, seed=SEED, response_format=JSON_SCHEMA)
    assert "".join(results[held]) == want.text                 # the engine samples as generate does
    assert matches_schema(json.loads(want.text))
    assert not parses("".join(results[free]))


@pytest.fixture(scope="module")
def random_llm(tmp_path_factory):
    """A random Llama with a Qwen-style byte-level tokenizer: it likes any token the mask leaves, whitespace too."""
    import minillm
    from hf_models import llama_config, save_random_model
    from tokenizer_corpus import qwen_tokenizer
    path = tmp_path_factory.mktemp("random-json")
    tok = qwen_tokenizer(path)
    save_random_model(llama_config(n_heads=4, n_kv_heads=2, vocab_size=-(-len(tok) // 64) * 64, hidden_size=64,
                                   intermediate_size=128, initializer_range=0.2,
                                   eos_token_id=tok.convert_tokens_to_ids("<|im_end|>")), path)
    return minillm.load(str(path))


def test_json_whitespace_is_bounded_so_a_random_model_closes_its_object(random_llm, monkeypatch):
    """llguidance's JSON allows any run of whitespace between tokens: a random model at temperature 1 writes
    whitespace until max_tokens. Bounded (one space, or a newline and <= 20 of indent), every seed closes."""
    import re

    import minillm.engine.structured as structured
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    asked = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    for seed in range(6):
        answer = random_llm.generate("Is it?", max_tokens=48, temperature=1.0, seed=seed, response_format=asked)
        assert answer.finish_reason == "stop", repr(answer.text)
        assert set(json.loads(answer.text)) == {"ok"}
        assert max(len(gap) for gap in re.findall(r"\s+", answer.text)) <= 21
    monkeypatch.setattr(structured, "bounded_whitespace", lambda schema: schema)     # llguidance's default
    unbounded = [random_llm.generate("Is it?", max_tokens=48, temperature=1.0, seed=seed, response_format=asked)
                 for seed in range(6)]
    assert all(a.finish_reason == "length" and not parses(a.text) for a in unbounded)  # the test can fail


def test_a_grammar_with_no_token_left_ends_the_answer_with_stop(llm, caplog):
    """A state that allows no token (here: a matcher already past an error) ends the choice, logged once."""
    from minillm.engine.generate import generate_ids
    from minillm.engine.sampling import SamplingParams
    grammar = llm.grammar(structured_outputs={"choice": ["yes"]})
    grammar._prototype.consume_token(llm.tokenizer.encode("no")[0])          # a token it does not accept
    with caplog.at_level(logging.WARNING, logger="minillm.engine"):
        g = generate_ids(llm.model, llm.prompt_ids("Hi", chat=False), 8, SamplingParams(), grammar=grammar)
    assert (g.token_ids, g.finish_reason) == ([], "stop")
    assert sum("allows no token" in r.getMessage() for r in caplog.records) == 1


# ---- what is refused ------------------------------------------------------------------------------------

@pytest.mark.parametrize("response_format, structured_outputs, says", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}, None, "Invalid type: strin"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "minLength": 5, "maxLength": 2}}}, None,
     "Unsatisfiable"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "format": "banana"}}}, None,
     "Unknown format: banana"),
    ({"type": "json_schema", "json_schema": {"schema": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                                        "$ref": "#/$defs/a"}}}, None, "refers to itself"),
    ({"type": "xml"}, None, "response_format.type"),
    (None, {"regex": "("}, "unclosed group"),
    (None, {"grammar": "start: foo"}, "unknown name"),
    (None, {"choice": []}, "choice"),
    (None, {"regex": "a", "choice": ["a"]}, "not 2"),
    ({"type": "json_object"}, {"regex": "a"}, "not both"),
])
def test_malformed_grammars_are_refused_naming_the_problem(llm, response_format, structured_outputs, says):
    with pytest.raises(GrammarError, match=says) as refused:
        llm.grammar(response_format, structured_outputs)
    assert refused.value.field == ("structured_outputs" if structured_outputs is not None else "response_format")


def test_a_recursive_schema_is_not_a_cycle(llm):
    tree = {"$defs": {"node": {"type": "object", "properties": {"child": {"$ref": "#/$defs/node"}}}},
            "$ref": "#/$defs/node"}
    assert llm.grammar({"type": "json_schema", "json_schema": {"schema": tree}}) is not None


def test_compiling_is_capped(llm, monkeypatch):
    """A compile that outlasts the cap is refused: here llguidance's matcher is held until the refusal came."""
    import threading
    import llguidance
    release = threading.Event()

    class HeldMatcher:
        def __init__(self, *args, **kwargs):
            release.wait()
    monkeypatch.setattr(llguidance, "LLMatcher", HeldMatcher)
    try:
        with pytest.raises(GrammarError, match="took longer than 0.05 s to compile") as refused:
            compile_grammar(llm.tokenizer, llm.config.vocab_size, GrammarSource("held", "response_format"),
                            timeout_s=0.05)
        assert refused.value.field == "response_format"
    finally:
        release.set()


def test_text_format_is_no_grammar():
    assert grammar_source({"type": "text"}) is None and grammar_source() is None


# ---- through the server and the official client ----------------------------------------------------------

@pytest.fixture(scope="module")
def served(llm):
    openai = pytest.importorskip("openai")
    from minillm.engine.engine import Engine
    from minillm.serve.server import create_app, serve_in_thread
    app = create_app(llm, Engine(llm, max_kv_bytes=32 << 20), "smollm2")
    with serve_in_thread(app) as url:
        yield SimpleNamespace(client=openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120),
                              openai=openai)


def test_openai_client_gets_schema_valid_json(served, llm):
    got = served.client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=48, temperature=1.0,
                                                seed=SEED, response_format=JSON_SCHEMA)
    want = llm.generate(ASK, max_tokens=48, temperature=1.0, seed=SEED, response_format=JSON_SCHEMA)
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == "stop"
    assert matches_schema(json.loads(got.choices[0].message.content))
    free = served.client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=48, temperature=1.0,
                                                 seed=SEED)
    assert not parses(free.choices[0].message.content)


def test_openai_client_streams_vllm_structured_outputs(served):
    stream = served.client.completions.create(model="smollm2", prompt="The parcel weighs", max_tokens=12,
                                              temperature=1.5, seed=0, stream=True,
                                              extra_body={"structured_outputs": {"regex": r" [0-9]{1,3} (kg|g)"}})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.split()[0].isdigit() and text.split()[1] in ("kg", "g")
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_openai_client_gets_400_naming_the_field(served):
    with pytest.raises(served.openai.BadRequestError) as refused:
        served.client.chat.completions.create(
            model="smollm2", messages=ASK, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}})
    assert refused.value.body["param"] == "response_format"
    assert "Invalid type: strin" in refused.value.body["message"]
    with pytest.raises(served.openai.BadRequestError) as refused:
        served.client.completions.create(model="smollm2", prompt="Hi", max_tokens=8,
                                         extra_body={"structured_outputs": {"regex": "("}})
    assert refused.value.body["param"] == "structured_outputs"


def test_a_greedy_request_with_a_grammar_never_takes_the_device_greedy_path(llm, animal, monkeypatch):
    """The runner's greedy pick returns the raw row's argmax, with no mask: a constrained request at temperature 0
    must go through the logits and its sampler (on the GPU the device-side argmax would break the grammar)."""
    from minillm.engine.engine import Engine
    engine = Engine(llm, max_kv_bytes=32 << 20)
    assert engine.device_greedy                           # the CPU runner has the greedy path too
    monkeypatch.setattr(engine.runner, "forward_greedy", lambda chunks: pytest.fail("took the greedy path"))
    [held] = engine.generate([ASK], max_tokens=48, chat=True, grammar=animal)
    assert matches_schema(json.loads(held.text))


def test_cli_generate_follows_a_regex_and_refuses_two_grammars(smollm2_dir):
    from click.testing import CliRunner
    from minillm.cli import cli
    result = CliRunner().invoke(cli, ["generate", "-m", str(smollm2_dir), "--no-chat", "-n", "10", "-t", "1.5",
                                      "--seed", "0", "--regex", "[0-9]{1,3} (kg|g)", "The parcel weighs "])
    assert result.exit_code == 0, result.output
    answer = result.stdout.strip().splitlines()[0]
    assert answer.split()[0].isdigit() and answer.split()[1] in ("kg", "g")
    two = CliRunner().invoke(cli, ["generate", "-m", str(smollm2_dir), "--json", "--choice", "a", "Hi"])
    assert two.exit_code != 0 and "give one of --json, --choice" in two.output
    bad = CliRunner().invoke(cli, ["generate", "-m", str(smollm2_dir), "--regex", "(", "Hi"])
    assert bad.exit_code == 1 and "unclosed group" in bad.output and "Traceback" not in bad.output
