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
from tests.test_templates import WEATHER_TOOL, check_sample, family_tokenizer

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


# -- a field is shown where its sentinels are, not where its text is found ---------------------

LLAMA31_TOOLS = (  # Llama 3.1's tool turns: tools and tool results through tojson, calls as JSON
    "{{ bos_token }}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    "{% for t in tools or [] %}{{ t | tojson(indent=4) }}\n{% endfor %}<|eot_id|>"
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{% if m['content'] is mapping or m['content'] is iterable %}{{ m['content'] | tojson }}"
    "{% else %}{{ m['content'] }}{% endif %}<|eot_id|>"
    "{% elif m['tool_calls'] %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for tc in m['tool_calls'] %}{{ '{\"name\": \"' + tc.function.name + '\", \"parameters\": ' }}"
    "{{ tc.function.arguments | tojson }}}{% endfor %}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
ESCAPING_CHATML = (  # HTML-escapes every turn
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | e }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HEADER = "<|start_header_id|>{}<|end_header_id|>\n\n"


def test_tool_results_rendered_through_tojson_are_shown(tokenizer, tmp_path) -> None:
    """Llama 3.1 renders a tool result as a JSON string: its quotes and newline come out escaped,
    which is showing it, not dropping it."""
    tok = family_tokenizer(tokenizer, "llama3")
    result = '{"temp": "18C",\n "sky": "clear"}'
    row = {
        "tools": [WEATHER_TOOL],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": "18C and clear."},
        ],
    }
    sample = ChatRenderer(tok, 1024, chat_template=LLAMA31_TOOLS)(read_one(tmp_path, row))
    tool = json.dumps(WEATHER_TOOL, indent=4)
    check_sample(
        tok,
        sample,
        [
            (
                tok.bos_token + HEADER.format("system") + "Environment: ipython\n" + tool + "\n<|eot_id|>",
                False,
            ),
            (HEADER.format("user") + "Weather in Paris?<|eot_id|>" + HEADER.format("assistant"), False),
            ('{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', True),
            (
                HEADER.format("ipython") + '"{\\"temp\\": \\"18C\\",\\n \\"sky\\": \\"clear\\"}"<|eot_id|>',
                False,
            ),
            (HEADER.format("assistant"), False),
            ("18C and clear.<|eot_id|>", True),
        ],
    )


def test_an_html_escaping_template_shows_markup(tokenizer, tmp_path) -> None:
    row = {
        "messages": [
            {"role": "user", "content": "Make <b>this</b> bold: Paris"},
            {"role": "assistant", "content": "<b>Paris</b>"},
        ]
    }
    sample = ChatRenderer(tokenizer, 512, chat_template=ESCAPING_CHATML)(read_one(tmp_path, row))
    check_sample(
        tokenizer,
        sample,
        [
            (
                "<|im_start|>user\nMake &lt;b&gt;this&lt;/b&gt; bold: Paris<|im_end|>\n"
                "<|im_start|>assistant\n",
                False,
            ),
            ("&lt;b&gt;Paris&lt;/b&gt;<|im_end|>", True),
            ("\n", False),
        ],
    )


@pytest.mark.parametrize(
    ("template", "answer"),
    [
        (  # the answer 'im' is inside the template's own <|im_end|>
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] != 'assistant' %}"
            "{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            "im",
        ),
        (  # DeepSeek-R1 style: only the text after </think> is shown, the reasoning in it is dropped
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
            "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            "<think>Add.</think>4",
        ),
    ],
    ids=["answer-dropped", "answer-shown-in-part"],
)
def test_an_answer_the_template_drops_is_refused_even_when_its_text_is_found(
    tokenizer, tmp_path, template, answer
) -> None:
    row = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": answer}]}
    message = refusal(tokenizer, read_one(tmp_path, row), template)
    assert message.startswith(
        f"{tmp_path / 'data.jsonl'}:1: messages[1].content: the chat template does not show it "
        f"({answer!r} is not in its rendering of the answer)"
    )


def test_tools_the_template_drops_are_refused_though_a_call_shows_their_name(tokenizer, tmp_path) -> None:
    """chatml-tools with its tools block switched off: the call shows 'get_weather', the tools
    offered are not shown."""
    from lit_instruct.templates import CHATML_TOOLS_TEMPLATE

    no_tools = CHATML_TOOLS_TEMPLATE.replace("{% if tools %}", "{% if false %}")
    assert no_tools != CHATML_TOOLS_TEMPLATE
    message = refusal(tokenizer, read_one(tmp_path, TOOL_CHAT), no_tools)
    assert message.startswith(
        f"{tmp_path / 'data.jsonl'}:1: tools[0]: the chat template does not show it ('get_weather' is not "
        "in its rendering of the conversation)"
    )
