"""``lit-instruct chat``: a multi-turn terminal chat with a model (and adapter), answers streamed.

Prompts are rendered with the template training used
(:func:`~lit_instruct.templates.resolve_chat_template`). The history is kept within the model's
context: when the rendered conversation plus the answer's token budget would not fit, the oldest
exchanges are left out (the system prompt stays). Commands: ``/reset`` forgets the history,
``/system TEXT`` sets the system prompt (and resets), ``/exit`` ends.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TextIO

from lit_instruct.templates import resolve_chat_template
from lit_instruct.infer.generate import generate

HELP = "commands: /reset (forget the conversation), /system TEXT (set the system prompt), /exit"


class ChatSession:
    """A conversation with ``model``: the system prompt and the exchanges so far.

    Args:
        model: a causal LM (with or without an adapter) in eval mode.
        tokenizer: its tokenizer.
        context_length: tokens the model takes (prompt and answer).
        max_new_tokens: tokens reserved for each answer.
        chat_template: the template override used in training, if any.
        system: a system prompt.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        context_length: int,
        max_new_tokens: int = 256,
        chat_template: str | None = None,
        system: str | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.max_new_tokens = max_new_tokens
        self.chat_template = resolve_chat_template(tokenizer, chat_template)
        self.system = system
        self.history: list[dict[str, str]] = []

    def prompt_tokens(self, messages: list[dict[str, str]]) -> int:
        """Tokens of ``messages`` rendered with the generation prompt."""
        ids = self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, add_generation_prompt=True, tokenize=True
        )
        return len(ids["input_ids"] if isinstance(ids, Mapping) else ids)  # BatchEncoding in transformers 5

    def messages(self, user: str) -> list[dict[str, str]]:
        """The conversation to answer ``user`` with: the system prompt, as many of the latest
        exchanges as fit, and ``user``.

        Raises:
            ValueError: when ``user`` alone (with the system prompt) leaves no room for an answer.
        """
        system = [{"role": "system", "content": self.system}] if self.system else []
        budget = self.context_length - self.max_new_tokens
        current = [{"role": "user", "content": user}]
        for start in range(0, len(self.history) + 1, 2):  # drop whole exchanges, oldest first
            messages = system + self.history[start:] + current
            if self.prompt_tokens(messages) <= budget:
                return messages
        raise ValueError(
            f"the message needs more than {budget} tokens of the model's {self.context_length} "
            f"(leaving {self.max_new_tokens} for the answer)"
        )

    def reply(self, user: str, streamer: Any = None, temperature: float = 0.0) -> str:
        """Answer ``user`` and remember the exchange."""
        messages = self.messages(user)
        answer = generate(
            self.model,
            self.tokenizer,
            messages,
            max_new_tokens=self.max_new_tokens,
            temperature=temperature,
            chat_template=self.chat_template,
            streamer=streamer,
        )
        self.history += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        return answer


def run_chat(session: ChatSession, lines: Iterable[str], out: TextIO, streamer: Any = None) -> None:
    """Read user lines and commands from ``lines``; write answers (streamed) and notes to ``out``."""
    out.write(f"{HELP}\n> ")
    out.flush()
    for raw in lines:
        line = raw.strip()
        if line == "/exit":
            break
        if line == "/reset":
            session.history = []
            out.write("(conversation cleared)\n")
        elif line.startswith("/system"):
            session.system = line.removeprefix("/system").strip() or None
            session.history = []
            out.write(f"(system prompt {'set' if session.system else 'removed'}; conversation cleared)\n")
        elif line.startswith("/"):
            out.write(f"(unknown command {line.split()[0]}; {HELP})\n")
        elif line:
            try:
                answer = session.reply(line, streamer=streamer)
                if streamer is None:
                    out.write(answer + "\n")
            except ValueError as error:
                out.write(f"({error})\n")
        out.write("> ")
        out.flush()
    out.write("\n")
