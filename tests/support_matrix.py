"""Write the support matrix of docs/models.md from the family table and what each tiny model builds to.

``python -m tests.support_matrix`` (``make matrix``) rewrites the table between the markers in
docs/models.md; ``tests/test_families.py`` fails when that table is not the one this writes. The "logits"
and "LoRA" columns are what :mod:`lit_instruct.models.output_head` and :mod:`lit_instruct.models.lora_targets`
find on each model at build, so the table cannot claim what the code does not do.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

from lit_instruct.loss.logits import LogitTransform
from lit_instruct.models.lora import LoRAConfig, attach_lora
from lit_instruct.models.output_head import logit_transform
from tests.families import FAMILIES, LABELS, NO_PACKING, SHARP, tiny_model
from tests.vision_families import DECODER_FAMILY
from tests.vision_families import LABELS as VISION_LABELS

MODELS_DOC = Path(__file__).resolve().parent.parent / "docs" / "models.md"
START, END = "<!-- support-matrix:start -->", "<!-- support-matrix:end -->"
VOCAB = 128


def _logits(transform: LogitTransform, has_bias: bool) -> str:
    parts = ["lm_head bias"] if has_bias else []
    if transform.scale != 1.0:
        parts.append(f"`* {transform.scale:g}`")
    if transform.softcap is not None:
        parts.append(f"soft-cap {transform.softcap:g}")
    return ", ".join(parts) or "plain"


def _attention(config: object) -> str:
    text = str(getattr(config, "_attn_implementation", ""))
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) is not False:
        text += f" + window {window}"
    if getattr(config, "attention_chunk_size", None):
        text += f" + chunks of {config.attention_chunk_size}"
    return text


def _lora(line: str) -> str:
    return line.removeprefix("LoRA: ").replace(" (left out: ", "; left out: ").rstrip(")")


def row(name: str) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model(name, VOCAB)
        transform = logit_transform(model)
        config = model.config
        head_bias = model.get_output_embeddings().bias is not None
        coverage = attach_lora(model, LoRAConfig(r=4)).lora_coverage
    packed = f"refused ({NO_PACKING[name]})" if name in NO_PACKING else "yes"
    exact = "yes (grads to 1e-4 in fp32, packing in fp64)" if name in SHARP else "yes"
    cells = [
        LABELS[name],
        f"`{FAMILIES[name][0]}`",
        _logits(transform, head_bias),
        _attention(config),
        exact,
        packed,
        _lora(coverage.line()),
        _multimodal(name),
    ]
    return "| " + " | ".join(cells) + " |"


def _multimodal(name: str) -> str:
    """The vision-language families on this decoder that ``tests/test_vision.py`` checks."""
    found = [VISION_LABELS[v] for v, text in DECODER_FAMILY.items() if text == name]
    return ", ".join(found) if found else "no"


def matrix() -> str:
    header = (
        "| family | config | logits | attention | loss + LoRA grads = model's own | packed = padded "
        "| LoRA at build (`all-linear`) | multimodal (images) |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    return "\n".join([header, *(row(name) for name in FAMILIES)])


def _section(text: str) -> re.Match[str]:
    found = re.search(f"{re.escape(START)}\n(.*?){re.escape(END)}", text, re.DOTALL)
    if found is None:
        raise ValueError(f"{MODELS_DOC.name} has no {START} ... {END} section")
    return found


def documented_matrix(text: str) -> str:
    """The table between the markers of docs/models.md."""
    return _section(text).group(1).rstrip("\n")


def main() -> None:
    text = MODELS_DOC.read_text()
    found = _section(text)
    MODELS_DOC.write_text(f"{text[: found.start()]}{START}\n{matrix()}\n{END}{text[found.end() :]}")


if __name__ == "__main__":
    main()
