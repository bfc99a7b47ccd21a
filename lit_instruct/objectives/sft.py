"""SFT: the causal-LM cross-entropy on response tokens only, averaged over every response token of
the window (``model.loss`` picks the implementation: the fused loss by default)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from lit_instruct.batch import BatchKind, num_response_tokens
from lit_instruct.objectives.base import Objective, ObjectiveSums, Policy


class SFT(Objective):
    """Supervised fine-tuning: the summed CE of each batch's response-token predictions over their
    count; ``val/ppl`` is the exponent of the held-out mean."""

    name: ClassVar[str] = "sft"
    batch_kind: ClassVar[BatchKind] = "conversations"
    count_name: ClassVar[str] = "response_tokens"
    val_count_name: ClassVar[str] = "tokens"
    token_loss: ClassVar[bool] = True

    def sums(self, policy: Policy, batch: dict[str, Any]) -> ObjectiveSums:
        if "num_pairs" in batch or "desirable" in batch:
            raise ValueError("SFT takes conversations: this batch holds pairs or labelled answers")
        hidden, aux = policy.trunk(batch)  # (B, T, H)
        shifted = hidden[:, :-1].reshape(-1, hidden.shape[-1])  # (B*(T-1), H): row p predicts p+1
        labels = batch["labels"][:, 1:].reshape(-1)  # (B*(T-1),)
        weight, bias = policy.output_weights()
        loss_sum = policy.loss_fn(
            shifted, weight, labels, bias=bias, transform=policy.logit_transform, reduction="sum"
        )
        count = num_response_tokens(batch)
        return ObjectiveSums(loss_sum, count, answer_tokens=count, aux=aux)

    def validation_metrics(self, loss: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"ppl": loss.float().exp()}  # of the fp32 mean: the value logged as val/loss
