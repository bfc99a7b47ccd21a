"""An objective of your own: SFT that weighs every answer alike (the mean over answers of each one's
mean token NLL) instead of every token alike. Train it with
``PYTHONPATH=. lit-instruct fit --config configs/quickstart.yaml``
``--model.objective examples.per_answer_sft.PerAnswerSFT`` (from the repository root)."""

from typing import Any, ClassVar

from lit_instruct.batch import BatchKind
from lit_instruct.errors import ConfigError
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.loss.answer_logps import answer_logps
from lit_instruct.objectives import Objective, ObjectiveSums, Policy


class PerAnswerSFT(Objective):
    name: ClassVar[str] = "per_answer_sft"
    batch_kind: ClassVar[BatchKind] = "conversations"  # what the data module reads
    count_name: ClassVar[str] = "answers"  # the loss is averaged over answers: train/answers
    metric_names = ("answer_tokens",)  # logged as train/answer_tokens, val/answer_tokens (means)

    def __init__(self, min_tokens: int = 1) -> None:
        self.min_tokens = min_tokens  # answers with fewer labelled tokens are left out

    def check(self, settings: dict[str, Any]) -> None:
        super().check(settings)
        if settings.get("packing"):  # a packed row holds several answers
            raise ConfigError("model.packing", "must be false with model.objective: per_answer_sft")

    def sums(self, policy: Policy, batch: dict[str, Any]) -> ObjectiveSums:
        hidden, aux = policy.trunk(batch)  # (B, T, H), the router's loss of an MoE model (or None)
        labels = batch["labels"][:, 1:]  # position p predicts p + 1
        weight, bias = policy.output_weights()
        logps = answer_logps(hidden[:, :-1], weight, labels, bias=bias, transform=policy.logit_transform)
        tokens = (labels != IGNORE_INDEX).sum(dim=1)
        kept = tokens >= self.min_tokens
        nll = -logps[kept] / tokens[kept]  # each answer's mean token NLL
        metric = tokens[kept].double().sum().reshape(1)
        return ObjectiveSums(nll.sum(), int(kept.sum()), metric, int(tokens[kept].sum()), aux)
