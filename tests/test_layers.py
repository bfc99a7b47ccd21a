"""Imports point one way: lower layers never pull in higher ones (checked in fresh interpreters).

From the bottom: the shared helpers (``labels``, ``batch``, ``io``, ``distributed``...), ``loss``,
``data``, ``models``, ``train``, ``export``, ``infer``, then the CLI and the user's callbacks.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

TRAINING = {"lit_instruct.train", "lit_instruct.cli", "lit_instruct.callbacks"}
EXPORT = {"lit_instruct.export"}
INFERENCE = {"lit_instruct.infer"}
USER_FACING = {"lit_instruct.cli", "lit_instruct.callbacks"}
MODELS = {"lit_instruct.models"}
DATA = {"lit_instruct.data"}
LOSS = {"lit_instruct.loss"}


def imported_by(module: str) -> set[str]:
    """The ``lit_instruct`` packages and modules importing ``module`` loads, in a fresh interpreter
    (each dotted name with its parents: ``lit_instruct.train.module`` counts as ``lit_instruct.train``)."""
    loaded = "sorted(m for m in sys.modules if m.startswith('lit_instruct'))"
    code = f"import json, sys, {module}; print(json.dumps({loaded}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    names = json.loads(out.strip().splitlines()[-1])
    return {".".join(name.split(".")[:end]) for name in names for end in range(2, name.count(".") + 2)}


@pytest.mark.parametrize(
    ("module", "forbidden", "third_party"),
    [
        ("lit_instruct.loss", TRAINING | EXPORT | INFERENCE | MODELS | DATA, {"lightning", "transformers"}),
        ("lit_instruct.io", TRAINING | EXPORT | INFERENCE | MODELS | DATA | LOSS, {"transformers"}),
        ("lit_instruct.distributed", TRAINING | EXPORT | INFERENCE | MODELS | DATA | LOSS, {"lightning"}),
        ("lit_instruct.rules", TRAINING | EXPORT | INFERENCE | MODELS | DATA | LOSS, {"torch"}),
        ("lit_instruct.preflight", TRAINING | EXPORT | INFERENCE | DATA | USER_FACING, set()),
        ("lit_instruct.data.datamodule", TRAINING | EXPORT | INFERENCE | LOSS, set()),
        ("lit_instruct.models", TRAINING | EXPORT | INFERENCE | DATA, set()),
        ("lit_instruct.models.lora", TRAINING | EXPORT | INFERENCE | DATA, set()),
        ("lit_instruct.models.packing", TRAINING | EXPORT | INFERENCE | DATA, set()),
        ("lit_instruct.models.fused_lora", TRAINING | EXPORT | INFERENCE | DATA, set()),
        ("lit_instruct.train.module", EXPORT | INFERENCE | DATA | USER_FACING, set()),
        ("lit_instruct.export.gguf", TRAINING | INFERENCE, set()),
        ("lit_instruct.infer.chat", TRAINING, set()),
    ],
)
def test_a_layer_imports_nothing_above_it(module: str, forbidden: set[str], third_party: set[str]) -> None:
    assert not imported_by(module) & forbidden
    if third_party:
        code = f"import sys, {module}; print(sorted(m for m in {sorted(third_party)} if m in sys.modules))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "[]", f"{module} pulls in {out.stdout.strip()}"
