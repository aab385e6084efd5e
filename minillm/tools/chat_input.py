"""What `minillm chat` reads from the terminal: one user message at a time, with line editing and a
history of the chat's messages (Python's `readline`), over several lines when the user asks for them.

A line that ends in a backslash continues on the next line; a paste of several lines is one message
where the terminal supports bracketed paste (readline 8.1 and later turn it on by default).
"""
from __future__ import annotations

import sys

CONTINUE = "\\"           # a line ending in it goes on: the message keeps a newline in its place


def _readline():
    """The readline module when both ends are a terminal (importing it is what gives input() line
    editing and history), else None: piped input stays plain, and some Pythons have no readline."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return None
    try:
        import readline
    except ImportError:
        return None
    return readline


def read_message(prompt: str = "> ", more: str = "... ") -> str | None:
    """The user's next message, or None at an empty line, end of input or Ctrl-C. `more` is the prompt
    of a continuation line."""
    readline = _readline()
    history_before = readline.get_current_history_length() if readline else 0
    lines = []
    try:
        line = input(prompt)
        while line.endswith(CONTINUE):
            lines.append(line[:-len(CONTINUE)])
            line = input(more)
    except (EOFError, KeyboardInterrupt):
        return None
    message = "\n".join(lines + [line])
    if readline and lines:
        _remember_as_one(readline, history_before, message)
    return message if message.strip() else None


def _remember_as_one(readline, history_before: int, message: str) -> None:
    """readline kept each line of a continued message: keep the whole message instead, so the up
    arrow brings it back as it was sent."""
    for index in reversed(range(history_before, readline.get_current_history_length())):
        readline.remove_history_item(index)
    readline.add_history(message)
