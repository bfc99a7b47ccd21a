"""``lit-instruct fit --help`` is one screen that points at docs/config.md, and every setting it names
is one a shipped config resolves and the config reference documents (issue 50: LightningCLI's help
of every class's arguments was the first thing a user met)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from lit_instruct.cli import main

ROOT = Path(__file__).resolve().parents[1]
SETTING = re.compile(r"--((?:trainer|model|data)(?:\.\w+)+)")


def printed_config(name: str, capsys) -> dict:
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(ROOT / "configs" / f"{name}.yaml"), "--print_config"])
    return yaml.safe_load(capsys.readouterr().out)


def resolves(config: dict, dotted: str) -> bool:
    node: object = config
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def documented(setting: str, reference: str) -> bool:
    """A row of docs/config.md names ``setting`` (or, ``model.lora.r` / `alpha``, its last key beside a
    sibling); Lightning's own ``trainer.*`` are Lightning's to document."""
    parent, last = setting.rsplit(".", 1)
    rows = [line for line in reference.splitlines() if line.startswith(f"| `{parent}.")]
    return setting.startswith("trainer.") or any(f"`{setting}`" in r or f"/ `{last}`" in r for r in rows)


@pytest.mark.parametrize("command", ["fit", "validate"])
def test_the_help_is_one_screen_pointing_at_the_config_reference(command: str, capsys) -> None:
    main([command, "--help"])
    text = capsys.readouterr().out
    assert text.startswith(f"usage: lit-instruct {command} --config X.yaml")
    assert len(text.splitlines()) <= 40 and max(len(line) for line in text.splitlines()) <= 100
    assert "docs/config.md" in text and f"lit-instruct {command} --help-all" in text
    kinds = "sft, dpo, ipo, simpo, orpo, kto"
    assert "--model.objective NAME" in text and kinds in text
    assert ("--trainer.max_steps" in text) is (command == "fit")  # validate takes no steps


def test_every_setting_the_help_names_exists_and_is_documented(capsys) -> None:
    main(["fit", "--help"])
    named = sorted(set(SETTING.findall(capsys.readouterr().out)))
    assert len(named) >= 15
    configs = [printed_config(name, capsys) for name in ("dpo", "qlora")]
    reference = (ROOT / "docs" / "config.md").read_text()
    missing = [s for s in named if not any(resolves(config, s) for config in configs)]
    assert missing == []
    assert [s for s in named if not documented(s, reference)] == []


def test_the_full_list_is_still_there(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--help-all"])
    assert stop.value.code == 0
    assert len(capsys.readouterr().out.splitlines()) > 200
