"""GPT-OSS's tool calls: a harmony message to `functions.NAME` comes back as OpenAI `tool_calls`, the tool's
result goes back through the template's own tool turn, and a required call is held by the grammar."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import minillm
from minillm.engine.reasoning import splitter_for
from minillm.engine.tool_calls import HARMONY, ToolCallStream, parse_tool_calls, tool_syntax
from test_gpt_oss import GPT_OSS_TOOLS, harmony_tokenizer  # noqa: F401  (the fixture: a GPT-OSS dir, o200k_harmony-shaped)

CALL_ANSWERS = [   # the recipient after the channel (harmony's own form) or before it (the template's)
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": [1, 2]}',
    ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", "days": [1, 2]}<|call|>',
]


# A tool the random model can only call in a few tokens: its whitespace is biased away (a random model would
# fill JSON's optional whitespace forever), and the one argument is one of two words.
CITY_TOOL = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {
    "type": "object", "required": ["city"], "additionalProperties": False,
    "properties": {"city": {"enum": ["Paris", "Rome"]}}}}}]


def no_whitespace(tokenizer) -> dict[int, float]:
    return {i: -100.0 for i in range(tokenizer.vocab_size) if not tokenizer.decode([i]).strip()}


@pytest.fixture(scope="module")
def gpt_oss(harmony_tokenizer, tmp_path_factory):   # noqa: F811
    """The fixture's GPT-OSS with room for the template's long system prompt (a 2048-token context)."""
    import shutil
    path = tmp_path_factory.mktemp("gpt-oss-tools") / "model"
    shutil.copytree(harmony_tokenizer[0], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 2048}))
    return minillm.load(str(path), threads=1)


def test_a_harmony_tokenizer_ends_turns_on_return_and_call_not_end(gpt_oss):
    """<|end|> closes the analysis message, and the answer goes on: only <|return|> and <|call|> end it."""
    tok = gpt_oss.tokenizer
    assert {tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")} <= set(tok.eos_ids)
    assert tok.token_to_id("<|end|>") not in tok.eos_ids
    assert tool_syntax(tok) is HARMONY


@pytest.mark.parametrize("answer", CALL_ANSWERS)
def test_a_commentary_call_parses_into_tool_calls_whole_and_streamed(gpt_oss, answer):
    """The call is parsed from the raw answer (LLM.generate), from the split content (the server's answer),
    and from a stream cut every 3 characters through the splitter and ToolCallStream (the server's stream)."""
    expected = [("get_weather", {"city": "Paris", "days": [1, 2]})]
    content, calls = parse_tool_calls(answer, HARMONY)
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == expected
    splitter, stream, said, reasoning, deltas = splitter_for(gpt_oss.tokenizer), ToolCallStream(HARMONY), "", "", []
    for piece in [answer[i:i + 3] for i in range(0, len(answer), 3)] + [None]:
        r, text = splitter.push(piece) if piece is not None else splitter.finish()
        reasoning, said = reasoning + r, said + stream.push(text)
        deltas += stream.deltas()
    rest, last = stream.finish_deltas()
    assert (said + rest).strip() == ""
    assert reasoning == ("Need the weather." if "analysis" in answer else "")
    deltas += last                                   # the name first, then the arguments in pieces
    assert [d["function"].get("name") for d in deltas if "id" in d] == ["get_weather"] and len(deltas) > 2
    assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == expected[0][1]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in stream.finish()[1]] == expected


def test_an_answer_without_a_call_is_its_final_content(gpt_oss):
    answer = "<|channel|>analysis<|message|>Say hi.<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
    assert parse_tool_calls(answer, HARMONY) == ("Hi!", [])


def test_the_tool_result_goes_back_as_harmonys_tool_turn_like_hf(gpt_oss, harmony_tokenizer):   # noqa: F811
    """The model's call, parsed into OpenAI's shape (arguments a JSON string, an id) and sent back with content
    null and the tool's result: it renders as HF's apply_chat_template renders the same conversation on the
    GPT-OSS template (the call as harmony's commentary message, the result as its functions.NAME turn)."""
    from transformers import AutoTokenizer
    content, calls = parse_tool_calls(CALL_ANSWERS[0], HARMONY)
    openai_messages = [{"role": "user", "content": "Weather in Paris?"},
                       {"role": "assistant", "content": content, "tool_calls": calls},
                       {"role": "tool", "tool_call_id": calls[0]["id"], "content": '{"temp": 21}'}]
    hf_messages = [openai_messages[0],
                   {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                       "name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}}]},
                   {"role": "tool", "content": '{"temp": 21}'}]
    hf = AutoTokenizer.from_pretrained(harmony_tokenizer[0])
    expected = hf.apply_chat_template(hf_messages, tools=GPT_OSS_TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>" in expected
    assert gpt_oss.prompt_ids(openai_messages, tools=GPT_OSS_TOOLS) == hf(expected, add_special_tokens=False).input_ids


def test_a_named_tool_choice_makes_a_harmony_call(gpt_oss):
    """tool_choice naming the function: the random model writes that call in harmony's form (the grammar
    holds every token), it ends on <|call|>, and it parses into a call whose arguments fit the schema."""
    tok = gpt_oss.tokenizer
    g = gpt_oss.generate([{"role": "user", "content": "Weather?"}], max_tokens=60, tools=CITY_TOOL,
                         tool_choice={"type": "function", "function": {"name": "get_weather"}},
                         logit_bias=no_whitespace(tok))
    assert g.token_ids[0] == tok.token_to_id("<|channel|>") and g.finish_reason == "stop"
    assert tok.decode(g.token_ids).startswith("<|channel|>commentary to=functions.get_weather <|constrain|>json")
    assert [c["function"]["name"] for c in g.tool_calls] == ["get_weather"]
    assert json.loads(g.tool_calls[0]["function"]["arguments"])["city"] in ("Paris", "Rome")


@pytest.fixture(scope="module")
def served(gpt_oss):
    openai = pytest.importorskip("openai")
    from minillm.engine.engine import Engine
    from minillm.serve.server import create_app, serve_in_thread
    with serve_in_thread(create_app(gpt_oss, Engine(gpt_oss, max_batch=2), "gpt-oss")) as url:
        yield SimpleNamespace(client=openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120))


def test_the_server_returns_a_harmony_call_as_tool_calls_streamed_or_not(served, gpt_oss):
    """Through the official client: the required call comes back as `tool_calls` (finish_reason "tool_calls"),
    the same whole and streamed (its name, then its arguments in pieces), and the conversation goes on with
    the tool's result."""
    ask = dict(model="gpt-oss", messages=[{"role": "user", "content": "Weather?"}], max_tokens=60, temperature=0,
               tools=CITY_TOOL, tool_choice="required", logit_bias=no_whitespace(gpt_oss.tokenizer))
    whole = served.client.chat.completions.create(**ask, logprobs=True).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert whole.logprobs.content[0].token == "<|channel|>"          # what the model wrote: harmony's call
    call = whole.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    chunks = list(served.client.chat.completions.create(**ask, stream=True))
    streamed = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]     # the name, then the pieces
    assert [t.function.name for t in streamed if t.function.name] == ["get_weather"] and len(streamed) > 2
    assert json.loads("".join(t.function.arguments or "" for t in streamed)) == json.loads(call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    again = served.client.chat.completions.create(**dict(ask, tool_choice="auto", max_tokens=4, messages=[
        *ask["messages"], whole.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]))
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
