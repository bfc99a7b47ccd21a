"""Imports point one way: lower layers never pull in higher ones (checked in fresh interpreters)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

TRAINING = {"lit_instruct.module", "lit_instruct.strategy", "lit_instruct.cli"}
EXPORT = {"lit_instruct.export", "lit_instruct.gguf_export", "lit_instruct.ollama"}
INFERENCE = {"lit_instruct.generate", "lit_instruct.chat", "lit_instruct.evaluate"}
MODEL_BUILDING = {
    "lit_instruct.model",
    "lit_instruct.output_head",
    "lit_instruct.packing",
    "lit_instruct.fused_lora",
}


def imported_by(module: str) -> set[str]:
    """The ``lit_instruct`` modules importing ``module`` loads, in a fresh interpreter."""
    loaded = "sorted(m for m in sys.modules if m.startswith('lit_instruct'))"
    code = f"import json, sys, {module}; print(json.dumps({loaded}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("lit_instruct.io", TRAINING | EXPORT | INFERENCE | MODEL_BUILDING | {"lit_instruct.models"}),
        ("lit_instruct.models", TRAINING | EXPORT | INFERENCE | MODEL_BUILDING | {"lit_instruct.data"}),
        ("lit_instruct.data.datamodule", TRAINING | EXPORT | INFERENCE | MODEL_BUILDING),
        ("lit_instruct.model", TRAINING | EXPORT | INFERENCE | {"lit_instruct.data"}),
        ("lit_instruct.export", TRAINING | INFERENCE | {"lit_instruct.data"}),
    ],
)
def test_a_layer_imports_nothing_above_it(module: str, forbidden: set[str]) -> None:
    assert not imported_by(module) & forbidden
