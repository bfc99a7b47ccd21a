"""``lit-instruct chat``: driven through stdin; history kept within the context; the commands; Ctrl-C
stops an answer, Ctrl-C and Ctrl-D at the prompt end the chat; line editing on a terminal."""

from __future__ import annotations

import io
import os
import select
import signal
import sys
import time

import pytest
from transformers import TextStreamer

from lit_instruct.cli import main
from lit_instruct.infer.chat import ChatSession, run_chat, scripted_reader
from lit_instruct.infer.generate import generate, load_for_generation


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    return load_for_generation(str(tiny_model_dir))


@pytest.fixture
def sigint_raises_keyboard_interrupt():
    """Python's own SIGINT handler, even where the test runner was started with SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class CtrlCAtToken(TextStreamer):
    """Streams the answer to ``out`` like the chat's streamer, and sends this process a real SIGINT
    (Ctrl-C) right after the ``at``-th token of the first answer has been shown (0: before any)."""

    def __init__(self, tokenizer, out: io.StringIO, at: int) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.out, self.at, self.shown = out, at, -1  # -1: the prompt comes first

    def put(self, value) -> None:
        super().put(value)
        self.shown += 1
        if self.shown == self.at:
            self.at = -1  # once
            signal.raise_signal(signal.SIGINT)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.out.write(text + ("\n" if stream_end else ""))


def test_a_session_answers_like_generate_keeps_history_and_obeys_commands(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    session = ChatSession(model, tokenizer, context_length=2048, max_new_tokens=3)
    out = io.StringIO()
    lines = ["Hi\n", "/system Be brief.\n", "Hello\n", "Again\n", "/bogus\n", "/exit\n", "Never\n"]
    run_chat(session, scripted_reader(lines, out), out)
    text = out.getvalue()
    assert "(system prompt set; conversation cleared)" in text and "(unknown command /bogus;" in text
    assert session.system == "Be brief." and [m["content"] for m in session.history[::2]] == [
        "Hello",
        "Again",
    ]
    first_answer = session.history[1]["content"]
    expected = generate(
        model,
        tokenizer,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        max_new_tokens=3,
    )
    assert first_answer == expected  # same template and decoding as generate
    assert session.messages("Next") == [
        {"role": "system", "content": "Be brief."},
        *session.history,
        {"role": "user", "content": "Next"},
    ]
    run_chat(session, scripted_reader(["/reset\n"], io.StringIO()), io.StringIO())
    assert session.history == []


def test_ctrl_c_mid_answer_keeps_the_part_shown_and_the_chat_goes_on(
    model_and_tokenizer, sigint_raises_keyboard_interrupt
) -> None:
    model, tokenizer = model_and_tokenizer
    session = ChatSession(model, tokenizer, context_length=2048, max_new_tokens=8)
    out = io.StringIO()
    run_chat(session, scripted_reader(["Hi\n", "Again\n"], out), out, CtrlCAtToken(tokenizer, out, at=3))

    hi = [{"role": "user", "content": "Hi"}]
    part = generate(model, tokenizer, hi, max_new_tokens=3)  # greedy: the first 3 tokens of the answer
    assert part != generate(model, tokenizer, hi, max_new_tokens=8)  # so the answer was really cut short
    again = [*hi, {"role": "assistant", "content": part}, {"role": "user", "content": "Again"}]
    answer = generate(model, tokenizer, again, max_new_tokens=8)  # the next answer sees the part
    assert session.history == [*again, {"role": "assistant", "content": answer}]
    text = out.getvalue()
    stopped = "\n(answer stopped; the part shown stays in the conversation)\n> "
    assert f"> {part}{stopped}" in text  # the part shown, then the prompt again
    assert text.endswith("> \n")  # the input's end (Ctrl-D) ends the chat, on a line of its own


def test_ctrl_c_before_the_first_token_drops_the_message(
    model_and_tokenizer, sigint_raises_keyboard_interrupt
) -> None:
    model, tokenizer = model_and_tokenizer
    session = ChatSession(model, tokenizer, context_length=2048, max_new_tokens=8)
    out = io.StringIO()
    run_chat(session, scripted_reader(["Hi\n", "/exit\n"], out), out, CtrlCAtToken(tokenizer, out, at=0))
    assert session.history == []
    assert "> \n(answer stopped; the message is dropped)\n> " in out.getvalue()


def test_ctrl_c_at_the_prompt_ends_the_chat_keeping_what_was_said(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    session = ChatSession(model, tokenizer, context_length=2048, max_new_tokens=2)

    def typed():
        yield "Hi\n"
        raise KeyboardInterrupt  # what input() raises on Ctrl-C

    out = io.StringIO()
    run_chat(session, scripted_reader(typed(), out), out)  # returns: no KeyboardInterrupt escapes
    answer = generate(model, tokenizer, [{"role": "user", "content": "Hi"}], max_new_tokens=2)
    assert out.getvalue().endswith(f"> {answer}\n> \n(chat ended)\n")
    assert [m["content"] for m in session.history] == ["Hi", answer]


class TerminalOutput:
    """What the child wrote to its terminal, read as it comes."""

    def __init__(self, fd: int) -> None:
        self.fd, self.seen, self.cursor = fd, bytearray(), 0

    def wait_for(self, marker: bytes, timeout: float = 60.0) -> None:
        """Read until ``marker`` appears after the previous marker waited for."""
        deadline = time.monotonic() + timeout
        while (found := self.seen.find(marker, self.cursor)) < 0:
            assert time.monotonic() < deadline, f"no {marker!r} in {bytes(self.seen[self.cursor :])!r}"
            if select.select([self.fd], [], [], 1.0)[0]:
                self.seen += os.read(self.fd, 4096)
        self.cursor = found + len(marker)


@pytest.mark.slow  # a subprocess: about 5 s
@pytest.mark.skipif(not hasattr(os, "forkpty"), reason="needs a pseudo-terminal")
def test_the_chat_command_on_a_terminal_edits_lines_recalls_them_and_ends_on_ctrl_c(tiny_model_dir) -> None:
    pytest.importorskip("readline")
    command = [sys.executable, "-m", "lit_instruct", "chat", "--model", str(tiny_model_dir)]
    pid, fd = os.forkpty()
    if pid == 0:  # the child, on the terminal as when a user starts it
        try:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # not ignored, even if it is here
            os.execve(sys.executable, [*command, "--max-new-tokens", "2"], {**os.environ, "TERM": "xterm"})
        finally:
            os._exit(127)
    terminal, status = TerminalOutput(fd), None
    try:
        terminal.wait_for(b"> ")
        os.write(fd, b"/bog\x1b[Dx\r")  # left arrow, then x: /boxg
        terminal.wait_for(b"(unknown command /boxg;")
        terminal.wait_for(b"> ")
        os.write(fd, b"\x1b[A\r")  # up arrow: the line before
        terminal.wait_for(b"(unknown command /boxg;")
        terminal.wait_for(b"> ")
        os.write(fd, b"half a li")  # echoed once readline waits for keys (a signal that comes while it
        terminal.wait_for(b"half a li")  # still sets the prompt up only counts at the next key)
        time.sleep(0.2)
        os.kill(pid, signal.SIGINT)  # what the terminal sends on Ctrl-C
        terminal.wait_for(b"(chat ended)")
        _, status = os.waitpid(pid, 0)
    finally:
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, bytes(terminal.seen)
    assert b"Traceback" not in terminal.seen, bytes(terminal.seen)


def test_the_chat_command_reads_stdin_to_its_end(tiny_model_dir, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n/reset\n"))  # no /exit: the end of input ends it
    main(["chat", "--model", str(tiny_model_dir), "--max-new-tokens", "2"])  # returns: exit status 0
    printed = capsys.readouterr().out
    assert printed.startswith("commands: /reset") and printed.endswith("> (conversation cleared)\n> \n")
