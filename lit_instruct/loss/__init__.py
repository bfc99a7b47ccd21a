"""Losses taking final hidden states and the lm_head weight (never logits)."""

from lit_instruct.loss.fused import FusedLinearCrossEntropy, fused_linear_cross_entropy
from lit_instruct.loss.reference import LossFn, Reduction, reference_linear_cross_entropy

__all__ = [
    "FusedLinearCrossEntropy",
    "LossFn",
    "Reduction",
    "fused_linear_cross_entropy",
    "reference_linear_cross_entropy",
]
