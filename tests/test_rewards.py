"""Rewards (lit_instruct.rewards): named in YAML, scored without a silent zero, and the shipped ones
(the final answer, a format, DAPO's overlong penalty, the last against TRL's own)."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch

from lit_instruct.errors import ConfigError
from lit_instruct.rewards import (
    FormatReward,
    RewardError,
    SoftOverlongPunishment,
    exact_answer,
    extract_final_answer,
    resolve_rewards,
    score,
)

SETTING = "model.objective.init_args.rewards"


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """A user's reward module on the path: a function, a callable class, a broken one."""
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            def brevity(prompts, completions, **columns):
                return [1.0 / (1 + len(c[-1]["content"])) for c in completions]

            class Contains:
                def __init__(self, word):
                    self.word = word

                def __call__(self, prompts, completions, **columns):
                    return [float(self.word in c[-1]["content"]) for c in completions]

            def two_few(prompts, completions, **columns):
                return [0.0]

            def not_applicable(prompts, completions, **columns):
                return [None if "skip" in c[-1]["content"] else 1.0 for c in completions]

            def nan_for_blue(prompts, completions, **columns):
                return [float("nan") if "Blue" in c[-1]["content"] else 1.0 for c in completions]

            def raises(prompts, completions, **columns):
                raise KeyError("answer")
            """
        )
    )
    (tmp_path / "broken_rewards.py").write_text("import a_package_that_is_not_there\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("my_rewards", "broken_rewards"):
        sys.modules.pop(name, None)


def conversation(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


PROMPTS = [[{"role": "user", "content": "What is 12 + 7?"}]] * 2 + [
    [{"role": "user", "content": "Colour?"}]
] * 2
COMPLETIONS = [conversation(t) for t in ("It is 19.", "\\boxed{20}", "Blue", "skip this")]


@pytest.mark.parametrize(
    "text, answer",
    [
        ("So the total is 1,234.", "1234"),
        ("First 3, then 4, finally -2.5", "-2.5"),
        ("\\boxed{\\frac{1}{2}} and then 7", "\\frac{1}{2}"),
        ("\\boxed{3} no, \\boxed{ 4 }", "4"),
        ("no number here", None),
        ("\\boxed{unclosed 5", "5"),
    ],
)
def test_the_final_answer_is_the_last_boxed_else_the_last_number(text, answer) -> None:
    assert extract_final_answer(text) == answer


def test_exact_answer_compares_numbers_as_numbers() -> None:
    completions = ["It is 19.", "It is 19.0", "\\boxed{20}", "none", "The answer: nineteen"]
    rewards = exact_answer([""] * 5, completions, answer=["19", 19, "19", "19", "nineteen"])
    assert rewards == [1.0, 1.0, 0.0, 0.0, 0.0]  # the last: its final answer is no number, and not the text


def test_the_format_reward_searches_or_matches_whole() -> None:
    texts = ["<think>a</think> 4", "4 <think>a</think>", "no tags"]
    assert FormatReward(r"<think>.*</think>")([], texts) == [1.0, 1.0, 0.0]
    assert FormatReward(r"<think>.*</think>.*", full=True)([], texts) == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="no regular expression"):
        FormatReward("(")


def test_the_overlong_penalty_is_trls() -> None:
    from trl.rewards import get_soft_overlong_punishment

    ids = [[1] * n for n in (0, 10, 79, 80, 81, 90, 100, 101, 150)]
    theirs = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)(completion_ids=ids)
    ours = SoftOverlongPunishment(100, 20)([], [""] * len(ids), completion_ids=ids)
    assert ours == pytest.approx(theirs)
    assert ours[5] == pytest.approx(-0.5) and ours[-1] == -1.0  # by hand: Eq. 13 of the DAPO paper


def test_yaml_names_a_shipped_reward_a_function_and_a_class_with_weights(reward_module) -> None:
    rewards = resolve_rewards(
        [
            "exact_answer",
            {"function": "my_rewards:brevity", "weight": 0.5},
            {"class_path": "my_rewards.Contains", "init_args": {"word": "Blue"}, "name": "blue"},
            {"class_path": "format", "init_args": {"pattern": "boxed"}},
        ]
    )
    assert [(r.name, r.weight) for r in rewards] == [
        ("exact_answer", 1.0),
        ("brevity", 0.5),
        ("blue", 1.0),
        ("format", 1.0),
    ]
    table, skipped = score(
        rewards, PROMPTS, COMPLETIONS, {"answer": ["19", "19", "Blue", "Blue"]}, num_generations=2
    )
    assert skipped == 0 and table.shape == (4, 4)
    assert table[:, 0].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert table[:, 2].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert table[:, 3].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert table[0, 1].item() == pytest.approx(1 / (1 + len("It is 19.")))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("exact_anwser", r"\[0\]: 'exact_anwser' names no reward: .*\(closest: exact_answer\)"),
        ("broken_rewards:score", r"module 'broken_rewards' does not import \(ModuleNotFoundError"),
        ("my_rewards:missing", r"module 'my_rewards' has no 'missing'"),
        ({"function": "my_rewards:brevity", "weight": "high"}, r"\[0\]\.weight: must be a finite number"),
        ({"class_path": "format", "init_args": {"pattern": "("}}, r"\[0\]\.init_args: format: pattern"),
        ({"class_path": "my_rewards.Contains", "init_args": {"wrd": "x"}}, r"\[0\]\.init_args: .*wrd"),
        ({"fuction": "my_rewards:brevity"}, r"unknown key 'fuction'"),
        ([], r"needs at least one reward"),
        (["exact_answer", "exact_answer"], r"two rewards are named 'exact_answer'"),
    ],
)
def test_a_bad_reward_setting_is_one_line_naming_it(reward_module, spec, message) -> None:
    with pytest.raises(ConfigError, match=rf"^{SETTING}.*{message}") as caught:
        resolve_rewards(spec)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "function, message",
    [
        ("two_few", r"'two_few' returned 1 values for 4 completions"),
        (
            "nan_for_blue",
            r"'nan_for_blue' returned nan for completion 2 \(prompt 'Colour\?', completion 'Blue'\)",
        ),
        ("raises", r"'raises' raised KeyError: 'answer' \(scoring 4 completions"),
    ],
)
def test_a_reward_that_fails_stops_the_run_naming_it_and_the_completion(reward_module, function, message):
    rewards = resolve_rewards(f"my_rewards:{function}")
    with pytest.raises(RewardError, match=message):
        score(rewards, PROMPTS, COMPLETIONS, {}, num_generations=2)


def test_none_is_not_applicable_and_skip_group_counts_what_it_drops(reward_module) -> None:
    table, skipped = score(resolve_rewards("my_rewards:not_applicable"), PROMPTS, COMPLETIONS, {}, 2)
    assert skipped == 0 and table[:3, 0].tolist() == [1.0] * 3 and math.isnan(table[3, 0])
    rewards = resolve_rewards(["my_rewards:nan_for_blue", "my_rewards:brevity"])
    table, skipped = score(rewards, PROMPTS, COMPLETIONS, {}, 2, on_error="skip_group")
    assert skipped == 1  # the second group (Blue's): both its completions, every reward
    assert torch.isnan(table[2:]).all() and not torch.isnan(table[:2]).any()
