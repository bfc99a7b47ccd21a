"""``lit-instruct chat``: a multi-turn terminal chat with a model (and adapter), answers streamed.

Prompts are rendered with the template training used
(:func:`~lit_instruct.templates.resolve_chat_template`). The history is kept within the model's
context: when the rendered conversation plus the answer's token budget would not fit, the oldest
exchanges are left out (the system prompt stays), with their images. Commands: ``/reset`` forgets
the history, ``/system TEXT`` sets the system prompt (and resets), ``/image PATH`` shows an image
with the next message (a vision-language model; ``--image`` does so for the first), ``/exit`` ends.

Keys: Ctrl-C during an answer stops it and returns to the prompt; the part shown stays in the
conversation (an answer stopped before its first token is dropped with its message). Ctrl-C or Ctrl-D
at the prompt ends the chat (exit status 0). On a terminal the prompt has line editing and this
session's history (``readline``: arrow keys, Ctrl-R); no history file is written.

Generation runs in the calling (main) thread, streaming through a streamer called between decoding
steps, so the KeyboardInterrupt of Ctrl-C is raised there: no background thread is left running.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable
from typing import Any, TextIO

from lit_instruct.infer.generate import generate, open_images
from lit_instruct.models.generation import prompt_inputs
from lit_instruct.templates import resolve_chat_template

HELP = (
    "commands: /reset (forget the conversation), /system TEXT (set the system prompt), "
    "/image PATH (show an image with the next message), /exit"
)
KEYS = (
    "Ctrl-C stops an answer (the part shown stays in the conversation); "
    "Ctrl-C or Ctrl-D at the prompt ends the chat"
)
PROMPT = "> "

Reader = Callable[[str], str]
"""Reads one line like :func:`input`: shows the prompt, returns the line, raises EOFError at the end."""


class AnswerStopped(KeyboardInterrupt):
    """Ctrl-C stopped an answer; ``answer`` is the part produced before it ('' if none)."""

    def __init__(self, answer: str) -> None:
        super().__init__(answer)
        self.answer = answer


class _AnswerTokens:
    """A streamer that keeps the answer's token ids (everything after the prompt) as generation
    produces them, and passes every chunk on to ``then``."""

    def __init__(self, then: Any = None) -> None:
        self.then = then
        self.ids: list[int] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        """Called by ``generate``: first with the prompt, then with each new token."""
        if self._prompt_seen:
            self.ids.extend(value.reshape(-1).tolist())
        self._prompt_seen = True
        if self.then is not None:
            self.then.put(value)

    def end(self) -> None:
        """Called by ``generate`` at the end (and by :meth:`ChatSession.reply` when stopped)."""
        if self.then is not None:
            self.then.end()


class ChatSession:
    """A conversation with ``model``: the system prompt and the exchanges so far.

    Args:
        model: a causal LM (with or without an adapter) in eval mode.
        tokenizer: its tokenizer.
        context_length: tokens the model takes (prompt and answer).
        max_new_tokens: tokens reserved for each answer.
        chat_template: the template override used in training, if any.
        system: a system prompt.
        processor: a vision-language model's processor (its template, and images), if any.
        images: images shown with the first message.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        context_length: int,
        max_new_tokens: int = 256,
        chat_template: str | None = None,
        system: str | None = None,
        processor: Any = None,
        images: list[Any] | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.max_new_tokens = max_new_tokens
        self.processor = processor
        if processor is not None:
            chat_template = chat_template or getattr(processor, "chat_template", None)
        self.chat_template = resolve_chat_template(tokenizer, chat_template)
        self.system = system
        self.history: list[dict[str, Any]] = []
        self.pending_images: list[Any] = list(images or [])
        if self.pending_images and processor is None:
            raise ValueError("images need a vision-language model's processor")

    def prompt_tokens(self, messages: list[dict[str, Any]]) -> int:
        """Tokens of ``messages`` rendered with the generation prompt (each image as many as the
        processor expands it to)."""
        inputs = prompt_inputs(self.tokenizer, messages, self.chat_template, self.processor)
        return int(inputs["input_ids"].shape[1])

    def user_message(self, user: str) -> dict[str, Any]:
        """``user`` as a message, with the images waiting to be shown before its text."""
        if not self.pending_images:
            return {"role": "user", "content": user}
        parts = [{"type": "image", "image": image} for image in self.pending_images]
        return {"role": "user", "content": [*parts, {"type": "text", "text": user}]}

    def messages(self, user: str) -> list[dict[str, Any]]:
        """The conversation to answer ``user`` with: the system prompt, as many of the latest
        exchanges as fit, and ``user`` (with the images waiting to be shown).

        Raises:
            ValueError: when ``user`` alone (with the system prompt) leaves no room for an answer.
        """
        system = [{"role": "system", "content": self.system}] if self.system else []
        budget = self.context_length - self.max_new_tokens
        current = [self.user_message(user)]
        for start in range(0, len(self.history) + 1, 2):  # drop whole exchanges, oldest first
            messages = system + self.history[start:] + current
            if self.prompt_tokens(messages) <= budget:
                return messages
        raise ValueError(
            f"the message needs more than {budget} tokens of the model's {self.context_length} "
            f"(leaving {self.max_new_tokens} for the answer)"
        )

    def reply(self, user: str, streamer: Any = None, temperature: float = 0.0) -> str:
        """Answer ``user`` and remember the exchange (the images waiting are shown with it, and are
        then part of it).

        Raises:
            AnswerStopped: on Ctrl-C (KeyboardInterrupt) during generation, after remembering the
                exchange with the answer's part so far, or forgetting it when there is no part yet.
        """
        messages = self.messages(user)
        asked, self.pending_images = messages[-1], []
        tokens = _AnswerTokens(streamer)
        try:
            answer = generate(
                self.model,
                self.tokenizer,
                messages,
                max_new_tokens=self.max_new_tokens,
                temperature=temperature,
                chat_template=self.chat_template,
                streamer=tokens,
                processor=self.processor,
            )
        except KeyboardInterrupt:
            tokens.end()  # the streamer shows what it held back, and is ready for the next answer
            partial = self.tokenizer.decode(tokens.ids, skip_special_tokens=True)
            if partial:
                self.history += [asked, {"role": "assistant", "content": partial}]
            raise AnswerStopped(partial) from None
        self.history += [asked, {"role": "assistant", "content": answer}]
        return answer

    def show_image(self, path: str) -> int:
        """Open the image at ``path`` to show with the next message; the number now waiting.

        Raises:
            ValueError: the model takes no images, or the file is missing or not an image.
        """
        if not path:
            raise ValueError("usage: /image PATH")
        if self.processor is None:
            raise ValueError("this model takes no images (its folder has no image processor)")
        self.pending_images += open_images([path], "/image")  # a ConfigError naming /image and the file
        return len(self.pending_images)


def terminal_reader() -> Reader:
    """:func:`input`, with line editing and this session's history when stdin is a terminal and
    Python has ``readline`` (not on Windows); no history file is read or written."""
    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  # importing it is what gives input() editing and history
    return input


def scripted_reader(lines: Iterable[str], out: TextIO) -> Reader:
    """A :data:`Reader` over ``lines`` (scripts, tests): each prompt written to ``out``, EOFError after
    the last line; an exception the iterator raises (KeyboardInterrupt) reaches the caller."""
    remaining = iter(lines)

    def read(prompt: str) -> str:
        out.write(prompt)
        out.flush()
        try:
            return next(remaining)
        except StopIteration:
            raise EOFError from None

    return read


def run_chat(session: ChatSession, read: Reader, out: TextIO, streamer: Any = None) -> None:
    """Read user lines and commands with ``read`` (:func:`terminal_reader`, :func:`scripted_reader`);
    write answers (streamed by ``streamer``, else whole) and notes to ``out``. Returns at ``/exit``,
    at the end of input (Ctrl-D) and on Ctrl-C at the prompt; Ctrl-C during an answer stops only it."""
    out.write(f"{HELP}\n{KEYS}\n")
    try:
        _converse(session, read, out, streamer)
    except KeyboardInterrupt:  # a second Ctrl-C while the first was being handled
        out.write("\n(chat ended)\n")
    out.flush()


def _converse(session: ChatSession, read: Reader, out: TextIO, streamer: Any) -> None:
    """The loop of :func:`run_chat`: one line read and answered (or obeyed) per turn."""
    while True:
        try:
            line = read(PROMPT).strip()
        except EOFError:
            out.write("\n")
            return
        except KeyboardInterrupt:
            out.write("\n(chat ended)\n")
            return
        if line == "/exit":
            out.write("\n")
            return
        try:
            _answer_or_obey(session, line, out, streamer)
        except AnswerStopped as stopped:
            kept = "the part shown stays in the conversation" if stopped.answer else "the message is dropped"
            line_end = "" if streamer is not None else "\n"  # a streamer ends the answer's line itself
            out.write(f"{line_end}(answer stopped; {kept})\n")
        except KeyboardInterrupt:  # before generation began
            out.write("\n(stopped; the message is dropped)\n")
        out.flush()


def _answer_or_obey(session: ChatSession, line: str, out: TextIO, streamer: Any) -> None:
    """Carry out a command, or answer a message (written whole when there is no ``streamer``)."""
    if line == "/reset":
        session.history, session.pending_images = [], []
        out.write("(conversation cleared)\n")
    elif line == "/image" or line.startswith("/image "):
        try:
            waiting = session.show_image(line.removeprefix("/image").strip())
        except ValueError as error:
            out.write(f"({error})\n")
            return
        out.write(f"({waiting} image{'s' if waiting > 1 else ''} will be shown with your next message)\n")
    elif line.startswith("/system"):
        session.system = line.removeprefix("/system").strip() or None
        session.history, session.pending_images = [], []
        out.write(f"(system prompt {'set' if session.system else 'removed'}; conversation cleared)\n")
    elif line.startswith("/"):
        out.write(f"(unknown command {line.split()[0]}; {HELP})\n")
    elif line:
        try:
            answer = session.reply(line, streamer=streamer)
        except ValueError as error:
            waiting, session.pending_images = len(session.pending_images), []
            dropped = f"; the waiting image{'s are' if waiting > 1 else ' is'} dropped" if waiting else ""
            out.write(f"({error}{dropped})\n")
            return
        if streamer is None:
            out.write(answer + "\n")
