"""Every field of a record reaches the model or the record is refused: a template that cannot show
tool calls, tools, reasoning or a system prompt is no silent drop; ``chatml-tools`` shows them all."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lit_instruct.data.records import DataError
from lit_instruct.data.render import ChatRenderer
from lit_instruct.data.sources import read_source
from tests.test_render import check
from tests.test_templates import WEATHER_TOOL

CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_CHAT = {
    "tools": [WEATHER_TOOL],
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Ask the tool.", "tool_calls": [CALL]},
        {"role": "tool", "content": "18C, sunny"},
        {"role": "assistant", "content": "18C and sunny."},
    ],
}


def read_one(tmp_path: Path, row: dict) -> object:
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (record,) = read_source(path)
    return record


def refusal(tokenizer, record, template: str | None = None) -> str:
    with pytest.raises(DataError) as refused:
        ChatRenderer(tokenizer, 512, chat_template=template)(record)
    assert refused.value.reason == "template_drops_field"
    return str(refused.value)


def test_a_tool_call_the_template_cannot_show_is_refused(tokenizer, tmp_path) -> None:
    """SmolLM2's own template renders a tool-call turn as an empty answer: only <|im_end|> trained."""
    row = json.loads(json.dumps(TOOL_CHAT))
    del row["messages"][2]["reasoning_content"]
    message = refusal(tokenizer, read_one(tmp_path, row))
    assert message.startswith(
        f"{tmp_path / 'data.jsonl'}:1: messages[2].tool_calls[0]: the chat template does not show it "
        "('get_weather' is not in its rendering of the answer)"
    )
    assert "renders tool calls (chatml-tools for ChatML models" in message


@pytest.mark.parametrize(
    ("field", "row"),
    [
        (
            "messages[1].reasoning_content",
            {
                "messages": [
                    {"role": "user", "content": "2+2?"},
                    {"role": "assistant", "content": "4", "reasoning_content": "Add two and two."},
                ]
            },
        ),
        (
            "tools[0]",
            {
                "tools": [WEATHER_TOOL],
                "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
            },
        ),
    ],
)
def test_reasoning_and_tools_the_template_cannot_show_are_refused(tokenizer, tmp_path, field, row) -> None:
    message = refusal(tokenizer, read_one(tmp_path, row))
    assert re.search(rf":1: {re.escape(field)}: the chat template does not show it", message)


def test_a_system_prompt_the_template_drops_is_refused(tokenizer, tmp_path) -> None:
    no_system = (
        "{% for m in messages %}{% if m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    row = {
        "system": "Answer in French.",
        "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Salut."}],
    }
    message = refusal(tokenizer, read_one(tmp_path, row), no_system)
    assert ":1: messages[0].content: the chat template does not show it ('Answer in French.'" in message


def test_chatml_tools_shows_every_field_and_labels_the_answers_exactly(tokenizer, tmp_path) -> None:
    system = (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the "
        "user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(WEATHER_TOOL)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call><|im_end|>\n"
    )
    check(
        ChatRenderer(tokenizer, 1024, chat_template="chatml-tools"),
        read_one(tmp_path, TOOL_CHAT),
        [
            (system + "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n", False),
            (
                '<think>\nAsk the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris"}}\n</tool_call><|im_end|>',
                True,
            ),
            (
                "\n<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>\n"
                "<|im_start|>assistant\n",
                False,
            ),
            ("18C and sunny.<|im_end|>", True),
            ("\n", False),
        ],
    )
