"""Sampling completions for online RL behind one small interface (:class:`Sampler`): here the policy in
memory through ``transformers``' ``generate`` (batched, KV cache); a vLLM backend (colocated, the
adapter pushed by name) would implement the same ``sample``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lit_instruct.contiguous_head import contiguous_head_input
from lit_instruct.distributed import is_sharded


@dataclass(frozen=True)
class SamplingSettings:
    """How completions are drawn (TRL's ``GRPOConfig`` names): up to ``max_completion_length`` new
    tokens, stopping after any of ``stop_ids``; ``top_k`` 0 is off."""

    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass(frozen=True)
class Completion:
    """One sampled completion: its tokens (through the stop token, if it stopped) and whether it ran
    out of tokens before stopping."""

    ids: list[int]
    truncated: bool


class Sampler(Protocol):
    """Draws ``num_generations`` completions per prompt, prompt by prompt in order (each prompt's
    consecutive), reproducibly for one ``seed``."""

    def sample(
        self, model: Any, prompt_ids: list[list[int]], num_generations: int, seed: int
    ) -> list[Completion]: ...


class Draw:
    """A ``generate`` logits processor that draws each row's next token itself: the scores warped as
    ``generate`` samples them (``transformers``' temperature, top-k and top-p warpers, in its order),
    then one uniform per row through the cumulative distribution (in fp32), every other token set to
    ``-inf`` so that the greedy step takes the drawn one. The same distribution as ``generate``'s
    sampling (which draws an exponential per vocabulary entry: most of a decoding step's time on a CPU
    for a small model), from a generator of its own."""

    def __init__(self, settings: SamplingSettings, generator: torch.Generator) -> None:
        from transformers import (
            LogitsProcessorList,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        warpers: list[Any] = []
        if settings.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(settings.temperature))
        if settings.top_k:
            warpers.append(TopKLogitsWarper(top_k=settings.top_k))
        if settings.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=settings.top_p))
        self.warpers = LogitsProcessorList(warpers)
        self.generator = generator

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = self.warpers(input_ids, scores)  # type: ignore[arg-type]  # a LongTensor by its values
        cdf = torch.softmax(scores.float(), dim=-1).cumsum_(dim=-1)
        draws = torch.rand((len(cdf), 1), generator=self.generator, device=cdf.device) * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, draws, right=True).clamp_(max=cdf.shape[-1] - 1)
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens, 0.0)


class TransformersSampler:
    """Samples with the model in memory: prompts left-padded into one batch, ``generate`` with the KV
    cache, in eval mode (no dropout), each token drawn by :class:`Draw` from a generator seeded for
    the call (training's random stream untouched). A model sharded over ranks (FSDP: each forward
    gathers the weights, a collective) decodes in step on every rank until all have stopped
    (``generate``'s ``synced_gpus``)."""

    def __init__(self, settings: SamplingSettings, stop_ids: list[int], pad_id: int) -> None:
        self.settings = settings
        self.stop_ids = list(stop_ids)
        self.pad_id = pad_id

    @torch.no_grad()
    def sample(
        self, model: Any, prompt_ids: list[list[int]], num_generations: int, seed: int
    ) -> list[Completion]:
        from transformers import LogitsProcessorList

        rows = [ids for ids in prompt_ids for _ in range(num_generations)]
        width = max(map(len, rows))
        device = next(model.parameters()).device
        input_ids = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        draw = Draw(self.settings, torch.Generator(device=device).manual_seed(seed))
        was_training = model.training
        model.eval()
        try:
            with contiguous_head_input(model):
                output = model.generate(
                    input_ids=input_ids,
                    attention_mask=mask,
                    max_new_tokens=self.settings.max_completion_length,
                    do_sample=False,  # Draw draws: the greedy step takes its token
                    # the model's own sampling defaults neither warped twice nor warned about (greedy
                    # takes these global defaults silently); no repetition penalty or min_p (TRL's)
                    temperature=1.0,
                    top_p=1.0,
                    top_k=50,
                    min_p=None,
                    repetition_penalty=1.0,
                    logits_processor=LogitsProcessorList([draw]),
                    eos_token_id=self.stop_ids,
                    pad_token_id=self.pad_id,
                    use_cache=True,
                    synced_gpus=_sharded(model),
                )
        finally:
            model.train(was_training)
        return [self._completion(row.tolist()) for row in output[:, width:]]

    def _completion(self, ids: list[int]) -> Completion:
        stops = set(self.stop_ids)
        for index, token in enumerate(ids):
            if token in stops:
                return Completion(ids[: index + 1], False)
        return Completion(ids, True)


def _sharded(model: Any) -> bool:
    """Whether ``model`` holds weights sharded over several ranks (DTensors of FSDP2)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    return any(is_sharded(p) for p in model.parameters())
