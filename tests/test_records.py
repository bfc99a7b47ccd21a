"""Reading records: format detection and errors that name the file, line and field."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import get_args

import pytest

from lit_instruct.data.chatterbot import read_chatterbot
from lit_instruct.data.records import FORMATS, DataError, Message, RecordFormat
from lit_instruct.data.sources import DataSource, read_source
from tests.helpers import BAD_LINES, GOOD


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_three_formats_are_detected_per_file(tmp_path: Path) -> None:
    alpaca = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "Add", "input": "1 and 2", "output": "3"}])
    pc = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Hi", "completion": "Hello"}])
    chat = tmp_path / "c.json"
    chat.write_text(
        json.dumps([{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}])
    )

    (a,) = read_source(alpaca)
    assert a.messages == (Message("user", "Add\n\n1 and 2"), Message("assistant", "3"))
    assert a.source == f"{alpaca}:1"
    (p,) = read_source(pc)
    assert p.messages == (Message("user", "Hi"), Message("assistant", "Hello"))
    (c,) = read_source(chat)
    assert c.messages == (Message("user", "Q"), Message("assistant", "A"))
    assert c.source == f"{chat}[record 1]"


def test_alpaca_without_input_uses_instruction_alone(tmp_path: Path) -> None:
    (record,) = read_source(write_jsonl(tmp_path / "a.jsonl", [{"instruction": "Say hi", "output": "hi"}]))
    assert record.messages[0] == Message("user", "Say hi")


@pytest.mark.parametrize("reason", BAD_LINES)
def test_errors_name_file_line_and_field(tmp_path: Path, reason: str) -> None:
    line, expected = BAD_LINES[reason]
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{GOOD}\n{line}\n{GOOD}\n")
    with pytest.raises(DataError, match=re.escape(f"{path}:2: ") + expected):
        read_source(path)


def test_skipping_bad_records_keeps_the_good_ones_and_reports_each_bad_one(tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(f"{GOOD}\n{line}\n" for line, _ in BAD_LINES.values()) + f"{GOOD}\n\n\n")
    bad: list[tuple[str, str, str]] = []
    records = read_source(path, on_bad=lambda raw, error: bad.append((raw.source, error.reason, raw.text)))
    assert len(records) == len(BAD_LINES) + 1  # the trailing empty lines end the file, they are no records
    assert [source for source, _, _ in bad] == [f"{path}:{2 * k}" for k in range(1, len(BAD_LINES) + 1)]
    reasons = [reason.replace("not_an_object", "bad_type") for reason in BAD_LINES]
    assert [reason for _, reason, _ in bad] == reasons
    assert [text for _, _, text in bad] == [line for line, _ in BAD_LINES.values()]


def test_chatterbot_conversations_alternate_user_and_assistant() -> None:
    records = read_chatterbot(["greetings"])
    assert len(records) > 10
    for record in records:
        roles = [m.role for m in record.messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        assert "greetings.yml[conversation " in record.source


def test_sharegpt_records_map_their_roles_and_keep_the_train_flag(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "sharegpt.jsonl",
        [
            {
                "conversations": [
                    {"from": "system", "value": "Be brief."},
                    {"from": "human", "value": "Hi"},
                    {"from": "gpt", "value": "Hello.", "train": False},
                    {"from": "human", "value": "Bye"},
                    {"from": "gpt", "value": "Goodbye."},
                ]
            }
        ],
    )
    for fmt in ("auto", "sharegpt"):
        (record,) = read_source(DataSource(str(path), format=fmt))
        assert record.messages == (
            Message("system", "Be brief."),
            Message("user", "Hi"),
            Message("assistant", "Hello.", train=False),
            Message("user", "Bye"),
            Message("assistant", "Goodbye."),
        )


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"conversations": [{"from": "human", "value": "Hi"}, {"from": "bot", "value": "{}"}]},
            r"field 'conversations\[1\]\.from' is 'bot'; expected one of \('system', 'human'",
        ),
        (
            {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": " "}]},
            r"field 'conversations\[1\]\.value' \(assistant\) is empty",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Yo", "train": 0},
                ]
            },
            r"field 'messages\[1\]\.train' must be true or false, got 0",
        ),
    ],
)
def test_bad_sharegpt_and_train_fields_name_file_line_and_field(tmp_path: Path, row, message) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [row])
    with pytest.raises(DataError, match=re.escape(f"{path}:1: ") + message):
        read_source(path)


def test_tables_read_through_datasets_give_the_records_of_the_same_rows(tmp_path: Path) -> None:
    """parquet, csv, an .arrow file and a save_to_disk folder: the same records as JSON Lines, each
    named by file and row; nested chat messages survive parquet and arrow."""
    import datasets

    flat = [{"prompt": f"Question {i}?", "completion": f"Answer {i}."} for i in range(3)]
    answers = [
        {"role": "assistant", "content": "Hello.", "train": False},
        {"role": "assistant", "content": "Hello."},
    ]
    chats = [{"messages": [{"role": "user", "content": "Hi"}, answer]} for answer in answers]
    expected = read_source(write_jsonl(tmp_path / "flat.jsonl", flat))
    datasets.Dataset.from_list(flat).to_parquet(tmp_path / "flat.parquet")
    datasets.Dataset.from_list(flat).to_csv(tmp_path / "flat.csv", index=False)
    datasets.Dataset.from_list(chats).save_to_disk(tmp_path / "chats")
    for name in ("flat.parquet", "flat.csv"):
        records = read_source(tmp_path / name)
        assert [r.messages for r in records] == [r.messages for r in expected]
        assert [r.source for r in records] == [f"{tmp_path / name}:row {i}" for i in range(3)]
    (arrow,) = (tmp_path / "chats").glob("*.arrow")
    for path in (tmp_path / "chats", arrow):  # the table gives the second row's answer train=None
        records = read_source(path)
        assert [r.messages[1] for r in records] == [
            Message("assistant", "Hello.", train=False),
            Message("assistant", "Hello."),
        ]


def test_a_bad_table_row_names_file_row_and_field(tmp_path: Path) -> None:
    import datasets

    rows = [{"prompt": "Fine?", "completion": "Yes."}, {"prompt": "Empty?", "completion": " "}]
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(
        DataError, match=re.escape(f"{tmp_path / 'bad.parquet'}:row 1: field 'messages[1].content'")
    ):
        read_source(tmp_path / "bad.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(tmp_path / "splits")
    assert len(read_source(DataSource(str(tmp_path / "splits"), split="train"), on_bad=lambda *_: None)) == 1
    with pytest.raises(DataError, match=r"has no split 'test' \(it has: train\); set split"):
        read_source(DataSource(str(tmp_path / "splits"), split="test"))


# -- every field is used or refused -------------------------------------------------------------


def test_a_message_weight_of_zero_keeps_the_turn_out_of_the_loss(tmp_path: Path) -> None:
    """OpenAI's fine-tuning format and Axolotl: ``weight: 0`` on an assistant turn = do not train."""
    row = {
        "messages": [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "I don't know.", "weight": 0},
            {"role": "user", "content": "Try harder."},
            {"role": "assistant", "content": "A", "weight": 1},
        ]
    }
    (record,) = read_source(write_jsonl(tmp_path / "weights.jsonl", [row]))
    assert [m.train for m in record.messages if m.role == "assistant"] == [False, True]


def test_context_turns_may_say_they_are_not_trained_but_not_ask_to_be(tmp_path: Path) -> None:
    row = {
        "messages": [
            {"role": "system", "content": "Be brief.", "train": False},
            {"role": "user", "content": "Hi", "weight": 0},
            {"role": "assistant", "content": "Yo"},
        ]
    }
    (record,) = read_source(write_jsonl(tmp_path / "context.jsonl", [row]))
    assert record.messages == (
        Message("system", "Be brief."),
        Message("user", "Hi"),
        Message("assistant", "Yo"),
    )


@pytest.mark.parametrize(
    ("turn", "message"),
    [
        (
            {"role": "user", "content": "Hi", "train": True},
            r"field 'messages\[0\]\.train' asks to train on a user",
        ),
        (
            {"role": "user", "content": "Hi", "weight": 1},
            r"field 'messages\[0\]\.weight' asks to train on a user",
        ),
        (
            {"role": "user", "content": "Hi", "weight": 0.5},
            r"field 'messages\[0\]\.weight' must be 0 or 1, got 0\.5",
        ),
        (
            {"role": "user", "content": "Hi", "train": False, "weight": 1},
            r"fields 'messages\[0\]\.train' and 'messages\[0\]\.weight' disagree",
        ),
    ],
)
def test_a_turn_flag_that_cannot_be_honoured_is_refused(tmp_path: Path, turn, message) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [turn, {"role": "assistant", "content": "Yo"}]}])
    with pytest.raises(DataError, match=re.escape(f"{path}:1: ") + message):
        read_source(path)


def test_a_records_system_field_and_alpaca_history_become_turns(tmp_path: Path) -> None:
    """LLaMA-Factory's documented fields: ``system`` on ShareGPT and alpaca records, alpaca ``history``."""
    sharegpt = {
        "system": "Be brief.",
        "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}],
    }
    alpaca = {
        "system": "Be kind.",
        "history": [["First?", "One."], ["Second?", "Two."]],
        "instruction": "Third?",
        "output": "Three.",
    }
    first, second = read_source(write_jsonl(tmp_path / "system.jsonl", [sharegpt, alpaca]))
    assert first.messages == (
        Message("system", "Be brief."),
        Message("user", "Hi"),
        Message("assistant", "Yo"),
    )
    assert second.messages == (
        Message("system", "Be kind."),
        Message("user", "First?"),
        Message("assistant", "One."),
        Message("user", "Second?"),
        Message("assistant", "Two."),
        Message("user", "Third?"),
        Message("assistant", "Three."),
    )
    both = {"system": "A", "messages": [{"role": "system", "content": "B"}, *sharegpt_as_chat()]}
    path = write_jsonl(tmp_path / "both.jsonl", [both])
    with pytest.raises(
        DataError, match=re.escape(f"{path}:1: the record has both a 'system' field and a system turn")
    ):
        read_source(path)


def sharegpt_as_chat() -> list[dict[str, str]]:
    return [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]


def test_csv_cells_are_text(tmp_path: Path) -> None:
    path = tmp_path / "numbers.csv"
    path.write_text("prompt,completion\nWhat is 2 times 3?,6\nAnd NA?,NA\n")
    records = read_source(path)
    assert [r.messages[1].content for r in records] == ["6", "NA"]


def test_a_llama_factory_folder_skips_its_dataset_info_with_a_note(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "data.jsonl", [{"instruction": "Hi?", "output": "Yo."}])
    (tmp_path / "dataset_info.json").write_text(json.dumps({"data": {"file_name": "data.jsonl"}}))
    with pytest.warns(UserWarning, match="not reading .*dataset_info.json: it describes datasets"):
        (record,) = read_source(tmp_path)
    assert record.messages[1] == Message("assistant", "Yo.")


def test_errors_say_what_the_record_looks_like_and_which_columns_exist(tmp_path: Path) -> None:
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [chat])
    expected = (
        f"{path}:1: format is alpaca but the record has no 'instruction', 'output'; its fields are "
        "['messages'] (it looks like a chat record: set format: auto or chat)"
    )
    with pytest.raises(DataError, match=re.escape(expected)):
        read_source(DataSource(str(path), format="alpaca"))
    qa = write_jsonl(tmp_path / "qa.jsonl", [{"question": "Hi?", "reply": "Yo."}])
    expected = (
        f"{qa}:1: column 'answer' (mapped to 'completion' by columns) is missing; "
        "the record has ['question', 'reply']"
    )
    with pytest.raises(DataError, match=re.escape(expected)):
        read_source(DataSource(str(qa), columns={"prompt": "question", "completion": "answer"}))


def test_fields_no_format_uses_are_counted_and_fields_we_cannot_honour_refused(tmp_path: Path) -> None:
    from collections import Counter

    rows = [
        {
            "id": 7,
            "messages": [
                {"role": "user", "content": "Hi", "refusal": None, "lang": "en"},
                {"role": "assistant", "content": "Yo", "lang": "en"},
            ],
        },
        {"id": 8, "instruction": "Hi?", "output": "Yo.", "source": ""},
    ]
    counts: Counter[str] = Counter()
    first, second = read_source(DataSource(str(write_jsonl(tmp_path / "extra.jsonl", rows))), counts=counts)
    assert first.unused == ("id", "messages[].lang") and second.unused == ("id",)
    assert counts == Counter({"unused_field_id": 2, "unused_field_messages[].lang": 1})

    for field, value, what in (
        ("images", ["cat.png"], "': images are read in chat, ShareGPT and conversational prompt/completion"),
        ("videos", ["cat.mp4"], "' holds videos (text-only training"),
        ("rejected", "No.", "' holds a preference pair"),
    ):
        path = write_jsonl(tmp_path / f"{field}.jsonl", [{"prompt": "Hi", "completion": "Yo", field: value}])
        with pytest.raises(DataError, match=re.escape(f"{path}:1: field '{field}{what}")):
            read_source(path)


def test_every_format_the_config_offers_is_in_the_format_table() -> None:
    assert set(FORMATS) == set(get_args(RecordFormat)) - {"auto"}


# -- each turn layout reads its own fields ------------------------------------------------------

CALL = '{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}'
HUMAN = '{"from": "human", "value": "Weather in Paris?"}'
USE_MESSAGES = "use the messages format, whose assistant turns carry it"


def refusal(tmp_path: Path, line: str) -> tuple[str, DataError]:
    """The file holding ``line`` as its only line, and the error reading it raises."""
    path = tmp_path / "data.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(DataError) as refused:
        read_source(path)
    return str(path), refused.value


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"conversations": ['
            + HUMAN
            + ', {"from": "gpt", "value": "Sunny.", "tool_calls": ['
            + CALL
            + "]}]}",
            "field 'conversations[1].tool_calls' holds tool calls, which a ShareGPT turn cannot carry (make "
            f"the call a turn of its own, from: function_call, or {USE_MESSAGES}): refused",
        ),
        (
            '{"conversations": [' + HUMAN + ', {"from": "gpt", "value": "Sunny.", "reasoning_content": "Look '
            'it up."}]}',
            "field 'conversations[1].reasoning_content' holds reasoning, which a ShareGPT turn cannot carry "
            f"({USE_MESSAGES} as reasoning_content): refused",
        ),
        (
            '{"conversations": [' + HUMAN + ', {"from": "gpt", "value": "Sunny.", "thinking": "Hmm."}]}',
            "field 'conversations[1].thinking' holds reasoning, which a ShareGPT turn cannot carry "
            f"({USE_MESSAGES} as reasoning_content): refused",
        ),
        (
            '{"conversations": [' + HUMAN + ', {"from": "gpt", "value": "Sunny.", "function_call": {"name": '
            '"get_weather", "arguments": "{}"}}]}',
            "field 'conversations[1].function_call' holds a tool call, which a ShareGPT turn cannot carry as "
            f"a field (make it a turn of its own, from: function_call, or {USE_MESSAGES}): refused",
        ),
        (
            '{"conversations": [{"from": "human", "value": "Hi", "content": "Hello?"}, {"from": "gpt", '
            '"value": "Yo"}]}',
            "field 'conversations[0].content' differs from 'conversations[0].value' (a conversations turn is "
            "from and value: keep those): refused",
        ),
        (
            '{"conversations": [{"from": "human", "value": "Hi", "role": "system"}, {"from": "gpt", '
            '"value": "Yo"}]}',
            "field 'conversations[0].role' differs from 'conversations[0].from' (a conversations turn is "
            "from and value: keep those): refused",
        ),
        (
            '{"messages": [{"role": "user", "content": "Hi", "value": "Hello?"}, {"role": "assistant", '
            '"content": "Yo"}]}',
            "field 'messages[0].value' differs from 'messages[0].content' (a messages turn is role and "
            "content: keep those): refused",
        ),
        (
            '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "from": '
            '"human"}]}',
            "field 'messages[1].from' differs from 'messages[1].role' (a messages turn is role and content: "
            "keep those): refused",
        ),
        (
            '{"prompt": [{"role": "user", "content": "Hi", "images": ["cat.png"]}], "completion": [{"role": '
            '"assistant", "content": "A cat."}]}',
            "field 'prompt[0].images' holds images as a turn field (show each as an image part of the "
            "turn's content, or list them in the record's images field with an <image> in the text where "
            "each goes): refused",
        ),
    ],
    ids=[
        "sharegpt-tool_calls",
        "sharegpt-reasoning_content",
        "sharegpt-thinking",
        "sharegpt-function_call",
        "sharegpt-content-differs",
        "sharegpt-role-differs",
        "chat-value-differs",
        "chat-from-differs",
        "trl-prompt-images",
    ],
)
def test_turn_fields_a_format_cannot_honour_are_refused_naming_file_line_and_field(
    tmp_path: Path, line: str, message: str
) -> None:
    path, error = refusal(tmp_path, line)
    assert str(error) == f"{path}:1: {message}"
    assert error.reason == "unsupported_field"


def test_turn_fields_a_format_does_not_read_are_counted_per_format(tmp_path: Path) -> None:
    """A ShareGPT turn's name and tool_call_id, a chat turn's from/value that repeat its role/content,
    and fields of turns kept as JSON text are counted; empty ones (a table's columns) are not."""
    from collections import Counter

    lines = [
        '{"conversations": [{"from": "human", "value": "Hi", "role": "user", "name": "ann", "lang": "en"}, '
        '{"from": "gpt", "value": "Yo", "content": "Yo", "tool_calls": [], "reasoning_content": null}]}',
        '{"conversations": [{"from": "human", "value": "Temp?"}, {"from": "function_call", "value": '
        '"{\\"name\\": \\"temp\\", \\"arguments\\": {}}"}, {"from": "observation", "value": "18C", "name": '
        '"temp", "tool_call_id": "c1"}, {"from": "gpt", "value": "18C."}]}',
        '{"messages": [{"role": "user", "content": "Hi", "from": "human", "value": "Hi"}, {"role": '
        '"assistant", "content": "Yo", "from": "gpt"}]}',
        '{"messages": "[{\\"role\\": \\"user\\", \\"content\\": \\"Hi\\", \\"lang\\": \\"en\\"}, '
        '{\\"role\\": \\"assistant\\", \\"content\\": \\"Yo\\"}]"}',
    ]
    path = tmp_path / "turns.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    counts: Counter[str] = Counter()
    records = read_source(path, counts=counts)
    assert [r.unused for r in records] == [
        ("conversations[].content", "conversations[].lang", "conversations[].name", "conversations[].role"),
        ("conversations[].name", "conversations[].tool_call_id"),
        ("messages[].from", "messages[].value"),
        ("messages[].lang",),
    ]
    assert counts == Counter(
        {
            "unused_field_conversations[].name": 2,
            "unused_field_conversations[].content": 1,
            "unused_field_conversations[].lang": 1,
            "unused_field_conversations[].role": 1,
            "unused_field_conversations[].tool_call_id": 1,
            "unused_field_messages[].from": 1,
            "unused_field_messages[].value": 1,
            "unused_field_messages[].lang": 1,
        }
    )
    assert records[0].messages == (Message("user", "Hi"), Message("assistant", "Yo"))
    assert records[1].messages[2] == Message("tool", "18C")  # the name is counted, not shown


def test_two_reasoning_fields_of_a_turn_must_agree(tmp_path: Path) -> None:
    """``reasoning_content`` and ``thinking`` on one turn: the same text is read once, different
    texts are refused (one would be dropped); an empty one is no reasoning."""
    turn = '{"role": "assistant", "content": "4", "reasoning_content": %s, "thinking": %s}'
    line = '{"messages": [{"role": "user", "content": "2+2?"}, ' + turn + "]}"
    path, error = refusal(tmp_path, line % ('"Add."', '"Add two."'))
    assert str(error) == (
        f"{path}:1: fields 'messages[1].reasoning_content' and 'messages[1].thinking' hold different "
        "reasoning: keep one"
    )
    for pair, reasoning in ((('"Add."', '"Add."'), "Add."), (('""', '"Add two."'), "Add two.")):
        (record,) = read_source(write_jsonl(tmp_path / "same.jsonl", [json.loads(line % pair)]))
        assert record.messages[1] == Message("assistant", "4", reasoning=reasoning) and record.unused == ()


# -- issue 49 item 9: every decode or parse failure is a DataError naming where it is --------------

DEEP = "[" * 100_000 + "]" * 100_000
"""A value nested far deeper than Python's JSON parser recurses."""
ITEM9_LINES = {  # reason: (bytes of line 2 between two good lines, the message after "file:2: ")
    "invalid_utf8": (
        b'{"prompt": "caf\xe9", "completion": "ok"}',
        r"invalid UTF-8 at column 16 \(byte 0xe9\)",
    ),
    "nested_too_deep": (
        ('{"prompt": ' + DEEP + ', "completion": "ok"}').encode(),
        r"JSON nested too deeply",
    ),
    "invalid_json": (
        ('{"prompt": "x", "completion": ' + "1" * 5000 + "}").encode(),
        r"invalid JSON: Exceeds the limit \(4300 digits\)",
    ),
    "duplicate_key": (
        b'{"prompt": "x", "completion": "y", "prompt": "z"}',
        r"key 'prompt' appears more than once in an object",
    ),
}


def _bad_file(path: Path, lines: list[bytes]) -> Path:
    """``lines`` each between two good lines (the bad ones on even lines)."""
    path.write_bytes(b"".join(GOOD.encode() + b"\n" + line + b"\n" for line in lines) + GOOD.encode() + b"\n")
    return path


@pytest.mark.parametrize("reason", ITEM9_LINES)
def test_item9_decode_and_parse_failures_name_file_line_and_are_skipped_counted(tmp_path, reason) -> None:
    """Invalid UTF-8, nesting deeper than the parser recurses, an integer over Python's digit limit
    and a repeated key: each a DataError naming file and line, or under skip a counted reject whose
    text the rejects file can hold."""
    from collections import Counter

    from lit_instruct.data.validation import Rejects

    line, expected = ITEM9_LINES[reason]
    path = _bad_file(tmp_path / "bad.jsonl", [line])
    with pytest.raises(DataError, match=re.escape(f"{path}:2: ") + expected) as caught:
        read_source(path)
    assert caught.value.reason == reason
    counts: Counter[str] = Counter()
    rejects = Rejects("skip")
    records = read_source(path, rejects.on_bad_raw(counts))
    assert [r.source for r in records] == [f"{path}:1", f"{path}:3"]
    assert counts == Counter({f"skipped_{reason}": 1})
    written = json.loads(rejects.write(tmp_path / "rejects.jsonl").read_text(encoding="utf-8"))
    assert written["source"] == f"{path}:2" and written["reason"] == reason


def test_item9_a_repeated_key_is_refused_at_any_depth(tmp_path) -> None:
    turns = '[{"role": "user", "content": "Hi", "role": "assistant"}, {"role": "assistant", "content": "A"}]'
    path = _bad_file(tmp_path / "chat.jsonl", [f'{{"messages": {turns}}}'.encode()])
    with pytest.raises(DataError, match=re.escape(f"{path}:2: key 'role' appears more than once")):
        read_source(path)


def test_item9_a_json_array_files_bad_records_are_named_and_skipped(tmp_path) -> None:
    """In a JSON array file, a record with bytes that are not UTF-8, a repeated key or nesting deeper
    than the parser recurses is named by its index and line, and skipped under skip."""
    records = [
        b'{"prompt": "caf\xe9", "completion": "ok"}',
        b'{"prompt": "x", "completion": "y", "completion": "z"}',
        ('{"prompt": ' + DEEP + ', "completion": "ok"}').encode(),
    ]
    path = tmp_path / "array.json"
    path.write_bytes(
        b"[\n" + b"".join(GOOD.encode() + b",\n" + r + b",\n" for r in records) + GOOD.encode() + b"\n]\n"
    )
    expected = [
        ("[record 2]", "invalid_utf8", r"line 3, column 16: invalid UTF-8 \(byte 0xe9\)"),
        ("[record 4]", "duplicate_key", r"line 5: key 'completion' appears more than once"),
        ("[record 6]", "nested_too_deep", r"line 7: JSON nested too deeply"),
    ]
    with pytest.raises(DataError, match=re.escape(f"{path}[record 2]: ") + expected[0][2]):
        read_source(path)
    bad: list[tuple[str, str, str]] = []
    good = read_source(path, on_bad=lambda raw, error: bad.append((raw.source, error.reason, error.message)))
    assert [r.source for r in good] == [f"{path}[record {k}]" for k in (1, 3, 5, 7)]
    assert [(source, reason) for source, reason, _ in bad] == [(f"{path}{i}", r) for i, r, _ in expected]
    for (_, _, message), (_, _, pattern) in zip(bad, expected, strict=True):
        assert re.match(pattern, message), message


def test_item9_a_csv_file_with_bytes_that_are_not_utf8_names_the_row_and_line(tmp_path) -> None:
    """A csv row holding bytes that are not UTF-8 is refused naming the file, row and line; the other
    rows are read as ``datasets`` reads a clean file."""
    clean = tmp_path / "clean.csv"
    clean.write_bytes(b'prompt,completion\nWhat is 2 times 3?,6\n"Two\nlines",NA\nok,ok\n')
    path = tmp_path / "latin1.csv"
    path.write_bytes(b'prompt,completion\nWhat is 2 times 3?,6\n"Two\nlines",NA\ncaf\xe9,ok\n')
    with pytest.raises(
        DataError,
        match=re.escape(f"{path}:row 2: ") + r"field 'prompt': invalid UTF-8 at line 5 \(byte 0xe9\)",
    ) as caught:
        read_source(path)
    assert caught.value.reason == "invalid_utf8"
    bad: list[str] = []
    records = read_source(path, on_bad=lambda raw, error: bad.append(raw.source))
    assert bad == [f"{path}:row 2"]
    assert [r.messages for r in records] == [r.messages for r in read_source(clean)][:2]
    assert [r.source for r in records] == [f"{path}:row 0", f"{path}:row 1"]


@pytest.mark.parametrize(
    ("cell", "message", "reason"),
    [
        (DEEP[:50_000], r"field 'messages': JSON nested too deeply", "nested_too_deep"),
        (
            '[{"role": "user", "content": "Hi", "content": "Bye"}, {"role": "assistant", "content": "A"}]',
            r"field 'messages': key 'content' appears more than once",
            "duplicate_key",
        ),
    ],
)
def test_item9_json_text_in_a_table_cell_is_checked_alike(tmp_path, cell, message, reason) -> None:
    import datasets

    path = tmp_path / "chats.parquet"
    datasets.Dataset.from_list([{"messages": cell}]).to_parquet(path)
    with pytest.raises(DataError, match=re.escape(f"{path}:row 0: ") + message) as caught:
        read_source(path)
    assert caught.value.reason == reason
