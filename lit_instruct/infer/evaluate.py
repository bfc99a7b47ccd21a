"""``lit-instruct eval``: a trained adapter's token-weighted loss and perplexity on held-out files.

The numbers are validation's: the files are read, rendered and masked exactly as in training (the
data module's validation split), and the module's own validation step computes sum(CE) / count over
the response tokens, overall and per file (``val/loss/<name>``). ``--base`` measures the base model
the same way (the adapter switched off); ``--answers`` writes the model's answers to each record's
last prompt, for comparing adapters side by side, showing its progress (:class:`Progress`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from lit_instruct.adapter_folder import adapter_base
from lit_instruct.clock import duration
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

    from lit_instruct.data.datamodule import InstructDataModule

    datamodule = InstructDataModule(
        tokenizer=module.hparams["model"],
        val_files=list(data),
        max_seq_len=max_seq_len,
        eval_batch_size=batch_size,
        chat_template=chat_template,
    )
    trainer = quiet_trainer()

    def run() -> dict[str, float]:
        (metrics, *_) = trainer.validate(module, datamodule=datamodule, verbose=False)
        return {k: float(v) for k, v in metrics.items()}

    results = {"adapter": run()}
    if with_base:
        with module.model.disable_adapter():
            results["base"] = run()
    return results


def quiet_trainer() -> Any:
    """A one-device Trainer for ``eval``'s validation: no logger, checkpoints, bars or summary."""
    import lightning as L

    return L.Trainer(
        accelerator="auto",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def results_table(results: Mapping[str, Mapping[str, float]]) -> str:
    """``results`` of :func:`evaluate` as an aligned table: a row per model, a column per metric
    (``val/loss``, ``val/loss/<file>``..., ``val/ppl``, ``val/tokens``), two spaces apart."""
    losses = sorted({name for metrics in results.values() for name in metrics if name.startswith("val/loss")})
    columns = [*losses, "val/ppl", "val/tokens"]
    rows = [["model", *columns]]
    for label, metrics in results.items():
        rows.append([label, *(_cell(name, metrics.get(name)) for name in columns)])
    return aligned(rows)


def aligned(rows: Sequence[Sequence[str]]) -> str:
    """``rows`` (a header first) as lines: the first column left-aligned, the others right-aligned,
    two spaces apart."""
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = []
    for label, *cells in rows:
        numbers = [cell.rjust(width) for cell, width in zip(cells, widths[1:], strict=True)]
        lines.append("  ".join([label.ljust(widths[0]), *numbers]) + "\n")
    return "".join(lines)


def _cell(name: str, value: float | None) -> str:
    """A metric's value as the table shows it: losses to 4 decimals, perplexity to 2, counts whole."""
    if value is None or math.isnan(value):
        return "-"
    if name == "val/tokens":
        return f"{int(value)}"
    return f"{value:.2f}" if name == "val/ppl" else f"{value:.4f}"


class Progress:
    """``label: done/total`` on ``stream``, with the time so far and left: redrawn in place on a
    terminal; otherwise a line at the start, at most every ``every_s`` seconds and at the end. The end
    says the time taken: ``answers: 100/100 in 9m40s``.

    Args:
        label: what is counted.
        total: how many there are.
        stream: where the lines go (stderr, so they stay out of a redirected stdout).
        every_s: seconds between lines when ``stream`` is no terminal.
        clock: seconds, monotonic.
    """

    def __init__(
        self,
        label: str,
        total: int,
        stream: TextIO,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.total = total
        self.stream = stream
        self.every_s = every_s
        self.clock = clock
        self.terminal = stream.isatty()
        self.started = clock()
        self._last_line: float | None = None
        self._width = 0

    def line(self, done: int, now: float) -> str:
        """The progress text after ``done`` of :attr:`total` at ``now``."""
        elapsed = now - self.started
        if done >= self.total:
            return f"{self.label}: {done}/{self.total} in {duration(elapsed)}"
        left = f", about {duration(elapsed / done * (self.total - done))} left" if done else ""
        return f"{self.label}: {done}/{self.total} ({duration(elapsed)}{left})"

    def update(self, done: int) -> None:
        """Show that ``done`` of :attr:`total` are done."""
        now = self.clock()
        last = done >= self.total
        if self.terminal:
            text = self.line(done, now)
            self.stream.write("\r" + text.ljust(self._width) + ("\n" if last else ""))
            self._width = len(text)
        elif last or self._last_line is None or now - self._last_line >= self.every_s:
            self._last_line = now
            self.stream.write(self.line(done, now) + "\n")
        self.stream.flush()


def write_answers(
    module: Any,
    data: Sequence[str],
    out: str | Path,
    max_new_tokens: int = 256,
    chat_template: str | None = None,
    progress: TextIO | None = None,
) -> Path:
    """For each record of ``data``: its conversation up to the last answer, the reference answer and
    the greedy answer of ``module`` (:func:`load_adapter_module`), one JSON line each. With
    ``progress`` (a stream), :class:`Progress` shows ``answers: done/total`` there."""
    from lit_instruct.data.sources import read_source
    from lit_instruct.infer.generate import generate

    tokenizer = base_tokenizer(module.hparams["model"], module.hparams.get("added_tokens"))
    records = [record for path in data for record in read_source(path)]
    shown = Progress("answers", len(records), progress) if progress is not None else None
    if shown is not None:
        shown.update(0)
    lines = []
    for done, record in enumerate(records, 1):
        prompt = [m.for_template() for m in record.messages[:-1]]
        answer = generate(
            module.model, tokenizer, prompt, max_new_tokens=max_new_tokens, chat_template=chat_template
        )
        row = {"source": record.source, "messages": prompt, "reference": record.messages[-1].content}
        lines.append(json.dumps({**row, "answer": answer}, ensure_ascii=False))
        if shown is not None:
            shown.update(done)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return out
