"""Online RL objectives: GRPO and RLOO, as TRL 1.16's ``GRPOTrainer`` and ``RLOOTrainer`` train.

Each micro-batch of prompts is rolled out: ``num_generations`` completions per prompt sampled from
the policy as it is (:mod:`~lit_instruct.objectives.sampler`), decoded and scored by the rewards
(:mod:`lit_instruct.rewards`), their advantages taken within each prompt's group, and the loss of
:mod:`~lit_instruct.objectives.rollout_loss` computed on them. Groups stay whole on a rank; a rank's
padding repeats are sampled but count nothing. Each completion's log-probability under the policy
is the chunked lm_head path's, at the sampling temperature.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from lit_instruct.batch import BatchKind
from lit_instruct.errors import ConfigError
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.loss.grpo import (
    ImportanceSampling,
    ScaleRewards,
    group_advantages,
    leave_one_out_advantages,
    nan_std,
    rloo_rewards,
    weighted_rewards,
)
from lit_instruct.objectives.base import Objective, ObjectiveSums, Policy
from lit_instruct.objectives.pairs import refuse_outside_pairs
from lit_instruct.objectives.rollout_loss import (
    METRIC_NAMES,
    GRPOLossSettings,
    RLOOLossSettings,
    completion_logps,
    grpo_sums,
    reference_logps,
    rloo_sums,
    rollout_metrics,
)
from lit_instruct.objectives.sampler import Completion, Sampler, SamplingSettings, TransformersSampler
from lit_instruct.rewards.base import OnError, Reward, resolve_rewards, score

GROUP = "model.objective.init_args"
ROLLOUT_SUMS = (
    "skipped_groups",
    "completions",
    "truncated",
    "completion_length",
    "zero_std",
    "reward",
    "reward_square",
    "scored",
)


@dataclass
class Rollout:
    """A micro-batch rolled out: the batch the loss reads, and the sums of what was sampled."""

    batch: dict[str, Any]
    sums: torch.Tensor
    tokens: int


class OnlineObjective(Objective):
    """What GRPO and RLOO share: the prompts' rollouts. Subclasses supply the advantages and the loss."""

    batch_kind: ClassVar[BatchKind] = "prompts"
    count_name: ClassVar[str] = "completions"
    monitor: ClassVar[tuple[str, str]] = ("val/reward", "max")  # the policy loss says nothing of it
    sequence_clips: bool = False

    def __init__(
        self,
        rewards: Any,
        num_generations: int,
        max_completion_length: int,
        temperature: float,
        top_p: float,
        top_k: int,
        mask_truncated_completions: bool,
        on_reward_error: OnError,
        seed: int,
        num_iterations: int = 1,
        merge_for_sampling: bool = True,
    ) -> None:
        if isinstance(num_iterations, bool) or not isinstance(num_iterations, int) or num_iterations < 1:
            raise ConfigError(
                f"{GROUP}.num_iterations",
                f"must be 1 or more (optimizer steps per rollout), got {num_iterations!r}",
            )
        if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 2:
            raise ConfigError(
                f"{GROUP}.num_generations",
                f"must be 2 or more (advantages compare a prompt's completions), got {num_generations!r}",
            )
        if isinstance(max_completion_length, bool) or not isinstance(max_completion_length, int):
            raise ConfigError(
                f"{GROUP}.max_completion_length", f"must be a whole number, got {max_completion_length!r}"
            )
        if max_completion_length < 1:
            raise ConfigError(
                f"{GROUP}.max_completion_length", f"must be 1 or more, got {max_completion_length}"
            )
        if not temperature > 0:
            raise ConfigError(f"{GROUP}.temperature", f"must be > 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ConfigError(f"{GROUP}.top_p", f"must be in (0, 1], got {top_p}")
        if not top_k >= 0:
            raise ConfigError(f"{GROUP}.top_k", f"must be 0 (off) or more, got {top_k}")
        if on_reward_error not in ("raise", "skip_group"):
            raise ConfigError(
                f"{GROUP}.on_reward_error", f"must be raise or skip_group, got {on_reward_error!r}"
            )
        self.rewards = rewards
        self.reward_list: list[Reward] = resolve_rewards(rewards, f"{GROUP}.rewards")
        self.num_generations = num_generations
        self.max_completion_length = max_completion_length
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.mask_truncated_completions = mask_truncated_completions
        self.on_reward_error = on_reward_error
        self.seed = seed
        self.num_iterations = num_iterations
        self.merge_for_sampling = merge_for_sampling
        self._kept: dict[str, Any] = {"step": -1, "rank": 0, "items": {}}
        """The rollouts of the last sampling step (``num_iterations`` > 1), by micro-batch index."""
        reward_sums = [
            f"rewards/{r.name}/{part}" for r in self.reward_list for part in ("sum", "square", "count")
        ]
        self.metric_names = (*METRIC_NAMES, *ROLLOUT_SUMS, *reward_sums)
        self.tokenizer: Any = None
        self.sampler: Sampler | None = None
        self._calls: dict[bool, tuple[int, int]] = {}  # by mode: the step and its last micro-batch
        self.sampling_seconds = 0.0
        """Time spent sampling completions in training steps (a report's: reset as it likes)."""
        self.sampled_tokens = 0
        self.last_rollout: list[dict[str, Any]] = []
        """The last training micro-batch's completions: prompt, completion, each reward, advantage."""

    def check(self, settings: Mapping[str, Any]) -> None:
        super().check(settings)
        refuse_outside_pairs(self, settings)

    # -- the rollout ----------------------------------------------------------------------------

    def bind(self, tokenizer: Any, sampler: Sampler | None = None) -> None:
        """The tokenizer that decodes completions (and the sampler, default: the policy's
        ``generate``): the module's data module's, found on the first step otherwise."""
        self.tokenizer = tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        settings = SamplingSettings(self.max_completion_length, self.temperature, self.top_p, self.top_k)
        self.sampler = sampler or TransformersSampler(settings, [tokenizer.eos_token_id], pad)

    @property
    def window_repeats(self) -> int:
        return self.num_iterations

    def _place(self, policy: Policy, training: bool) -> tuple[int, int, int]:
        """The optimizer step, this micro-batch's index within it and the rank."""
        trainer = getattr(policy, "_trainer", None)
        step = trainer.global_step if trainer is not None else 0
        rank = trainer.global_rank if trainer is not None else 0
        last_step, last_index = self._calls.get(training, (step, -1))  # training and validation apart:
        index = last_index + 1 if last_step == step else 0  # a validation inside a step leaves it be
        self._calls[training] = (step, index)
        return step, index, rank

    def _seed(self, policy: Policy, training: bool, step: int, index: int, rank: int) -> int:
        """A seed per micro-batch: from ``seed``, the step and the micro-batch's place in the step's
        global batches (micro-batch ``i`` of rank ``r`` of ``W``: ``i * W + r``, the place one process
        accumulating ``W`` times as many gives it: the same prompts, so the same completions)."""
        trainer = getattr(policy, "_trainer", None)
        world = trainer.world_size if trainer is not None else 1
        place = index * world + rank
        return zlib.crc32(f"{self.seed}/{int(training)}/{step}/{place}".encode()) & 0x7FFFFFFF

    def roll_out(self, policy: Policy, batch: Mapping[str, Any], training: bool, seed: int) -> Rollout:
        """Sample, decode, score and lay out a micro-batch of prompts (``batch``: a
        :class:`~lit_instruct.data.prompts.PromptCollator`'s)."""
        if self.sampler is None:
            datamodule = getattr(getattr(policy, "_trainer", None), "datamodule", None)
            if datamodule is None:
                raise ValueError(
                    f"{self.name}: no tokenizer to decode completions with: call bind(tokenizer)"
                )
            self.bind(datamodule.load_tokenizer())
        assert self.sampler is not None
        g = self.num_generations
        started = time.perf_counter()
        with policy.sampling_model(merged=self.merge_for_sampling) as model:
            completions = self.sampler.sample(model, batch["prompt_ids"], g, seed)
        if training:
            self.sampling_seconds += time.perf_counter() - started
            self.sampled_tokens += sum(len(c.ids) for c in completions)
        counted = torch.tensor([c for c in batch["counted"] for _ in range(g)], dtype=torch.bool)
        texts = [self.tokenizer.decode(c.ids, skip_special_tokens=True) for c in completions]
        prompts = [p for p in batch["prompts"] for _ in range(g)]
        columns = {name: [v for v in values for _ in range(g)] for name, values in batch["columns"].items()}
        columns["completion_ids"] = [c.ids for c in completions]
        conversations = [[{"role": "assistant", "content": text}] for text in texts]
        table, skipped = score(self.reward_list, prompts, conversations, columns, g, self.on_reward_error)
        rows = layout(
            [p for p in batch["prompt_ids"] for _ in range(g)],
            completions,
            counted,
            self.mask_truncated_completions,
        )
        rows["rewards"] = table
        rows["texts"] = texts
        sums = self._rollout_sums(completions, table, counted, skipped)
        tokens = int(rows["attention_mask"].sum())
        return Rollout(rows, sums, tokens)

    def total_rewards(self, table: torch.Tensor) -> torch.Tensor:
        """Each completion's weighted reward (NaN where no reward applies)."""
        return weighted_rewards(table, torch.tensor([r.weight for r in self.reward_list]))

    def _rollout_sums(
        self, completions: list[Completion], table: torch.Tensor, counted: torch.Tensor, skipped: int
    ) -> torch.Tensor:
        total = self.total_rewards(table)
        scored = counted & ~total.isnan()
        g = self.num_generations
        grouped = total.view(-1, g)
        zero = torch.isclose(nan_std(grouped, dim=1), torch.zeros(())).repeat_interleave(g) & counted
        lengths = torch.tensor([len(c.ids) for c in completions], dtype=torch.float64)
        truncated = torch.tensor([c.truncated for c in completions], dtype=torch.float64)
        kept = total[scored].double()
        values: list[float] = [
            float(skipped),
            float(counted.sum()),
            float(truncated[counted].sum()),
            float(lengths[counted].sum()),
            float(zero.sum()),
            float(kept.sum()),
            float((kept**2).sum()),
            float(scored.sum()),
        ]
        for column in range(table.shape[1]):
            mine = table[:, column][counted]
            mine = mine[~mine.isnan()].double()
            values += [float(mine.sum()), float((mine**2).sum()), float(len(mine))]
        return torch.tensor(values, dtype=torch.float64)

    # -- the step -------------------------------------------------------------------------------

    def sums(self, policy: Policy, batch: dict[str, Any]) -> ObjectiveSums:
        if "prompt_ids" not in batch:
            raise ValueError(
                f"{self.name} takes prompts: batches of an InstructDataModule(batch_kind='prompts')"
            )
        training = bool(getattr(policy.model, "training", True))
        step, index, rank = self._place(policy, training)
        if training and step % self.num_iterations:  # a later iteration: the kept rollout, as it was
            rollout = self._reused(step - step % self.num_iterations, index, rank, batch)
            rows = _on(rollout.batch, policy.device)
        else:
            rollout = self.roll_out(policy, batch, training, self._seed(policy, training, step, index, rank))
            rows = _on(rollout.batch, policy.device)
            rows["advantages"] = self.advantages(policy, rows).to(policy.device)
            if training and self.num_iterations > 1:  # the policy's log-probs now: the "old" ones after
                self._old_logps(policy, rows)
                self._keep_rollout(step, index, rank, batch, rows, rollout)
        if training:
            self._keep(batch, rows)
        loss = self.loss_sums(policy, rows)
        batch["num_tokens"] = rollout.tokens  # what the window counts as the step's tokens
        assert loss.metric_sums is not None
        metric_sums = torch.cat([loss.metric_sums, rollout.sums.to(loss.metric_sums.device)])
        return ObjectiveSums(loss.loss_sum, loss.count, metric_sums, loss.answer_tokens, loss.aux)

    def _old_logps(self, policy: Policy, rows: dict[str, Any]) -> None:
        """The log-probs a rollout's later iterations take as the old policy's (and the reference's)."""
        if "old_logps" not in rows:
            rows["old_logps"] = completion_logps(policy, rows, self.temperature)
        if self.needs_reference and "reference_logps" not in rows:
            rows["reference_logps"] = reference_logps(policy, rows, self.temperature)

    def _keep_rollout(
        self,
        step: int,
        index: int,
        rank: int,
        batch: Mapping[str, Any],
        rows: dict[str, Any],
        rollout: Rollout,
    ) -> None:
        """Keep a sampling step's micro-batch rollout for the ``num_iterations - 1`` steps after it."""
        if self._kept["step"] != step or index == 0:
            self._kept = {"step": step, "rank": rank, "items": {}}
        self._kept["items"][index] = {
            "prompt_ids": [list(p) for p in batch["prompt_ids"]],
            "rows": {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in rows.items()},
            "sums": rollout.sums,
            "tokens": rollout.tokens,
        }

    def _reused(self, step: int, index: int, rank: int, batch: Mapping[str, Any]) -> Rollout:
        """The rollout sampled at ``step`` for micro-batch ``index``; refused unless the batch holds the
        same prompts (the data gives each window ``num_iterations`` times: ``InstructDataModule`` does)."""
        kept = self._kept
        item = kept["items"].get(index) if kept["step"] == step and kept["rank"] == rank else None
        if item is None:
            raise RuntimeError(
                f"{self.name}: num_iterations={self.num_iterations} reuses the rollout of step {step}, "
                f"and none is kept for micro-batch {index} (resumed from a checkpoint without it?)"
            )
        if [list(p) for p in batch["prompt_ids"]] != item["prompt_ids"]:
            raise RuntimeError(
                f"{self.name}: num_iterations={self.num_iterations} trains each rollout for "
                f"{self.num_iterations} optimizer steps, but the batch of step {step + 1} holds other "
                "prompts than the one sampled for it: the data must give each window of batches "
                f"{self.num_iterations} times (InstructDataModule does, with the module's setup)"
            )
        return Rollout(dict(item["rows"]), item["sums"], item["tokens"])

    def state_dict(self) -> dict[str, Any]:
        return {"rollouts": self._kept} if self.num_iterations > 1 else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "rollouts" in state:
            self._kept = dict(state["rollouts"])

    def _keep(self, batch: Mapping[str, Any], rows: Mapping[str, Any]) -> None:
        """The micro-batch's completions as rows of text (``last_rollout``)."""
        g = self.num_generations
        texts = rows.get("texts", [])
        kept = []
        for k, text in enumerate(texts):
            prompt = batch["prompts"][k // g]
            row = {"prompt": str(prompt[-1].get("content", "")), "completion": text}
            for column, reward in enumerate(self.reward_list):
                row[reward.name] = float(rows["rewards"][k, column])
            row["advantage"] = float(rows["advantages"][k])
            kept.append(row)
        self.last_rollout = kept

    def advantages(self, policy: Policy, rows: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError

    def loss_sums(self, policy: Policy, rows: dict[str, Any]) -> ObjectiveSums:
        raise NotImplementedError

    def metrics(self, sums: Mapping[str, float], count: int) -> dict[str, float]:
        """TRL's names: the loss's metrics (:func:`rollout_metrics`), ``reward`` and ``reward_std``
        (of the weighted sum), ``rewards/<name>/mean`` and ``/std``, ``frac_reward_zero_std``,
        ``completions/mean_length`` and ``completions/clipped_ratio`` (those that did not stop)."""
        out = rollout_metrics(sums, self.sequence_clips)
        if not self.needs_reference:  # no KL term (TRL logs none)
            del out["kl"]
        completions = max(sums["completions"], 1.0)
        out["reward"], out["reward_std"] = _mean_std(sums["reward"], sums["reward_square"], sums["scored"])
        for reward in self.reward_list:
            stem = f"rewards/{reward.name}"
            mean, std = _mean_std(sums[f"{stem}/sum"], sums[f"{stem}/square"], sums[f"{stem}/count"])
            out[f"{stem}/mean"], out[f"{stem}/std"] = mean, std
        out["frac_reward_zero_std"] = sums["zero_std"] / completions
        out["completions/mean_length"] = sums["completion_length"] / completions
        out["completions/clipped_ratio"] = sums["truncated"] / completions
        if self.on_reward_error == "skip_group":  # groups a reward failed on (scored NaN): a count
            out["skipped_groups"] = sums["skipped_groups"]
        return out


def layout(
    prompt_ids: list[list[int]], completions: list[Completion], counted: torch.Tensor, mask_truncated: bool
) -> dict[str, Any]:
    """Rollouts as right-padded rows (prompt, completion) with the completion tokens labelled; none of
    a padding repeat's, nor (``mask_truncated``) of a completion that did not stop."""
    rows, labels = [], []
    for prompt, completion, count in zip(prompt_ids, completions, counted.tolist(), strict=True):
        scored = count and not (mask_truncated and completion.truncated)
        rows.append(prompt + completion.ids)
        answer = completion.ids if scored else [IGNORE_INDEX] * len(completion.ids)
        labels.append([IGNORE_INDEX] * len(prompt) + answer)
    width = max(map(len, rows))
    return {
        "input_ids": torch.tensor([r + [0] * (width - len(r)) for r in rows]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        "labels": torch.tensor([lab + [IGNORE_INDEX] * (width - len(lab)) for lab in labels]),
        "counted": counted,
    }


def _on(rows: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """``rows`` with its tensors on ``device``."""
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in rows.items()}


def _mean_std(total: float, square: float, count: float) -> tuple[float, float]:
    """The mean and unbiased standard deviation from a sum, a sum of squares and a count."""
    if count < 1:
        return math.nan, math.nan
    mean = total / count
    variance = (square - total * mean) / (count - 1) if count > 1 else math.nan
    return mean, math.sqrt(max(variance, 0.0)) if count > 1 else math.nan


def _batch_std(values: torch.Tensor, policy: Policy) -> torch.Tensor:
    """The unbiased standard deviation of the values that are not NaN, over every rank."""
    kept = values[~values.isnan()].double()
    local = torch.stack([kept.sum(), (kept**2).sum(), kept.new_tensor(float(len(kept)))])
    total, square, count = policy.sum_over_ranks(local.to(policy.device)).tolist()
    _, std = _mean_std(total, square, count)
    return values.new_tensor(std)


class GRPO(OnlineObjective):
    """GRPO, exact to TRL 1.16's ``GRPOTrainer`` (its settings' names and defaults)."""

    name: ClassVar[str] = "grpo"

    def __init__(
        self,
        rewards: Any = None,
        num_generations: int = 8,
        max_completion_length: int = 512,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo"] = "dapo",
        scale_rewards: ScaleRewards = "group",
        beta: float = 0.0,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        importance_sampling_level: ImportanceSampling = "token",
        delta: float | None = None,
        use_bias_correction_kl: bool = True,
        mask_truncated_completions: bool = False,
        num_iterations: int = 1,
        on_reward_error: OnError = "raise",
        seed: int = 0,
        merge_for_sampling: bool = True,
    ) -> None:
        super().__init__(
            rewards,
            num_generations,
            max_completion_length,
            temperature,
            top_p,
            top_k,
            mask_truncated_completions,
            on_reward_error,
            seed,
            num_iterations,
            merge_for_sampling,
        )
        if scale_rewards not in ("group", "batch", "none"):
            raise ConfigError(
                f"{GROUP}.scale_rewards", f"must be group, batch or none, got {scale_rewards!r}"
            )
        try:
            self.loss_settings = GRPOLossSettings(
                loss_type,
                beta,
                epsilon,
                epsilon_high,
                importance_sampling_level,
                delta,
                use_bias_correction_kl,
                temperature,
                max_completion_length,
            )
        except ValueError as error:
            raise ConfigError(GROUP, str(error)) from None
        self.loss_type = loss_type
        self.scale_rewards = scale_rewards
        self.beta = beta
        self.epsilon = epsilon
        self.epsilon_high = epsilon_high
        self.importance_sampling_level = importance_sampling_level
        self.delta = delta
        self.use_bias_correction_kl = use_bias_correction_kl
        self.sequence_clips = importance_sampling_level == "sequence"
        self.count_name = {  # type: ignore[misc]  # what this loss type averages over
            "grpo": "completions",
            "dapo": "completion_tokens",
            "dr_grpo": "completion_slots",
            "bnpo": "micro_batches",
        }[loss_type]

    @property
    def needs_reference(self) -> bool:
        return self.beta != 0.0

    def advantages(self, policy: Policy, rows: dict[str, Any]) -> torch.Tensor:
        total = self.total_rewards(rows["rewards"])
        batch_std = _batch_std(total, policy).to(total) if self.scale_rewards == "batch" else None
        return group_advantages(total, self.num_generations, self.scale_rewards, batch_std).values

    def loss_sums(self, policy: Policy, rows: dict[str, Any]) -> ObjectiveSums:
        return grpo_sums(policy, rows, self.loss_settings)


class RLOO(OnlineObjective):
    """RLOO, exact to TRL 1.16's ``RLOOTrainer`` (its settings' names and defaults): the
    leave-one-out baseline, the KL as a penalty in the reward (``beta``)."""

    name: ClassVar[str] = "rloo"
    sequence_clips = True

    def __init__(
        self,
        rewards: Any = None,
        num_generations: int = 2,
        max_completion_length: int = 512,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        beta: float = 0.05,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        normalize_advantages: bool = False,
        mask_truncated_completions: bool = False,
        num_iterations: int = 1,
        on_reward_error: OnError = "raise",
        seed: int = 0,
        merge_for_sampling: bool = True,
    ) -> None:
        super().__init__(
            rewards,
            num_generations,
            max_completion_length,
            temperature,
            top_p,
            top_k,
            mask_truncated_completions,
            on_reward_error,
            seed,
            num_iterations,
            merge_for_sampling,
        )
        self.beta = beta
        self.epsilon = epsilon
        self.epsilon_high = epsilon_high
        self.normalize_advantages = normalize_advantages
        self.loss_settings = RLOOLossSettings(epsilon, epsilon_high, temperature)

    @property
    def needs_reference(self) -> bool:
        return self.beta != 0.0

    def advantages(self, policy: Policy, rows: dict[str, Any]) -> torch.Tensor:
        total = self.total_rewards(rows["rewards"]).to(policy.device)
        if self.beta != 0.0:
            labels = rows["labels"][:, 1:]
            old = completion_logps(policy, rows, self.temperature)
            reference = reference_logps(policy, rows, self.temperature)
            rows["old_logps"], rows["reference_logps"] = old, reference
            total = rloo_rewards(total, old, reference, labels, self.beta)
        return leave_one_out_advantages(total, self.num_generations, self.normalize_advantages)

    def loss_sums(self, policy: Policy, rows: dict[str, Any]) -> ObjectiveSums:
        return rloo_sums(policy, rows, self.loss_settings)
