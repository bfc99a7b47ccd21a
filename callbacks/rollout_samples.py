"""What online RL sampled, as users read it: every ``every_n_steps`` optimizer steps, the completions of
the step's last micro-batch with each reward and the advantage, in ``<log dir>/rollouts.md`` and,
with W&B, the table ``train/rollouts``; and in the fit report, the time spent sampling and its
tokens/s (the rest of the fit's time is training).

Example (on in ``configs/grpo.yaml``)::

    trainer:
      callbacks:
        - class_path: lit_instruct.callbacks.RolloutSamples
          init_args: {every_n_steps: 10, max_rows: 8}
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import WandbLogger
from typing_extensions import override

from lit_instruct.io import log_dir

MARKDOWN_FILE = "rollouts.md"
TABLE_KEY = "train/rollouts"


class RolloutSamples(L.Callback):
    """Sampled completions with their rewards, every ``every_n_steps`` steps (``max_rows`` of them);
    the sampling time in the fit report. Does nothing for an objective that samples nothing."""

    def __init__(self, every_n_steps: int = 10, max_rows: int = 8) -> None:
        if every_n_steps < 1 or max_rows < 1:
            raise ValueError(f"every_n_steps and max_rows must be >= 1, got {every_n_steps}, {max_rows}")
        self.every_n_steps = every_n_steps
        self.max_rows = max_rows
        self.written_step = -1
        self._objective: Any = None
        self._start = (0.0, 0)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._objective = getattr(pl_module, "objective", None)
        self._start = (
            getattr(self._objective, "sampling_seconds", 0.0),
            getattr(self._objective, "sampled_tokens", 0),
        )

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        rows = getattr(self._objective, "last_rollout", None)
        step = trainer.global_step
        if not rows or step % self.every_n_steps or step == self.written_step:
            return
        folder = log_dir(trainer)  # a collective under DDP: on every rank
        self.written_step = step
        if not trainer.is_global_zero:
            return
        rows = rows[: self.max_rows]
        path = Path(folder) / MARKDOWN_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as out:
            out.write(markdown_section(step, rows))
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                columns = ["step", *rows[0]]
                logger.log_table(TABLE_KEY, columns=columns, data=[[step, *row.values()] for row in rows])

    def fit_cost(self) -> tuple[str, float]:
        """The sampling this fit did: seconds, and its completion tokens per second."""
        seconds = getattr(self._objective, "sampling_seconds", 0.0) - self._start[0]
        tokens = getattr(self._objective, "sampled_tokens", 0) - self._start[1]
        return f"sampling {tokens:,} completion tokens ({tokens / max(seconds, 1e-9):.0f} tokens/s)", seconds


def markdown_section(step: int, rows: list[dict[str, Any]]) -> str:
    """One step's completions in Markdown: each one's prompt and completion in fences longer than any
    backtick run in them, its rewards and advantage."""

    def fenced(text: str) -> str:
        fence = "`" * max(3, 1 + max(map(len, re.findall("`+", text)), default=0))
        return f"{fence}text\n{text}\n{fence}\n"

    parts = [f"## step {step}\n"]
    for number, row in enumerate(rows, 1):
        scores = ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k not in ("prompt", "completion"))
        parts.append(f"\n### completion {number}: {scores}\n\nprompt:\n{fenced(row['prompt'])}")
        parts.append(f"\ncompletion:\n{fenced(row['completion'])}")
    return "".join(parts) + "\n"
