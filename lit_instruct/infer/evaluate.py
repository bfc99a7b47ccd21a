"""``lit-instruct eval``: a trained adapter's token-weighted loss and perplexity on held-out files.

The numbers are validation's: the files are read, rendered and masked exactly as in training (the
data module's validation split), and the module's own validation step computes sum(CE) / count over
the response tokens, overall and per file (``val/loss/<name>``). ``--base`` measures the base model
the same way (the adapter switched off); ``--answers`` writes the model's answers to each record's
last prompt, for comparing adapters side by side.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lit_instruct.adapter_folder import adapter_base
from lit_instruct.vocabulary import adapter_new_tokens, base_tokenizer


def load_adapter_module(adapter: str | Path, base: str | None = None) -> Any:
    """An :class:`InstructLoRAModule` with the adapter's own LoRA structure and weights (and the tokens
    its training added), in eval mode."""
    from lit_instruct.train.module import InstructLoRAModule

    model = adapter_base(adapter, base)
    new_tokens = adapter_new_tokens(adapter, model)
    return InstructLoRAModule(model=model, adapter=str(adapter), added_tokens=new_tokens).eval()


def evaluate(
    module: Any,
    data: Sequence[str],
    with_base: bool = False,
    max_seq_len: int = 512,
    batch_size: int = 8,
    chat_template: str | None = None,
) -> dict[str, dict[str, float]]:
    """Validation metrics of ``module`` (:func:`load_adapter_module`) as ``"adapter"`` and, with
    ``with_base``, of its base (``"base"``) on ``data``: ``val/loss``, ``val/ppl``, ``val/tokens`` and
    ``val/loss/<file>``."""
    import lightning as L

    from lit_instruct.data.datamodule import InstructDataModule

    datamodule = InstructDataModule(
        tokenizer=module.hparams["model"],
        val_files=list(data),
        max_seq_len=max_seq_len,
        eval_batch_size=batch_size,
        chat_template=chat_template,
    )
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )

    def run() -> dict[str, float]:
        (metrics, *_) = trainer.validate(module, datamodule=datamodule, verbose=False)
        return {k: float(v) for k, v in metrics.items()}

    results = {"adapter": run()}
    if with_base:
        with module.model.disable_adapter():
            results["base"] = run()
    return results


def write_answers(
    module: Any,
    data: Sequence[str],
    out: str | Path,
    max_new_tokens: int = 256,
    chat_template: str | None = None,
) -> Path:
    """For each record of ``data``: its conversation up to the last answer, the reference answer and
    the greedy answer of ``module`` (:func:`load_adapter_module`), one JSON line each."""
    from lit_instruct.data.sources import read_source
    from lit_instruct.infer.generate import generate

    tokenizer = base_tokenizer(module.hparams["model"], module.hparams.get("added_tokens"))
    lines = []
    for path in data:
        for record in read_source(path):
            prompt = [m.for_template() for m in record.messages[:-1]]
            answer = generate(
                module.model, tokenizer, prompt, max_new_tokens=max_new_tokens, chat_template=chat_template
            )
            row = {"source": record.source, "messages": prompt, "reference": record.messages[-1].content}
            lines.append(json.dumps({**row, "answer": answer}, ensure_ascii=False))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return out
