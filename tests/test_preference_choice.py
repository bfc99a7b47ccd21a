"""Which modules a command line asks for: ``model.preference`` set, not null, in a config file given as
``--config`` or ``-c``, or on the command line, the last one deciding (issue 51: ``-c`` was missed and
``preference: null`` taken as DPO)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lit_instruct.cli import main, preference_requested

ROOT = Path(__file__).resolve().parents[1]
DPO, LORA = str(ROOT / "configs" / "dpo.yaml"), str(ROOT / "configs" / "lora.yaml")


@pytest.mark.parametrize(
    ("argv", "wanted"),
    [
        (["--config", DPO], True),
        (["-c", DPO], True),
        ([f"--config={DPO}"], True),
        ([f"-c={DPO}"], True),
        (["--config", LORA], False),
        (["--config", LORA, "--model.preference.kind", "ipo"], True),
        (["--config", DPO, "--model.preference", "null"], False),
        (["--config", DPO, "--model.preference=null"], False),
        (["--model.preference", "null", "--config", DPO], True),  # the later one decides
    ],
)
def test_the_last_word_on_model_preference_decides(argv: list[str], wanted: bool) -> None:
    assert preference_requested(argv) is wanted


def test_a_config_with_a_null_preference_is_sft(tmp_path: Path) -> None:
    config = yaml.safe_load(Path(LORA).read_text())
    config["model"]["preference"] = None
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(config))
    assert preference_requested(["--config", str(path)]) is False
    assert preference_requested({"model": {"preference": None}}) is False
    assert preference_requested({"model": {"preference": {"kind": "dpo"}}}) is True


def test_the_short_config_flag_gives_the_preference_modules(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["fit", "-c", DPO, "--print_config"])
    assert stop.value.code == 0
    assert yaml.safe_load(capsys.readouterr().out)["model"]["preference"]["kind"] == "dpo"
