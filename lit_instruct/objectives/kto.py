"""KTO (Ethayarajh et al., 2024) as TRL 1.16's ``KTOTrainer`` computes it, on unpaired answers labelled
desirable or not (:mod:`lit_instruct.data.unpaired`).

Each answer's log-ratio ``r = log π(y|x) - log π_ref(y|x)`` (summed over its tokens) is compared with
a KL estimate ``z``: the mean over the batch's KL rows (each prompt with another answer's completion)
of the same log-ratio, without gradient, averaged over all ranks and then clamped at 0. A desirable
answer's loss is ``w_d (1 - σ(β (r - z)))``, an undesirable one's ``w_u (1 - σ(β (z - r)))``
(``apo_zero_unpaired``: ``w_d (1 - σ(β r))`` and ``w_u σ(β r)``, no KL rows scored); the loss is their
mean over the answers (TRL's ``nanmean``: divided by the answers, not by the weights). The reference
is the module's: the adapter off, or the SFT adapter training continued from.

Over an accumulation window the answers of every micro-batch weigh alike (TRL: a mean of the
micro-batches' means; equal when they hold as many answers). The KL estimate over ranks is the mean
over all their counted KL rows (TRL: the mean of each rank's mean; equal when the ranks hold as many).
Metrics (TRL's names): ``kl``, ``rewards/chosen``, ``rewards/rejected`` (``β r``, means over the
desirable / undesirable answers), ``rewards/margins``, ``logps/chosen``, ``logps/rejected``; over a
window, pooled means (TRL: means of the micro-batches' means).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import torch

from lit_instruct.batch import BatchKind, num_response_tokens
from lit_instruct.errors import ConfigError
from lit_instruct.loss.answer_logps import answer_logps
from lit_instruct.objectives.base import Objective, ObjectiveSums, Policy
from lit_instruct.objectives.pairs import GROUP, refuse_outside_pairs

KTOLoss = Literal["kto", "apo_zero_unpaired"]
SIDES = ("chosen", "rejected")


def sequence_logps(policy: Policy, rows: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's summed log-probability of its labelled tokens (``(R,)`` fp32), and the trunk's
    auxiliary loss."""
    hidden, aux = policy.trunk(rows)
    weight, bias = policy.output_weights()
    labels = rows["labels"][:, 1:]
    logps = answer_logps(hidden[:, :-1], weight, labels, bias=bias, transform=policy.logit_transform)
    return logps, aux


def rows_of(batch: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    """Rows ``start:stop`` of a batch's tensors."""
    return {k: batch[k][start:stop] for k in ("input_ids", "attention_mask", "labels") if k in batch}


class KTO(Objective):
    """KTO, exact to TRL's ``KTOTrainer``: ``beta``, ``desirable_weight``, ``undesirable_weight`` and
    ``loss_type`` (``kto``, or ``apo_zero_unpaired``) as there, with TRL's defaults."""

    name: ClassVar[str] = "kto"
    batch_kind: ClassVar[BatchKind] = "unpaired"
    count_name: ClassVar[str] = "answers"
    metric_names = (
        "kl",
        "rewards/chosen_sum",
        "logps/chosen_sum",
        "count/chosen",
        "rewards/rejected_sum",
        "logps/rejected_sum",
        "count/rejected",
    )

    def __init__(
        self,
        beta: float = 0.1,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        loss_type: KTOLoss = "kto",
    ) -> None:
        for setting, value in (("beta", beta), ("desirable_weight", desirable_weight)):
            if not value > 0:
                raise ConfigError(f"{GROUP}.{setting}", f"must be > 0, got {value}")
        if not undesirable_weight > 0:
            raise ConfigError(f"{GROUP}.undesirable_weight", f"must be > 0, got {undesirable_weight}")
        if loss_type not in ("kto", "apo_zero_unpaired"):
            raise ConfigError(f"{GROUP}.loss_type", f"{loss_type!r} is none of kto, apo_zero_unpaired")
        self.beta = beta
        self.desirable_weight = desirable_weight
        self.undesirable_weight = undesirable_weight
        self.loss_type = loss_type

    @property
    def needs_reference(self) -> bool:
        return True

    def check(self, settings: Mapping[str, Any]) -> None:
        super().check(settings)
        refuse_outside_pairs(self, settings)

    def sums(self, policy: Policy, batch: dict[str, Any]) -> ObjectiveSums:
        if "desirable" not in batch:
            raise ValueError("KTO takes unpaired answers: an InstructDataModule with batch_kind='unpaired'")
        n = len(batch["desirable"])
        with_kl = self.loss_type == "kto"
        with torch.no_grad(), policy.reference_model():
            reference = sequence_logps(policy, batch if with_kl else rows_of(batch, 0, n))[0]
        logps, aux = sequence_logps(policy, rows_of(batch, 0, n))
        counted = batch.get("answer_mask", torch.ones(n, dtype=torch.bool)).to(logps.device)
        kl = logps.new_zeros(())
        if with_kl:
            with torch.no_grad():
                kl_logps = sequence_logps(policy, rows_of(batch, n, 2 * n))[0]
                kl_rows = counted & batch.get("kl_mask", counted).to(counted.device)
                ratios = (kl_logps - reference[n:])[kl_rows]
                local = torch.stack(
                    [ratios.double().sum(), ratios.new_tensor(len(ratios), dtype=torch.float64)]
                )
                totals = policy.sum_over_ranks(local)  # every rank's KL rows
                kl = (totals[0] / totals[1].clamp(min=1)).float().clamp(min=0)
        ratio = (logps - reference[:n])[counted]
        desirable = batch["desirable"].to(logps.device)[counted]
        if self.loss_type == "kto":
            losses = torch.where(
                desirable,
                self.desirable_weight * (1 - torch.sigmoid(self.beta * (ratio - kl))),
                self.undesirable_weight * (1 - torch.sigmoid(self.beta * (kl - ratio))),
            )
        else:
            losses = torch.where(
                desirable,
                self.desirable_weight * (1 - torch.sigmoid(self.beta * ratio)),
                self.undesirable_weight * torch.sigmoid(self.beta * ratio),
            )
        count = int(counted.sum())
        rewards = (self.beta * ratio).detach().double()
        chosen_logps = logps[counted].detach().double()
        sums = [kl.detach().double() * count]
        for side in (desirable, ~desirable):
            sums += [rewards[side].sum(), chosen_logps[side].sum(), side.sum().double()]
        loss_sum = losses.sum() if count else logps.sum() * 0.0  # only padding: a graph all the same
        return ObjectiveSums(loss_sum, count, torch.stack(sums), num_response_tokens(batch), aux)

    def metrics(self, sums: Mapping[str, float], count: int) -> dict[str, float]:
        """TRL's metrics from the window's sums: ``kl``, and per side (those with answers) the mean
        reward and log-probability, ``rewards/margins`` when both sides have some."""
        metrics = {"kl": sums["kl"] / max(count, 1)}
        for side in SIDES:
            answers = sums[f"count/{side}"]
            if answers:
                metrics[f"rewards/{side}"] = sums[f"rewards/{side}_sum"] / answers
                metrics[f"logps/{side}"] = sums[f"logps/{side}_sum"] / answers
        if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        return metrics
