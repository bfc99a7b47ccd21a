"""Lightning's progress bar, as a fine-tuning run reads it: ``Epoch 0`` when the run is bounded by
steps (Lightning's shows ``Epoch 0/-2``), a learning rate of ``2.0e-04`` (not ``0.000``), no ``v_num``.

:class:`~lit_instruct.train.module.InstructLoRAModule` puts it in place of Lightning's own bar (Rich's
or tqdm's) in any Trainer, with the settings it was given; any other bar is left as it is.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from typing_extensions import override


def shown(name: str, value: Any) -> Any:
    """A metric as the bar shows it: a rate in scientific notation, other floats to 4 decimals."""
    if not isinstance(value, float):
        return value
    return f"{value:.1e}" if name.split("/")[-1] in ("lr", "learning_rate") else f"{value:.4f}"


class _ReadableMetrics:
    """The bar's metrics without Lightning's logger version (``v_num``), each formatted by :func:`shown`."""

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)  # type: ignore[misc]
        metrics.pop("v_num", None)
        return {name: shown(name, value) for name, value in metrics.items()}


class RichStepProgressBar(_ReadableMetrics, RichProgressBar):
    """Rich's bar, with the epoch alone when the epochs are not what bounds the run."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        if max_epochs is None or max_epochs < 0 or self.trainer.max_steps > 0:
            return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"
        return super()._get_train_description(current_epoch)


class TQDMStepProgressBar(_ReadableMetrics, TQDMProgressBar):
    """tqdm's bar (whose description shows no epoch bound), with readable metrics."""


def readable_bar(bar: Any) -> Any:
    """Our bar in place of Lightning's own of the same kind, with its settings (refresh rate, theme...:
    ours adds no state); any other bar as it is."""
    kinds: dict[type, type] = {RichProgressBar: RichStepProgressBar, TQDMProgressBar: TQDMStepProgressBar}
    kind = kinds.get(type(bar))
    if kind is None:
        return bar
    readable: Any = object.__new__(kind)
    readable.__dict__.update(bar.__dict__)
    return readable
