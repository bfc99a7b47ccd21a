"""What a model does to ``hidden @ W.T + b`` before the softmax: scaling and soft-capping.

Families differ here (Cohere multiplies by ``logit_scale``, Granite divides by ``logits_scaling``,
Falcon-H1 multiplies by ``lm_head_multiplier``, Gemma 2/3 soft-cap with ``final_logit_softcapping``),
and a loss that skips it trains on the wrong objective. Every loss backend applies
:class:`LogitTransform` itself, gradient included, so the logits are never materialized for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitTransform:
    """``z = softcap * tanh(scale * raw / softcap)`` (without ``softcap``: ``z = scale * raw``)."""

    scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"logit scale must be > 0, got {self.scale}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"logit soft-cap must be > 0, got {self.softcap}")

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        """The transformed logits (autograd-friendly; the reference path)."""
        z = raw * self.scale if self.scale != 1.0 else raw
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z


IDENTITY = LogitTransform()
