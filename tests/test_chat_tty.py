"""`minillm chat` in a real terminal (a pseudo-terminal): the arrow keys edit the line and recall earlier
messages, a line ending in a backslash goes on, and a bracketed paste of several lines is one message."""
import json
import os
import pty
import select
import signal
import sys
import time
from pathlib import Path

import pytest

from hf_models import llama_config, save_random_model

REPO = Path(__file__).resolve().parents[1]
UP, LEFT = "\x1b[A", "\x1b[D"
PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"        # what a terminal sends around a paste

# The child: `minillm chat` as the console script runs it, with LLM.generate wrapped to log each user
# message the model is asked to answer (one JSON line per answer).
CHILD = """
import json, sys
import minillm.llm
from minillm.cli import main
real, log = minillm.llm.LLM.generate, sys.argv[1]
def logged(self, messages, **options):
    with open(log, "a") as f:
        f.write(json.dumps(messages[-1]["content"]) + "\\n")
    return real(self, messages, **options)
minillm.llm.LLM.generate = logged
sys.argv = ["minillm", "chat", "-m", sys.argv[2], "-n", "1", "--threads", "1"]
main()
"""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_dir):
    """A random 2-layer model that speaks SmolLM2's vocabulary (and has its chat template)."""
    from minillm.checkpoints.tokenizer_files import save_hf, tokenizer_from_hf
    path = tmp_path_factory.mktemp("tiny")
    save_random_model(llama_config(vocab_size=49152, num_hidden_layers=2, max_position_embeddings=256), path)
    save_hf(tokenizer_from_hf(smollm2_dir), path)
    return path


class Terminal:
    """A child process on a pseudo-terminal, its controlling terminal as in a real session: type into it,
    wait for what it prints."""

    def __init__(self, argv, env):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:                                      # the child: become the command
            try:
                os.chdir(REPO)
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)                                  # never back into pytest's code
        self.seen, self.code = b"", None

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait_for(self, text: str, deadline_s: float = 120) -> str:
        """Read until `text` shows; -> what came before it (a deadline, not a timing check: it only keeps a
        broken chat from hanging the suite)."""
        end = time.monotonic() + deadline_s
        while text.encode() not in self.seen:
            assert time.monotonic() < end and self.running(), \
                f"never printed {text!r}; got {self.seen.decode(errors='replace')!r}"
            if select.select([self.fd], [], [], 0.2)[0]:
                try:
                    self.seen += os.read(self.fd, 4096)
                except OSError:          # the child closed its end
                    pass
        before, _, self.seen = self.seen.partition(text.encode())
        return before.decode(errors="replace")

    def running(self) -> bool:
        if self.code is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.code = os.waitstatus_to_exitcode(status)
        return self.code is None

    def exit_code(self, deadline_s: float = 60) -> int | None:
        """The child's exit code once it ends (None if it has not by the deadline)."""
        end = time.monotonic() + deadline_s
        while self.running() and time.monotonic() < end:
            if select.select([self.fd], [], [], 0.2)[0]:
                try:
                    self.seen += os.read(self.fd, 4096)
                except OSError:
                    pass
        return self.code

    def kill(self) -> None:
        if self.running():
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


def test_chat_edits_lines_recalls_messages_and_joins_continued_lines(tiny_model, tmp_path):
    log = tmp_path / "messages.jsonl"
    env = dict(os.environ, TERM="xterm", INPUTRC=os.devnull, HOME=str(tmp_path),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    chat = Terminal([sys.executable, "-c", CHILD, str(log), str(tiny_model)], env)

    def answer(keys: str) -> tuple[str, str]:
        """Type `keys`; -> what the model was asked to answer, and what the terminal showed until the next prompt."""
        chat.type(keys)
        shown = chat.wait_for("]\r\n> ")              # the timings line after an answer, then the next prompt
        return json.loads(log.read_text().splitlines()[-1]), shown

    try:
        chat.wait_for("at the prompt ends.\r\n> ")
        assert answer("hello there\r")[0] == "hello there"
        assert answer(UP + "\r")[0] == "hello there"                         # recalled from the history
        assert answer("the cat st" + LEFT + "a\r")[0] == "the cat sat"       # edited in place
        message, shown = answer("first line \\\rsecond line\r")
        assert message == "first line \nsecond line" and "\r\n... second line" in shown   # one message, two lines
        assert answer(UP + "\r")[0] == "first line \nsecond line"            # and it comes back whole
        assert answer(PASTE_START + "pasted one\npasted two" + PASTE_END + "\r")[0] == "pasted one\npasted two"
        chat.type("\r")                                                      # an empty line ends the chat
        assert chat.exit_code() == 0, chat.seen.decode(errors="replace")
    finally:
        chat.kill()
    assert len(log.read_text().splitlines()) == 6                            # nothing else reached the model
