"""Losses taking final hidden states and the lm_head weight (never logits): the contract
(:mod:`~lit_instruct.loss.contract`), the named choices (:mod:`~lit_instruct.loss.table`)."""

from lit_instruct.loss.contract import LossFn, Reduction
from lit_instruct.loss.fused import FusedLinearCrossEntropy, fused_linear_cross_entropy
from lit_instruct.loss.reference import reference_linear_cross_entropy
from lit_instruct.loss.table import LOSSES, LossChoice, resolve_loss

__all__ = [
    "LOSSES",
    "FusedLinearCrossEntropy",
    "LossChoice",
    "LossFn",
    "Reduction",
    "fused_linear_cross_entropy",
    "reference_linear_cross_entropy",
    "resolve_loss",
]
