"""``model.objective`` as a command line and its config files give it: short names, class names and
import paths, the old ``model.preference`` form, the last word deciding, and the data's batch kind
linked from it, whatever the config flag (``-c``, ``--config=``) (issue 51: the CLI no longer guesses
from argv)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lit_instruct.cli import main
from lit_instruct.errors import ConfigError
from lit_instruct.objectives import DPO, IPO, SFT, resolve_objective
from lit_instruct.objectives.choice import batch_kind_of
from tests.helpers import checked_config

ROOT = Path(__file__).resolve().parents[1]
DPO_CONFIG, QUICKSTART = str(ROOT / "configs" / "dpo.yaml"), str(ROOT / "configs" / "quickstart.yaml")
KTO_CONFIG = str(ROOT / "configs" / "kto.yaml")
SFT_CONFIG = [QUICKSTART, "--data.chatterbot_categories", "null", "--data.train_files", "[pairs.jsonl]"]
"""The quickstart on a file (the chatterbot corpus holds no pairs)."""


@pytest.mark.parametrize(
    ("argv", "kind"),
    [
        (["--config", DPO_CONFIG], "pairs"),
        (["-c", DPO_CONFIG], "pairs"),
        ([f"--config={DPO_CONFIG}"], "pairs"),
        (["--config", *SFT_CONFIG], "conversations"),
        (["--config", *SFT_CONFIG, "--model.objective", "ipo"], "pairs"),
        (
            ["--config", *SFT_CONFIG, "--model.objective", "{class_path: SimPO, init_args: {gamma: 1.0}}"],
            "pairs",
        ),
        (["--config", *SFT_CONFIG, "--model.objective", "lit_instruct.objectives.ORPO"], "pairs"),
        (["--config", DPO_CONFIG, "--model.objective", "null"], "conversations"),
        (["--config", KTO_CONFIG], "unpaired"),
        (["--config", *SFT_CONFIG, "--model.preference", "{kind: orpo}"], "pairs"),
        (["--config", *SFT_CONFIG, "--model.objective", "dpo", "--model.objective", "sft"], "conversations"),
    ],
)
def test_the_data_takes_the_batch_kind_of_the_objective(argv: list[str], kind: str) -> None:
    config = checked_config(["fit", *argv])
    assert config["data"]["batch_kind"] == kind


def test_objectives_by_short_name_class_name_and_import_path() -> None:
    assert isinstance(resolve_objective(None), SFT) and isinstance(resolve_objective("dpo"), DPO)
    by_class = resolve_objective({"class_path": "IPO", "init_args": {"beta": 0.3}})
    assert isinstance(by_class, IPO) and by_class.preference.beta == 0.3
    by_path = resolve_objective({"class_path": "lit_instruct.objectives.pairs.DPO", "init_args": {}})
    assert by_path.settings() == DPO().settings()
    assert batch_kind_of({"class_path": "lit_instruct.objectives.sft.SFT"}) == "conversations"
    with pytest.raises(ConfigError, match=r"model\.objective: 'dop' is none of .*\(closest: dpo\)"):
        resolve_objective("dop")
    with pytest.raises(ConfigError, match=r"model\.objective\.class_path: 'os\.path' is no objective"):
        resolve_objective({"class_path": "os.path"})


def test_the_old_form_says_the_new_one_and_rebuilds_the_same_objective(capsys) -> None:
    old = resolve_objective(preference={"kind": "ipo", "beta": 0.25})
    assert isinstance(old, IPO) and old.settings() == IPO(beta=0.25).settings()
    with pytest.raises(ConfigError, match=r"model\.preference: is the old form of model\.objective"):
        resolve_objective("dpo", preference={"kind": "dpo"})


def test_a_short_name_as_class_path_is_told_in_one_line(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", *SFT_CONFIG, "--model.objective", "{class_path: dpo}", "--print_config"])
    assert stop.value.code == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "model.objective: 'dpo' is a short name" in line and "class_path: DPO" in line


def test_the_short_config_flag_gives_a_pair_run(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["fit", "-c", DPO_CONFIG, "--print_config"])
    assert stop.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)  # the config as given (links are applied after)
    assert printed["model"]["objective"]["class_path"].endswith("DPO")
