"""The OpenAI wire format `minillm serve` speaks: request schemas, response bodies, error bodies.

Only shapes live here (pydantic models in, plain dicts out); nothing here knows about the engine,
so the server file reads as "parse, submit, stream" and this file as the API reference.
The subset: /v1/completions and /v1/chat/completions with temperature, top_p, max_tokens, stop,
seed and n (up to MAX_CHOICES choices, indexed 0..n-1, streamed chunks carrying their choice's index),
streamed as server-sent events or not, with usage counts (the prompt counted once) and a finish_reason.
"""
from __future__ import annotations

import json
import time
import uuid
from http import HTTPStatus
from typing import Annotated, Literal, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema,
                      field_validator)

MAX_STOP_CHARS = 1000                # one stop string; four of them at most, as OpenAI allows
MAX_SEED = 2 ** 64 - 1               # NumPy's generator takes any seed in 0 .. 2^64 - 1
MAX_CHOICES = 16                     # n: each choice is a running sequence; the default batch holds 32


class ApiError(Exception):
    """A request the server refuses; it becomes OpenAI's error JSON with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---- requests -----------------------------------------------------------------------------------

def _unicode(text: str) -> str:
    # JSON may spell a lone surrogate ("\udfff"): no tokenizer can encode it, so it is the client's error.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text is not valid Unicode (a lone surrogate at character {e.start})") from None
    return text


def _integral(value):
    # JSON Schema's "integer" is any number without a fraction: 16.0 is one, true and "16" are not.
    return int(value) if isinstance(value, float) and value.is_integer() else value


Text = Annotated[str, AfterValidator(_unicode)]
Integer = Annotated[int, BeforeValidator(_integral)]
PositiveInteger = Annotated[int, Field(ge=1), BeforeValidator(_integral)]
# < 2^64 rather than <= 2^64 - 1: the OpenAPI document holds numbers as floats, and 2^64 is one exactly.
Seed = Annotated[int, Field(ge=0, lt=MAX_SEED + 1), BeforeValidator(_integral)]
StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS), AfterValidator(_unicode)]


def served(fact: str):
    """A field whose accepted values only the server knows (its model's name, its template's roles): the
    OpenAPI document gets them from `json_schema(..., facts)`."""
    return Field(json_schema_extra={"x-served": fact})


# `stop` as the OpenAPI document declares it: what the parser takes before _stop_list makes it a list.
_STOP_TEXT = {"type": "string", "maxLength": MAX_STOP_CHARS}
STOP_SCHEMA = {"anyOf": [_STOP_TEXT, {"type": "array", "items": _STOP_TEXT, "maxItems": 4}, {"type": "null"}]}

# The prompt as the OpenAPI document declares it: one text or list of token ids, not empty, alone or in a
# list of one. The parser takes any list, to refuse a batch in words that say why (_one_prompt).
_TOKEN_ID = {"type": "integer", "minimum": 0, "x-served": "token_id"}
PROMPT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": _TOKEN_ID, "minItems": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
    {"type": "array", "items": {"type": "array", "items": _TOKEN_ID, "minItems": 1}, "minItems": 1, "maxItems": 1}]}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False          # one last chunk with the usage counts and no choices


# Fields a request may carry besides the declared ones. Any other field is a 400 naming it: a field minillm
# does not implement is never silently ignored (it would change the answer the client expects).
# Parameters of OpenAI's API minillm does not implement, accepted only as what "not asked for" looks like:
_UNSUPPORTED = {"best_of": (None, 1), "suffix": (None, ""), "tools": (None, []), "modalities": (None, ["text"])}
# Metadata that changes nothing in the answer (OpenAI's clients and SDKs send some of them): accepted, unused.
_METADATA = {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"}
# Fields of the chat endpoint that the completions endpoint accepts and ignores, as OpenAI's does when no tools
# are given (its SDKs send them along): tool calls are the chat endpoint's (ChatCompletionRequest).
_PENDING = {"tool_choice", "parallel_tool_calls"}
MAX_LOGPROBS = 20                    # top alternatives per token, as SamplingParams allows
LogprobCount = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), BeforeValidator(_integral)]


def _declare_extras(accepted_any: set[str], accepted_if: dict[str, tuple]):
    """A json_schema_extra: the OpenAPI document lists the undeclared fields refuse_unsupported lets through
    (any value, or only the "not asked for" ones) and no other (additionalProperties false)."""
    def declare(schema: dict) -> None:
        properties = schema.setdefault("properties", {})
        for name in sorted(accepted_any):
            properties.setdefault(name, {})
        for name, values in accepted_if.items():
            properties.setdefault(name, {"enum": list(values)})
        schema["additionalProperties"] = False
    return declare


# ---- structured output and tool calls (engine/structured.py, engine/tool_calls.py) ------------------------
# Their shapes, declared; what only compiling can tell (a JSON schema that is unsatisfiable or has a $ref cycle,
# a regex or grammar that does not parse, tool_choice naming a function tools lacks) is a 400 "invalid_grammar".

class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchemaSpec(_Closed):
    name: Text | None = None                 # OpenAI's asks for a name; the output does not depend on it
    description: Text | None = None
    schema_: dict | bool = Field({}, alias="schema")
    strict: bool | None = None               # false is enforced all the same, as vLLM does


class TextFormat(_Closed):
    type: Literal["text"]


class JsonObjectFormat(_Closed):
    type: Literal["json_object"]


class JsonSchemaFormat(_Closed):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class StructuredOutputs(_Closed):
    """vLLM's extension: one of these constrains the output (none given: no constraint)."""
    json_: dict | bool | Text | None = Field(None, alias="json")
    regex: Text | None = None
    grammar: Text | None = None               # Lark, or GBNF
    choice: list[Text] | None = None


class FunctionDefinition(_Closed):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]    # OpenAI's rule for a function's name
    description: Text | None = None
    parameters: dict | None = None            # a JSON schema of the arguments
    strict: bool | None = None


class ToolDefinition(_Closed):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Closed):
    name: Text


class NamedToolChoice(_Closed):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Closed):
    name: Text
    arguments: Text                           # a JSON object as text, as OpenAI sends it


class ToolCall(_Closed):
    """An assistant message's earlier call, going back into the chat template."""
    id: Text | None = None
    type: Literal["function"] = "function"
    function: CalledFunction
    index: Integer | None = None              # what a client that accumulated a stream may leave in


def plain(model: BaseModel | None):
    """A declared shape back to the plain JSON it came as (None stays None)."""
    return None if model is None else model.model_dump(by_alias=True, exclude_none=True)


class _Sampling(BaseModel):
    """The fields both endpoints share. Ranges follow OpenAI's API reference."""
    # Undeclared fields are checked by name (refuse_unsupported); declared ones take their JSON type only
    # (strict: no "5" or true for an integer), as OpenAI's API does.
    model_config = ConfigDict(extra="allow", strict=True,
                              json_schema_extra=_declare_extras(_METADATA | _PENDING, _UNSUPPORTED))

    model: Annotated[Text, served("model")]
    max_tokens: PositiveInteger | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)   # OpenAI's default is 1, not greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: Integer = Field(0, ge=0)                    # an extension (vLLM has it too); 0 = off
    ignore_eos: bool = False                           # vLLM's extension for benchmarks: run to max_tokens
    n: Integer = Field(1, ge=1, le=MAX_CHOICES)       # choices of one prompt, prefilled once (engine/choices.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[list[StopText], WithJsonSchema(STOP_SCHEMA)] = []   # a string or a list on the wire
    # The sampling controls (engine/sampling.py says the order they apply in); null is "not asked for".
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)   # vLLM's extension, as HF's
    min_p: float | None = Field(None, ge=0.0, le=1.0)                             # vLLM's extension
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(   # token id (text) -> bias
        None, json_schema_extra={"propertyNames": {"pattern": "^[0-9]+$"}})
    stop_token_ids: list[Annotated[int, Field(ge=0), BeforeValidator(_integral), served("token_id")]] | None = None
    # Structured output (engine/structured.py): OpenAI's field, and vLLM's extension with regex, grammar, choice.
    response_format: Union[TextFormat, JsonObjectFormat, JsonSchemaFormat] | None = None
    structured_outputs: StructuredOutputs | None = None      # vLLM's: json, regex, grammar or choice
    seed: Seed | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
        if isinstance(stops, list) and len(stops) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(stops)}")
        return stops

    @field_validator("stop")
    @classmethod
    def _drop_empty(cls, stops: list[str]) -> list[str]:
        return [s for s in stops if s]

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias):
        for key in bias or {}:
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"the keys are token ids, got {key!r}")
        return bias

    def refuse_unsupported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in _METADATA or name in _PENDING or (name in _UNSUPPORTED and value in _UNSUPPORTED[name]):
                continue
            raise ApiError(400, f"{name} is not supported by minillm serve", param=name, code="unsupported_parameter")

    def controls(self) -> dict:
        """The sampling controls asked for, as SamplingParams' fields (engine/sampling.py)."""
        asked = dict(presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                     repetition_penalty=self.repetition_penalty, min_p=self.min_p,
                     logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
                     stop_token_ids=tuple(self.stop_token_ids) if self.stop_token_ids else None,
                     logprobs=self.token_logprobs())
        return {name: value for name, value in asked.items() if value is not None}

    def token_logprobs(self) -> int | None:
        """How many alternatives per generated token to report (0: the token's own only); None: no logprobs."""
        return None

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """POST /v1/completions: one prompt, as text or as token ids."""
    prompt: Annotated[Union[Text, list[Integer], list[Text], list[list[Integer]]], WithJsonSchema(PROMPT_SCHEMA)]
    max_tokens: PositiveInteger | None = 16          # the legacy endpoint's default
    logprobs: LogprobCount | None = None             # this many alternatives per token
    echo: bool | None = False                        # the prompt (and its logprobs) before the answer

    def token_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        # A list of strings (or of id lists) is a batch of prompts: n>1 by another name.
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError(f"one prompt per request is supported, got {len(prompt)}")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise ValueError("the prompt is empty")
        return prompt


class ContentPart(BaseModel):
    """One part of a message's content in OpenAI's list form; only {"type": "text"} is supported."""
    # The document declares the one part accepted; the parser takes any, to refuse it by name.
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}, "required": ["type", "text"]})
    type: str
    text: Text | None = None


# A message's undeclared fields: those an assistant message from OpenAI's client carries back, accepted when
# empty. Any other is a 400 naming it.
_MESSAGE_EMPTY = {"refusal": (None,), "audio": (None,), "function_call": (None,), "annotations": (None, [])}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True,
                              json_schema_extra=_declare_extras(set(), _MESSAGE_EMPTY))
    role: Annotated[Text, served("role")]      # which roles are known is the chat template's to say
    content: Text | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None   # an assistant's calls, and the id a tool's result answers
    tool_call_id: Text | None = None

    def refuse_unsupported(self, i: int) -> None:
        for name, value in (self.model_extra or {}).items():
            if not (name in _MESSAGE_EMPTY and value in _MESSAGE_EMPTY[name]):
                raise ApiError(400, f"messages.{i}.{name} is not supported by minillm serve", param="messages",
                               code="unsupported_parameter")

    def text(self, i: int) -> str:
        """The message's text: a string, or the text parts of a list of content parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" or part.text is None for part in self.content):
            raise ApiError(400, f"messages.{i}.content: only text content parts are supported", param="messages")
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions: messages rendered through the model's chat template."""
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: PositiveInteger | None = None   # the newer name of max_tokens
    logprobs: bool | None = False                          # each answer token's logprob ...
    top_logprobs: LogprobCount | None = None               # ... and this many alternatives

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, top, info):
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    def token_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        for i, message in enumerate(self.messages):
            message.refuse_unsupported(i)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    # Tool calls (engine/tool_calls.py): the functions the model may call, whether and which it must call.
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def plain_messages(self) -> list[dict]:
        """The messages as the chat template takes them: role, text, and an assistant's tool_calls or a tool
        result's tool_call_id where given."""
        return [{"role": m.role, "content": m.text(i),
                 **({"tool_calls": [plain(c) for c in m.tool_calls]} if m.tool_calls else {}),
                 **({"tool_call_id": m.tool_call_id} if m.tool_call_id is not None else {})}
                for i, m in enumerate(self.messages)]

    def plain_tools(self) -> tuple[list[dict], str | dict | None]:
        """(tools, tool_choice) as plain JSON, for engine/tool_calls.py."""
        choice = plain(self.tool_choice) if isinstance(self.tool_choice, BaseModel) else self.tool_choice
        return [plain(t) for t in self.tools or []], choice


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): a text, or messages through the chat template -> its token ids."""
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"oneOf": [    # one of the two, not null
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}, "not": {"anyOf": [   # tools: messages only
            {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            {"required": ["tools"], "properties": {"tools": {"type": "array"}}}]}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}},
         "not": {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}}}]})
    model: Annotated[Text, served("model")]
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None       # the tokenizer's BOS for a text (default on); never for messages
    add_generation_prompt: bool = True           # messages: end with the assistant's turn opening, as a chat does
    tools: list[ToolDefinition] | None = None    # messages: rendered into the prompt as a chat request renders them

    @field_validator("messages")
    @classmethod
    def _prompt_or_messages(cls, messages, info):
        if (messages is None) == (info.data.get("prompt") is None):
            raise ValueError("give either prompt or messages")
        return messages

    def refuse_unsupported(self) -> None:
        if self.prompt is None and self.messages is None:
            raise ApiError(400, "give either prompt or messages", param="prompt")
        if self.tools is not None and self.messages is None:
            raise ApiError(400, "tools go with messages, not with a prompt", param="tools")
        for i, message in enumerate(self.messages or []):
            message.refuse_unsupported(i)


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape): token ids -> their text."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: Annotated[Text, served("model")] | None = None
    tokens: list[Annotated[int, Field(ge=0), BeforeValidator(_integral), served("token_id")]]

    def refuse_unsupported(self) -> None:
        pass


def tokenized(tokens: list[int], max_model_len: int) -> dict:
    return {"tokens": tokens, "count": len(tokens), "max_model_len": max_model_len}


def parse(schema: type[_Sampling], raw: bytes) -> _Sampling:
    """The request body as `schema`, or an ApiError naming the first bad field."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:             # the parser's depth is bounded by Python's recursion limit
        raise ApiError(400, "the request body nests arrays or objects too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        request = schema.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        # Of a union's alternatives, the one whose own check failed says more than "not a string".
        first = next((err for err in errors if err["type"] == "value_error"), errors[0])
        loc = [part for part in first["loc"] if not _union_tag(part)]
        where = ".".join(str(part) for part in loc)                   # "temperature", "messages.0.role"
        message = first["msg"].removeprefix("Value error, ")
        param = str(loc[0]) if loc else None
        raise ApiError(400, f"{where}: {message}" if where else message, param=param) from None
    request.refuse_unsupported()
    return request


def json_schema(schema: type[BaseModel], facts: dict[str, dict] | None = None) -> dict:
    """`schema` as one self-contained JSON schema (its $defs inlined), for the OpenAPI document; `facts`
    fills in what only the server knows (`served`): {"model": {"enum": ["smollm2"]}, ...}."""
    document = schema.model_json_schema()
    defs = document.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[1]])
            if "x-served" in node:
                node = {**{k: v for k, v in node.items() if k != "x-served"}, **(facts or {}).get(node["x-served"], {})}
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(value) for value in node]
        return node
    return inline(document)


def _union_tag(part) -> bool:
    """pydantic's name for a union alternative in an error's location ("list[int]", "function-after[...]")."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "dict", "list"))


# ---- responses ----------------------------------------------------------------------------------

def new_id(kind: Literal["cmpl", "chatcmpl"]) -> str:
    return f"{kind}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(id: str, model: str, text: str, finish_reason: str | None, counts: dict | None,
               logprobs: dict | None = None) -> dict:
    """A /v1/completions response (counts given) or one streamed chunk of it (counts None); logprobs:
    serve/logprobs.py's, when asked for."""
    body = {"id": id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if counts is not None:
        body["usage"] = counts
    return body


def chat_completion(id: str, model: str, text: str | None, finish_reason: str, counts: dict,
                    logprobs: dict | None = None, tool_calls: list[dict] | None = None,
                    reasoning: str | None = None) -> dict:
    """A /v1/chat/completions response; reasoning: a thinking model's, as `reasoning_content` (vLLM's field)."""
    message = {"role": "assistant", "content": text, **({"tool_calls": tool_calls} if tool_calls else {})}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return {"id": id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message,
                         "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": counts}


def with_choices(bodies: list[dict]) -> dict:
    """One response (or chunk) of n choices from n bodies of one choice each (made by the builders above):
    the first body, its `choices` the bodies' choices indexed 0..n-1."""
    return {**bodies[0], "choices": [{**body["choices"][0], "index": i} for i, body in enumerate(bodies)]}


def chat_chunk(id: str, model: str, delta: dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    """One streamed chunk: the first carries the role, the next ones text, the last the finish."""
    return {"id": id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(id: str, model: str, object: str, counts: dict) -> dict:
    """The extra last chunk `stream_options.include_usage` asks for: no choices, only usage."""
    return {"id": id, "object": object, "created": int(time.time()), "model": model, "choices": [],
            "usage": counts}


def model_list(name: str, created: int, max_model_len: int, vocab_size: int) -> dict:
    """The one model served; max_model_len as vLLM reports it, vocab_size for benchmark clients."""
    card = {"id": name, "object": "model", "created": created, "owned_by": "minillm",
            "max_model_len": max_model_len, "vocab_size": vocab_size}
    return {"object": "list", "data": [card]}


def sse(data: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


SSE_DONE = sse("[DONE]")


# ---- the OpenAPI document ------------------------------------------------------------------------

# Every refusal's body (ApiError.body), as the OpenAPI document declares it.
ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def error_responses(*statuses: int) -> dict:
    """The OpenAPI `responses` of refusals with these statuses, each with OpenAI's error body."""
    return {status: {"description": HTTPStatus(status).phrase,
                     "content": {"application/json": {"schema": ERROR_SCHEMA}}} for status in statuses}
