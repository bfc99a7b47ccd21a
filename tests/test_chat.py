"""``lit-instruct chat``: driven through stdin; history kept within the context; the commands."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from lit_instruct.infer.chat import ChatSession, run_chat
from lit_instruct.infer.generate import generate, load_for_generation


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    return load_for_generation(str(tiny_model_dir))


def test_a_session_answers_like_generate_keeps_history_and_obeys_commands(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    session = ChatSession(model, tokenizer, context_length=2048, max_new_tokens=3)
    out = io.StringIO()
    run_chat(
        session, ["Hi\n", "/system Be brief.\n", "Hello\n", "Again\n", "/bogus\n", "/exit\n", "Never\n"], out
    )
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
    run_chat(session, ["/reset\n"], io.StringIO())
    assert session.history == []


def test_the_oldest_exchanges_are_left_out_when_the_context_is_full(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    session = ChatSession(model, tokenizer, context_length=80, max_new_tokens=10, system="S.")
    session.history = [
        {"role": "user", "content": "one " * 30},
        {"role": "assistant", "content": "uno " * 30},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "dos"},
    ]
    messages = session.messages("three")
    assert [m["content"] for m in messages] == ["S.", "two", "dos", "three"]  # the first exchange left out
    assert (
        session.prompt_tokens(messages)
        <= 70
        < session.prompt_tokens([messages[0], *session.history, messages[-1]])
    )
    with pytest.raises(ValueError, match="the message needs more than 70 tokens of the model's 80"):
        session.messages("word " * 100)


def test_the_chat_command_reads_stdin(tiny_model_dir) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lit_instruct",
            "chat",
            "--model",
            str(tiny_model_dir),
            "--max-new-tokens",
            "2",
        ],
        input="Hi\n/reset\n/exit\n",
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("commands: /reset") and "(conversation cleared)" in done.stdout
