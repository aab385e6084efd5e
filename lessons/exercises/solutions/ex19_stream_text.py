"""Exercise 19 (lesson 19): read a streamed answer of an OpenAI-compatible server.

Reference solution (for teachers; never in the handout). The stub is lessons/exercises/ex19_stream_text.py.

Write `stream_text` below, then check it:
    minillm exercise check 19         (in a clone: pytest lessons/exercises --exercise 19)
The grader compares it with the engine's `minillm.tools.serve_client_bench.stream_text` (the reader that
`minillm bench serve --url` times requests with) on bodies shaped like what `minillm serve` sends.
"""
import json   # noqa: F401  (you will want it)


def stream_text(body: str) -> tuple[str, str | None]:
    """The answer in the body of a streamed /v1/completions or /v1/chat/completions response.

    body     the whole response body, as text: server-sent events (SSE), for example
                 data: {"choices": [{"index": 0, "text": "Once", "finish_reason": null}]}
                 <blank line>
                 data: {"choices": [{"index": 0, "text": " upon", "finish_reason": "length"}]}
                 <blank line>
                 data: [DONE]
                 <blank line>
    returns  (text, finish_reason): every chunk's new text joined in order, and the last
             finish_reason a chunk carries ("stop", "length"; None if no chunk has one)

    The rules of the format, all of which the cases use:
    * each event here is one line starting with "data:", then its payload (after one space);
      lines are separated by "\\n" or by "\\r\\n"; an event ends with a blank line;
    * a line starting with ":" is a comment (a keep-alive), not data: skip it, and skip blank lines;
    * `data: [DONE]` ends the stream: it is not JSON;
    * a completion chunk carries its text in choices[0]["text"]; a chat chunk in
      choices[0]["delta"]["content"], and its first delta has only the role (content "");
      the finish chunk's delta is {} (no content at all);
    * with stream_options.include_usage, the last chunk before [DONE] has "choices": [] and a "usage".
    """
    text, finish = "", None
    for line in body.splitlines():                               # "\n" and "\r\n" alike
        line = line.strip()
        if not line.startswith("data:"):
            continue                                             # blank lines, ": keep-alive" comments
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        choices = json.loads(payload).get("choices") or []
        if not choices:
            continue                                             # the usage chunk
        choice = choices[0]
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        finish = choice.get("finish_reason") or finish
    return text, finish


if __name__ == "__main__":   # `python lessons/exercises/ex19_stream_text.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(19, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
