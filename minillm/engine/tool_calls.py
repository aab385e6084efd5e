"""Tool calls: the tools go into the prompt, the model's tool-call syntax comes back out as OpenAI `tool_calls`.

Three steps, each in the model family's own syntax (`ToolSyntax`, chosen from the tokenizer's special tokens):

* In: the chat template receives `tools` (HF's `apply_chat_template(tools=...)` convention), and assistant
  messages' `tool_calls` and `tool` messages go back into it. A template that renders no tools (SmolLM2's)
  gets them another way rather than losing them: a Hermes-style tools block (`TOOLS_BLOCK`) at the top of
  the system message, earlier calls written into the assistant's text as <tool_call> blocks, and tool
  results as user turns in <tool_response> blocks. Every string of a tool (its description, its schema,
  the arguments, the results) reaches the template as text, never as control tokens (chat_template.py).
* Enforced: tool_choice "required" or a named function compiles a grammar (structured.py) that accepts
  only calls in the family's syntax, each function's arguments following its own JSON schema.
* Out: `parse_tool_calls` cuts the answer into its content and its calls; `ToolCallStream` does the same
  on a stream, holding text back from where a call may start, and gives out each call as OpenAI streams one
  (its id and name, then its arguments' text in pieces) where the call names its function first.

The syntaxes:
    hermes   (Hermes, Qwen, the injected block)  <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    llama3   (Llama 3.1 and later)               {"name": ..., "parameters": {...}}, or after <|python_tag|>
    mistral  (Mistral)                           [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
    harmony  (GPT-OSS)                           <|channel|>commentary to=functions.NAME <|constrain|>json
                                                 <|message|>{...arguments...}<|call|>   (one call a turn)
A harmony call is a message of its own, addressed to the function; the reasoning splitter (reasoning.py)
gives it out in one form (`harmony_call`), which is what is parsed here. Tool results go back through the
template's own `tool` turns (`<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>...`).
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from minillm.engine.reasoning import HARMONY_CALL_END, HarmonySplitter, partial_suffix
from minillm.engine.structured import GrammarError, GrammarSource

TOOL_CHOICES = ("none", "auto", "required")
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")           # OpenAI's rule for a function's name

# The tools block minillm writes into the system message when the chat template renders no tools. It
# follows the Hermes convention (the one Qwen's template writes too), so the call syntax is "hermes".
TOOLS_BLOCK = ("You can call functions to help with the request. Their signatures, as JSON schemas, are "
               "between <tools> and </tools>:\n<tools>\n{tools}\n</tools>\n\nTo call one, answer with a JSON "
               "object of its name and arguments between <tool_call> and </tool_call>:\n<tool_call>\n"
               '{{"name": <function-name>, "arguments": <arguments-as-a-JSON-object>}}\n</tool_call>')


@dataclass(frozen=True)
class ToolSyntax:
    """How one model family writes a tool call."""
    name: str
    start: str                 # the text a call starts with ("" for llama3's bare JSON)
    arguments_key: str         # "arguments", or "parameters" for Llama 3.1


HERMES = ToolSyntax("hermes", "<tool_call>", "arguments")
LLAMA3 = ToolSyntax("llama3", "<|python_tag|>", "parameters")
MISTRAL = ToolSyntax("mistral", "[TOOL_CALLS]", "arguments")
HARMONY = ToolSyntax("harmony", "<|start|>assistant to=functions.", "arguments")   # reasoning.harmony_call's start


def tool_syntax(tokenizer) -> ToolSyntax:
    """The family's syntax, from the tokenizer's special tokens: Mistral's [TOOL_CALLS], Llama 3's
    <|python_tag|> (or its <|eot_id|>), GPT-OSS's harmony <|channel|> and <|call|>, else Hermes (Qwen, and
    every template given the injected block)."""
    special = getattr(tokenizer, "special_tokens", {})
    if "<|channel|>" in special and HARMONY_CALL_END in special:
        return HARMONY
    if "[TOOL_CALLS]" in special:
        return MISTRAL
    if "<|python_tag|>" in special or "<|eot_id|>" in special:
        return LLAMA3
    return HERMES


def renders_tools(template: str | None) -> bool:
    """Does the chat template do something with `tools`? (SmolLM2's never mentions them.)"""
    return bool(template) and re.search(r"\btools\b", template) is not None


# ---- the request's tools, checked ----------------------------------------------------------------------

def check_tools(tools, tool_choice=None, parallel_tool_calls=None) -> tuple[list[dict], str | dict]:
    """(tools as the template takes them, the tool_choice) checked: each function named as OpenAI allows, its
    parameters a JSON schema llguidance can compile; a bad one is a GrammarError naming `tools` or
    `tool_choice`. tool_choice defaults to "auto" with tools and "none" without."""
    import llguidance as llg
    tools = tools or []
    if not isinstance(tools, list):
        raise GrammarError("tools must be a list of functions", "tools")
    checked = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise GrammarError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', "tools")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise GrammarError(f"tools[{i}].function.name must be 1 to 64 letters, digits, _ or -", "tools")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise GrammarError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        error = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_json_schema(parameters))
        if error:
            raise GrammarError(f"tools[{i}].function.parameters is not a valid JSON schema: "
                               f"{error.splitlines()[0][:200]}", "tools")
        if not isinstance(function.get("description", ""), str):
            raise GrammarError(f"tools[{i}].function.description must be a string", "tools")
        checked.append({"type": "function", "function": dict(function, parameters=parameters)})
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise GrammarError("tools: two functions have the same name", "tools")
    choice = tool_choice if tool_choice is not None else ("auto" if checked else "none")
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        wanted = function.get("name") if isinstance(function, dict) else None
        if wanted not in names:
            raise GrammarError(f"tool_choice names the function {wanted!r}, which is not in tools", "tool_choice")
    elif choice not in TOOL_CHOICES:
        raise GrammarError(f'tool_choice must be "none", "auto", "required" or {{"type": "function", ...}}, '
                           f"got {choice!r}", "tool_choice")
    elif choice == "required" and not checked:
        raise GrammarError('tool_choice "required" needs at least one tool', "tool_choice")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise GrammarError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    return checked, choice


# ---- into the prompt ------------------------------------------------------------------------------------

def messages_with_tools(template: str | None, messages: list[dict], tools: list[dict]) -> tuple[list[dict], dict]:
    """(messages, extra template variables) for rendering a chat with `tools` (already checked).

    A template that renders tools gets them as `tools=`, and the messages as they are, with each call's
    arguments as a JSON object (OpenAI sends a string; HF's templates expect a mapping). One that renders
    none gets the Hermes-style block in its system message, and calls and results written as text."""
    messages = [_arguments_as_objects(m) for m in messages]
    if renders_tools(template):
        return messages, ({"tools": tools} if tools else {})
    plain = [_as_plain_turn(m) for m in messages]
    if not tools:
        return plain, {}
    block = TOOLS_BLOCK.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if plain and plain[0]["role"] == "system":
        return [dict(plain[0], content=f"{plain[0]['content']}\n\n{block}")] + plain[1:], {}
    return [{"role": "system", "content": block}] + plain, {}


def uses_tools(messages) -> bool:
    """Does a conversation hold tool calls or tool results (which a tools-blind template must get as text)?"""
    return isinstance(messages, list) and any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool")
                                              for m in messages)


def _arguments_as_objects(message: dict) -> dict:
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not calls or not isinstance(calls, list):
        return message
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise GrammarError("a message's tool_calls must be [{\"type\": \"function\", \"function\": {\"name\": "
                               "..., \"arguments\": ...}}, ...]", "messages")
        function = dict(call["function"])
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass                           # not JSON: the template gets the string as sent
        out.append(dict(call, function=function))
    return dict(message, tool_calls=out)


def _as_plain_turn(message: dict) -> dict:
    """A turn a tools-blind template can render: calls written in the assistant's text, results as a user
    turn, both in the Hermes tags the injected block describes."""
    role, content = message["role"], message.get("content") or ""
    rest = {k: v for k, v in message.items() if k not in ("role", "content", "tool_calls", "tool_call_id")}
    if role == "assistant" and message.get("tool_calls"):
        calls = [f"<tool_call>\n{json.dumps(_call_json(c), ensure_ascii=False)}\n</tool_call>"
                 for c in message["tool_calls"]]
        return {**rest, "role": "assistant", "content": "\n".join(([content] if content else []) + calls)}
    if role == "tool":
        return {**rest, "role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    return {**rest, "role": role, "content": message.get("content")}


def _call_json(call: dict) -> dict:
    function = call.get("function") or {}
    return {"name": function.get("name"), "arguments": function.get("arguments", {})}


# ---- enforced -------------------------------------------------------------------------------------------

def tool_grammar(tools: list[dict], tool_choice, parallel: bool, syntax: ToolSyntax,
                 special_ids: dict[str, int]) -> GrammarSource | None:
    """The grammar that makes the answer tool calls (tool_choice "required": any of the tools; a named one:
    that function), in the family's syntax, each call's arguments following its function's schema; None for
    "auto" and "none" (the model chooses)."""
    import llguidance as llg
    if not isinstance(tool_choice, dict) and tool_choice != "required":
        return None
    if isinstance(tool_choice, dict):
        tools = [t for t in tools if t["function"]["name"] == tool_choice["function"]["name"]]
    rules, calls = [], []
    for i, tool in enumerate(tools):
        function = tool["function"]
        head = json.dumps({"name": function["name"]})[:-1] + f', "{syntax.arguments_key}": '
        rules.append(f"call_{i}: {json.dumps(head)} args_{i} \"}}\"")
        rules.append(f"args_{i}: %json {json.dumps(_compact(function['parameters']))}")
        calls.append(f"call_{i}")
    one = " | ".join(calls)
    if syntax is MISTRAL:
        marker = f"<[{special_ids['[TOOL_CALLS]']}]>"
        body = f'"[" call ("," " " call)* "]"' if parallel else '"[" call "]"'
        start = f"start: {marker} {body}"
    elif syntax is LLAMA3:                 # one call per answer: Llama 3.1's JSON form takes no second one
        start = "start: call"
    elif syntax is HARMONY:                # one call a turn: <|call|> ends it
        token = {name: f"<[{special_ids[name]}]>" for name in ("<|channel|>", "<|constrain|>", "<|message|>")}
        rules = [f"call_{i}: {json.dumps(tool['function']['name'])} \" \" {token['<|constrain|>']} \"json\" "
                 f"{token['<|message|>']} args_{i}" for i, tool in enumerate(tools)] + \
                [f"args_{i}: %json {json.dumps(_compact(tool['function']['parameters']))}" for i, tool in enumerate(tools)]
        start = (f'start: {token["<|channel|>"]} "commentary to=functions." call '
                 f'<[{special_ids[HARMONY_CALL_END]}]>')
    else:                                  # Hermes/Qwen: the tags are tokens of their own in Qwen's vocabulary
        tag = {m: f"<[{special_ids[m]}]>" if m in special_ids else json.dumps(m) for m in ("<tool_call>", "</tool_call>")}
        block = f'{tag["<tool_call>"]} "\\n" call "\\n" {tag["</tool_call>"]}'
        start = f'start: {block} ("\\n" {block})*' if parallel else f"start: {block}"
    lark = "\n".join([start, f"call: {one}", *rules])
    return GrammarSource(llg.grammar_from("lark", lark), "tool_choice")


def _compact(schema: dict) -> dict:
    """The arguments' schema with JSON's separators fixed (", " and ": ", no other whitespace): a forced call
    cannot then run on in blanks, which a weak or hot model otherwise does until max_tokens (llguidance's
    x-guidance options)."""
    separators = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return dict(schema, **{"x-guidance": separators})


# ---- out of the answer ----------------------------------------------------------------------------------

def parse_tool_calls(text: str, syntax: ToolSyntax) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of an answer: the calls in OpenAI's shape ({"id", "type": "function", "function":
    {"name", "arguments": a JSON string}}), the text before the first as content (None if empty). An answer
    whose calls do not parse is all content, as vLLM's parsers leave it."""
    found = _find_calls(text, syntax)
    if found is None:
        return text, []
    content, objects = found
    calls = []
    for obj in objects:
        arguments = obj.get(syntax.arguments_key, obj.get("arguments", obj.get("parameters", {})))
        if not isinstance(obj.get("name"), str):
            return text, []
        calls.append({"id": f"call_{secrets.token_hex(12)}", "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}})
    content = content.strip()
    return (content or None), calls


def _find_calls(text: str, syntax: ToolSyntax) -> tuple[str, list[dict]] | None:
    """(text before the calls, the calls' JSON objects), or None if the text holds no call that parses."""
    if syntax is HARMONY:
        return _harmony_calls(text)
    if syntax is HERMES:
        blocks = re.findall(r"<tool_call>\s*(.*?)\s*(</tool_call>|$)", text, re.S)
        objects = [_json_object(b if closed else _without_partial_close(b)) for b, closed in blocks]
        if blocks and objects[-1] is None and not blocks[-1][1] and len(blocks) > 1:
            objects.pop()                  # an unclosed last call cut off by max_tokens: the ones before stand
        if not blocks or any(o is None for o in objects):
            return None
        return text[:text.index("<tool_call>")], objects
    if syntax is MISTRAL:
        if "[TOOL_CALLS]" not in text:
            return None
        before, _, after = text.partition("[TOOL_CALLS]")
        try:
            value = json.loads(after.strip())
        except ValueError:
            return None
        objects = value if isinstance(value, list) else [value]
        return (before, objects) if all(isinstance(o, dict) for o in objects) else None
    before, tag, after = text.partition("<|python_tag|>")             # llama3: tagged, or bare JSON
    candidate = after if tag else text
    if not tag and not candidate.lstrip().startswith("{"):
        return None
    objects = [_json_object(part) for part in candidate.split(";") if part.strip()] if tag else [_json_object(candidate)]
    if not objects or any(o is None or "name" not in o for o in objects):
        return None
    return (before if tag else ""), objects


def _harmony_calls(text: str) -> tuple[str, list[dict]] | None:
    """GPT-OSS: the messages addressed to a function, as the reasoning splitter gives them out (a raw answer is
    put through it first: its analysis is reasoning, neither content nor a call)."""
    splitter = HarmonySplitter()
    content = splitter.push(text)[1] + splitter.finish()[1]
    header = re.escape(HARMONY.start) + r"([A-Za-z0-9_.-]+)<\|channel\|>\w+ json<\|message\|>"
    found = list(re.finditer(header + r"(.*?)(?:" + re.escape(HARMONY_CALL_END) + "|$)", content, re.S))
    objects = [_json_object(m.group(2)) for m in found]
    if not found:
        return content, []             # the answer's content, its analysis left out
    if any(o is None for o in objects):
        return None
    return content[:found[0].start()], [{"name": m.group(1), "arguments": o} for m, o in zip(found, objects)]


def _without_partial_close(text: str) -> str:
    """An unclosed last call's text less the start of its closing tag (max_tokens cut "</tool_call>" short)."""
    for n in range(len("</tool_call>") - 1, 0, -1):
        if text.endswith("</tool_call>"[:n]):
            return text[:-n]
    return text


def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text.strip())
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class _Streamed:
    """How a syntax's calls stream: each starts with `start` (or, `scanned`, each is one JSON object of the text
    after `start`, found by _json_calls); `head` matches what comes before its arguments (the name in group 1,
    a JSON string if `json_name`); `close` ends it; `braced`: the arguments sit inside the call's own {...},
    whose "}" is not theirs."""
    start: str
    head: re.Pattern
    close: str
    braced: bool
    json_name: bool
    scanned: bool = False


def _json_head(arguments_key: str) -> re.Pattern:
    """A JSON call object's start up to its arguments: {"name": "...", "<arguments_key>": """
    return re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"' + arguments_key + r'"\s*:\s*')


_STREAMED = {   # each syntax whose call names its function before the arguments
    "hermes": _Streamed("<tool_call>", _json_head("arguments"), "</tool_call>", braced=True, json_name=True),
    "harmony": _Streamed(HARMONY.start, re.compile(r"([A-Za-z0-9_.-]+)<\|channel\|>\w+ json<\|message\|>\s*"),
                         HARMONY_CALL_END, braced=False, json_name=False),    # as the reasoning splitter gives it
    "llama3": _Streamed(LLAMA3.start, _json_head("parameters"), "", braced=False, json_name=True, scanned=True),
    "mistral": _Streamed(MISTRAL.start, _json_head("arguments"), "", braced=False, json_name=True, scanned=True),
}


def _json_calls(text: str) -> list[tuple[str, bool]]:
    """The call objects of Llama 3.1's "{...}; {...}" or Mistral's "[{...}, {...}]" so far: each one's text from
    its "{" up to (not with) its closing "}", and whether that "}" has come. Braces inside strings don't count."""
    outer = 1 if text.lstrip().startswith("[") else 0      # Mistral's calls sit one level down, in a list
    calls, depth, in_string, escaped, begin = [], 0, False, False, None
    for i, ch in enumerate(text):
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            begin = i if ch == "{" and depth == outer else begin
            depth += 1
        elif ch in "}]":
            depth -= 1
            if ch == "}" and depth == outer and begin is not None:
                calls.append((text[begin:i], True))
                begin = None
    return calls + ([(text[begin:], False)] if begin is not None else [])


def _value_end(text: str) -> int | None:
    """Where the JSON value `text` opens with ends (after its closing bracket), None while it is open."""
    ends = _json_calls("[" + text + "]") if text.startswith("{") else []
    return len(ends[0][0]) + 1 if ends and ends[0][1] else None        # + its closing "}"


class ToolCallStream:
    """Streams an answer's content while holding back, from where a tool call may start, what may be one.
    Calls stream as OpenAI streams them (`deltas`): a call's id and name as soon as they are written, then its
    arguments' text piece by piece; a call that names its arguments first comes whole at the end
    (`finish_deltas`).
    `finish` parses what was held: -> (content left to send, tool_calls)."""

    def __init__(self, syntax: ToolSyntax):
        self.syntax = syntax
        self.sent, self.held = "", ""
        self.calling = False           # a call's start was seen: everything from there is held
        self.streaming: list[str] = []     # each call announced so far (index k): the arguments' text sent
        self._deltas: list[dict] = []

    def push(self, text: str) -> str:
        """More of the answer; -> the content that can go to the client now."""
        self.held += text
        if not self.calling:
            start = self._call_start()
            if start is not None:
                self.calling = True
                out, self.held = self.held[:start], self.held[start:]
                self.sent += out
                self._follow()
                return out
            keep = self._maybe_start()          # a tail that may grow into a call's start
            out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
            self.sent += out
            return out
        self._follow()
        return ""

    def deltas(self) -> list[dict]:
        """The `delta.tool_calls` entries ready to send: a call's {index, id, type, function: {name, arguments:
        ""}}, then {index, function: {arguments: the next piece}}."""
        out, self._deltas = self._deltas, []
        return out

    def finish(self) -> tuple[str, list[dict]]:
        content, calls = parse_tool_calls(self.sent + self.held, self.syntax)
        if not calls:
            held, self.held = self.held, ""
            return held, []
        return "", calls

    def finish_deltas(self) -> tuple[str, list[dict]]:
        """The end of the answer -> (content left to send, the last `delta.tool_calls` entries: the rest of the
        calls being streamed, and whole the ones that were not)."""
        if not self.streaming:
            rest, calls = self.finish()
            return rest, [dict(call, index=k) for k, call in enumerate(calls)]
        self._follow(final=True)
        return "", self.deltas()

    @property
    def called(self) -> bool:
        """Some call has been announced: the answer's finish_reason is "tool_calls"."""
        return bool(self.streaming)

    def _follow(self, final: bool = False) -> None:
        """Announce each call whose name has arrived, in order, and send its arguments' new text, less what may
        yet turn out to close the call (whitespace, a partial close tag, the call object's "}").
        final: the answer ended, so an unclosed call is closed; one that could not stream comes whole."""
        how = _STREAMED.get(self.syntax.name)
        if how is None:
            return
        for k, (body, closed) in enumerate(self._calls_so_far(how)):
            closed = closed or final
            head = how.head.match(body)
            if k >= len(self.streaming):
                if head is None or k > len(self.streaming):   # "arguments" first, or after such a call: whole
                    if final and (whole := self._whole_call(how, body)):
                        self._deltas.append(dict(whole, index=k))
                    continue
                self.streaming.append("")
                name = json.loads(head.group(1)) if how.json_name else head.group(1)
                self._deltas.append({"index": k, "id": f"call_{secrets.token_hex(12)}", "type": "function",
                                     "function": {"name": name, "arguments": ""}})
            arguments = body[head.end():]
            if how.scanned:               # the arguments end where their own value does (the call's "}" is not in body)
                arguments = arguments[:_value_end(arguments) or len(arguments)]
            elif not closed:
                arguments = arguments[:len(arguments) - partial_suffix(arguments, how.close)]
            arguments = arguments.rstrip()
            if how.braced and arguments.endswith("}"):
                arguments = arguments[:-1].rstrip()
            sent = self.streaming[k]
            if len(arguments) > len(sent) and arguments.startswith(sent):
                self._deltas.append({"index": k, "function": {"arguments": arguments[len(sent):]}})
                self.streaming[k] = arguments

    def _calls_so_far(self, how: _Streamed) -> list[tuple[str, bool]]:
        """Each call written so far: (its text up to its close, whether the close has come)."""
        if how.scanned:          # held opens with the start tag, or (Llama 3.1) with the bare JSON call
            return _json_calls(self.held[len(how.start):] if self.held.startswith(how.start) else self.held)
        return [(part.split(how.close, 1)[0], how.close in part) for part in self.held.split(how.start)[1:]]

    def _whole_call(self, how: _Streamed, body: str) -> dict | None:
        """A call that could not stream, parsed whole (None if it does not parse)."""
        text = how.start + (body + "}" if how.scanned else body + how.close)
        calls = parse_tool_calls(text, self.syntax)[1]
        return calls[0] if calls else None

    def _call_start(self) -> int | None:
        i = self.held.find(self.syntax.start) if self.syntax.start else -1
        if i >= 0:
            return i
        if self.syntax is LLAMA3 and not self.sent and self.held.lstrip().startswith("{"):
            return 0                    # Llama 3.1's bare JSON call: an answer that opens with "{"
        return None

    def _maybe_start(self) -> int:
        if self.syntax is LLAMA3 and not self.sent and not self.held.strip():
            return len(self.held)       # only whitespace so far: a bare JSON call may still come
        marker = self.syntax.start
        for n in range(min(len(marker) - 1, len(self.held)), 0, -1):
            if self.held.endswith(marker[:n]):
                return n
        return 0
