"""Lightning callbacks for instruction tuning, installed as ``lit_instruct.callbacks``."""

from lit_instruct.callbacks.adapter_checkpoint import AdapterCheckpoint
from lit_instruct.callbacks.generation_preview import GenerationPreview
from lit_instruct.callbacks.interrupt import GracefulInterrupt
from lit_instruct.callbacks.layer_profiler import LayerProfiler
from lit_instruct.callbacks.loss_curves import LossCurves
from lit_instruct.callbacks.nonfinite import NonFiniteTrainingError, SkipNonFiniteSteps
from lit_instruct.callbacks.plain_progress import PlainProgress
from lit_instruct.callbacks.rollout_samples import RolloutSamples
from lit_instruct.callbacks.sample_scores import SampleScores

__all__ = [
    "AdapterCheckpoint",
    "GenerationPreview",
    "GracefulInterrupt",
    "LayerProfiler",
    "LossCurves",
    "NonFiniteTrainingError",
    "PlainProgress",
    "RolloutSamples",
    "SampleScores",
    "SkipNonFiniteSteps",
]
