"""Skip optimizer steps whose loss or gradients are not finite (:mod:`lit_instruct.train.nonfinite`;
the module installs it itself, a config names it to change its settings)."""

from lit_instruct.train.nonfinite import NonFiniteTrainingError, SkipNonFiniteSteps

__all__ = ["NonFiniteTrainingError", "SkipNonFiniteSteps"]
