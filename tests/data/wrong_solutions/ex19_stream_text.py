"""A deliberately wrong solution of exercise 19: it reads completion chunks only (a chat chunk's text is in delta.content).
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""
import json

FAILS_CASE = 'chat: a role chunk first'
SAYS = "expected 'Hello there!'"


def stream_text(body):
    text, finish = "", None
    for line in body.splitlines():
        if line.startswith("data: ") and line.strip() != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                text += choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
    return text, finish
