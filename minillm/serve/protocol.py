"""The OpenAI wire format `minillm serve` speaks: request schemas, response bodies, error bodies.

Only shapes live here (pydantic models in, plain dicts out); nothing here knows about the engine,
so the server file reads as "parse, submit, stream" and this file as the API reference.
The subset: /v1/completions and /v1/chat/completions with temperature, top_p, max_tokens, stop,
seed and n=1, streamed as server-sent events or not, with usage counts and a finish_reason.
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


# Parameters of OpenAI's API that would change the output and that minillm does not implement:
# refused with a 400 rather than silently ignored. The value is what "not asked for" looks like.
_UNSUPPORTED = {"best_of": (None, 1), "echo": (None, False), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
                "suffix": (None, ""), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
                "logit_bias": (None, {}), "tools": (None, []), "response_format": (None, {"type": "text"})}


class _Sampling(BaseModel):
    """The fields both endpoints share. Ranges follow OpenAI's API reference."""
    # Unknown fields are ignored, as OpenAI's clients expect; known ones take their JSON type only (strict:
    # no "5" or true for an integer), as OpenAI's API does.
    model_config = ConfigDict(extra="allow", strict=True)

    model: Annotated[Text, served("model")]
    max_tokens: PositiveInteger | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)   # OpenAI's default is 1, not greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: Integer = Field(0, ge=0)                    # an extension (vLLM has it too); 0 = off
    ignore_eos: bool = False                           # vLLM's extension for benchmarks: run to max_tokens
    n: Integer = Field(1, json_schema_extra={"minimum": 1, "maximum": 1})
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[list[StopText], WithJsonSchema(STOP_SCHEMA)] = []   # a string or a list on the wire
    seed: Seed | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported, got n={n}")
        return n

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

    def refuse_unsupported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in _UNSUPPORTED and value not in _UNSUPPORTED[name]:
                raise ApiError(400, f"{name} is not supported by minillm serve", param=name,
                               code="unsupported_parameter")

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """POST /v1/completions: one prompt, as text or as token ids."""
    prompt: Annotated[Union[Text, list[Integer], list[Text], list[list[Integer]]], WithJsonSchema(PROMPT_SCHEMA)]
    max_tokens: PositiveInteger | None = 16          # the legacy endpoint's default

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Annotated[Text, served("role")]      # which roles are known is the chat template's to say
    content: Text | list[ContentPart] | None = None

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

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def plain_messages(self) -> list[dict]:
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]


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


def completion(id: str, model: str, text: str, finish_reason: str | None, counts: dict | None) -> dict:
    """A /v1/completions response (counts given) or one streamed chunk of it (counts None)."""
    body = {"id": id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
    if counts is not None:
        body["usage"] = counts
    return body


def chat_completion(id: str, model: str, text: str, finish_reason: str, counts: dict) -> dict:
    return {"id": id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": counts}


def chat_chunk(id: str, model: str, delta: dict, finish_reason: str | None) -> dict:
    """One streamed chunk: the first carries the role, the next ones text, the last the finish."""
    return {"id": id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


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
