"""Generate answers to a few fixed prompts at each validation, and log them.

Example::

    trainer:
      callbacks:
        - class_path: lit_instruct.callbacks.GenerationPreview
          init_args: {prompts: ["Hello!", "What can you do?"], max_new_tokens: 48}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lit_instruct.io import log_dir


class GenerationPreview(L.Callback):
    """Greedy answers to ``prompts`` after each validation (not the sanity check), on rank 0.

    They go to W&B as a table (``val/generations``) when W&B is a logger, and always to
    ``<log dir>/generations.txt`` and the console log.

    Args:
        prompts: user messages to answer, with the training chat template.
        max_new_tokens: length bound of each answer.

    Raises:
        ValueError: with no prompt or a non-positive ``max_new_tokens``.
    """

    def __init__(self, prompts: list[str], max_new_tokens: int = 64) -> None:
        if not prompts:
            raise ValueError("GenerationPreview needs at least one prompt")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.prompts = list(prompts)
        self.max_new_tokens = max_new_tokens
        self.history: list[tuple[int, str, str]] = []

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        folder = log_dir(trainer)  # on every rank: a collective under DDP
        if not trainer.is_global_zero:
            return
        from lit_instruct.infer.generate import generate

        datamodule = trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning at init, undeclared
        tokenizer = datamodule.load_tokenizer()
        step = trainer.global_step
        rows = []
        for prompt in self.prompts:
            answer = generate(
                pl_module.model,
                tokenizer,
                prompt,
                max_new_tokens=self.max_new_tokens,
                chat_template=getattr(datamodule, "chat_template", None),
            )
            rows.append((step, prompt, answer))
            rank_zero_info(f"lit-instruct generation @ step {step}: {prompt!r} -> {answer!r}")
        self.history += rows
        self._write(trainer, rows, folder)

    def _write(self, trainer: L.Trainer, rows: list[tuple[int, str, str]], folder: Path) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_text(
                    "val/generations",
                    columns=["step", "prompt", "answer"],
                    data=[list(map(str, row)) for row in self.history],
                )
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "generations.txt", "a", encoding="utf-8") as out:
            out.writelines(f"[step {s}] {p}\n{a}\n\n" for s, p, a in rows)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [tuple(row) for row in state_dict.get("history", [])]
