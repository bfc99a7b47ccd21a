"""The end-of-fit summary printed to the terminal."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import lightning as L


@dataclass
class FitTotals:
    """What a fit went through, counted over all ranks."""

    seconds: float
    tokens: int
    response_tokens: int
    best_val_loss: float | None
    best_val_step: int | None


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


def fit_summary(trainer: L.Trainer, totals: FitTotals, adapter: Path) -> str:
    """Steps, tokens, wall time, best val/loss and its checkpoint, the adapter and how to try it."""
    lines = [
        f"lit-instruct: fit done in {_duration(totals.seconds)}: {trainer.global_step} optimizer steps, "
        f"{totals.tokens:,} tokens ({totals.response_tokens:,} response tokens) "
        f"({totals.tokens / max(totals.seconds, 1e-9):.0f} tokens/s over the whole fit)"
    ]
    from lit_instruct.callbacks import SkipNonFiniteSteps

    skipped = sum(cb.skipped for cb in trainer.callbacks if isinstance(cb, SkipNonFiniteSteps))
    if skipped:
        lines.append(f"  skipped steps (non-finite): {skipped}")
    checkpoint = trainer.checkpoint_callback
    if checkpoint is not None and checkpoint.monitor == "val/loss" and checkpoint.best_model_path:
        best = f"  best val/loss {float(checkpoint.best_model_score):.4f}: {checkpoint.best_model_path}"
        best_adapter = getattr(checkpoint, "adapter_dir", None)
        if best_adapter is not None:
            best += f" (adapter: {best_adapter(checkpoint.best_model_path)})"
        lines.append(best)
    elif totals.best_val_loss is not None:
        lines.append(f"  best val/loss {totals.best_val_loss:.4f} at step {totals.best_val_step}")
    lines.append(f"  adapter: {adapter}")
    lines.append(f'  try it:  lit-instruct generate --adapter {adapter} --prompt "Hello! What can you do?"')
    return "\n".join(lines)
