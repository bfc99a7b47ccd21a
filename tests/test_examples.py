"""The plain-Lightning example runs as a user would run it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_plain_trainer_example_trains_and_writes_an_adapter(tiny_model_dir, tmp_path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "plain_trainer.py"),
            "--model",
            str(tiny_model_dir),
            "--max-steps",
            "8",
            "--root",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"val/loss before: (\d+\.\d+) after: (\d+\.\d+)", result.stdout)
    assert match, result.stdout
    before, after = map(float, match.groups())
    assert after < before - 0.01, (before, after)  # 8 warmup steps at lr 1e-3 move a random model a little
    adapter = Path(result.stdout.split("adapter: ")[-1].strip())
    assert (adapter / "adapter_model.safetensors").is_file()
