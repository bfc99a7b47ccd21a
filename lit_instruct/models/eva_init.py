"""EVA: each adapter's A from the top right-singular vectors of its layer's inputs on the training data,
ranks redistributed across layers by explained variance (peft's EVA: ``get_eva_state_dict``, then
``initialize_lora_eva_weights``).

The data pass runs when the fit starts (the model is built before the data exists): training batches
go through the decoder trunk, peft's hooks collect each adapted layer's inputs at the response tokens,
and its incremental SVD steps until the components converge (``EvaConfig.tau``). peft sets no limit:
it cycles its loader until then (and asks for its length, which a stream has not). Here the pass takes
at most :data:`EVA_BATCHES` batches from the loader (a stream included) and makes at most that many
SVD steps, cycling the batches taken as peft does when there are fewer; the components left unconverged
then are taken as they stand (with a log line). The fused LoRA layers (which bypass peft's layer
forwards, and so its hooks) are put in afterwards.

The ranks it draws depend on the data and on the device's arithmetic, so they travel with the run: a
checkpoint records them, and a fit resumed from it rebuilds its adapters with them, without a data pass
(:func:`apply_eva_ranks`; the checkpoint's weights then replace the rebuilt ones).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger("lit_instruct")

EVA_BATCHES = 128
"""Most training batches (and SVD steps) of EVA's data pass. peft stops when, for every layer, the
``round(r * rho)`` components it computes (``rho``: 2) agree with the previous step's to a cosine
similarity of ``tau`` (0.99) as far as the rank it would give the layer; more components take more
steps. Measured on SmolLM2-135M-Instruct, chatterbot conversations in batches of 8: every layer
converged after 40 steps at ``r`` 8 and 58 at ``r`` 16. 128 leaves twice that; a pass that needs
more takes its components as they stand (a log line says so). 128 batches of token ids are tens of
MB at most."""

STREAM_POSITION = "stream_position"
"""The key a streamed batch carries its place in the stream under (not a model input)."""


@dataclass(frozen=True)
class EvaResult:
    """What a data pass drew: every adapted layer's rank (0: peft removed its adapter), how many
    batches it took from the loader, how many SVD steps it made, and whether they converged."""

    ranks: dict[str, int]
    batches: int
    steps: int
    converged: bool


def take_batches(loader: Iterable[dict[str, Any]], limit: int = EVA_BATCHES) -> list[dict[str, Any]]:
    """The first ``limit`` batches of ``loader`` (an endless stream included), less their stream
    positions (reading them does not move the training stream: it keeps its own place)."""
    taken = [
        {k: v for k, v in batch.items() if k != STREAM_POSITION} for batch in itertools.islice(loader, limit)
    ]
    if not taken:
        raise ValueError("model.lora.init: eva needs training batches, and the training loader gave none")
    return taken


class StepBudget:
    """``forward`` for peft's EVA loop, which cycles through its batches until every layer's
    components converge: after ``budget`` SVD steps the components are taken as they stand (peft's
    loop then ends at its next convergence check).

    Raises:
        ValueError: when after twice that no batch has had enough tokens for some layer's SVD.
    """

    def __init__(self, forward: Callable[[Any, dict], Any], budget: int) -> None:
        self.forward, self.budget = forward, budget
        self.steps = 0
        self.converged = True

    def __call__(self, model: Any, inputs: dict[str, Any]) -> Any:
        from peft.tuners.lora.eva import SVDHook

        hooks = [h for m in model.modules() for h in m._forward_hooks.values() if isinstance(h, SVDHook)]
        result = self.forward(model, inputs)
        if not hooks:  # peft's first forward, which finds the layers that share an input
            return result
        self.steps += 1
        started = all(hasattr(h.svd, "components_") for h in hooks)  # each had a batch with enough tokens
        if self.steps >= self.budget and started:
            self._stop(hooks)
        elif self.steps >= 2 * self.budget:
            raise ValueError(
                "model.lora.init: eva needs batches with at least r * rho (peft's EvaConfig.rho, 2) trained "
                "tokens for its SVD; these have fewer: use larger batches"
            )
        return result

    def _stop(self, hooks: list[Any]) -> None:
        """End peft's loop: mark every component converged (noting whether all were)."""
        self.converged = all(bool(h.converged.all()) for h in hooks)
        for hook in hooks:
            hook.converged[:] = True


def eva_state_dict(
    peft_model: Any, batches: list[dict[str, Any]], trunk: Callable[[dict], Any], max_steps: int
) -> tuple[dict[str, torch.Tensor], StepBudget]:
    """peft's EVA components for each adapted layer of ``peft_model`` from ``batches`` (cycled)
    through ``trunk``, in at most ``max_steps`` SVD steps, and the budget that counted them."""
    from peft.tuners.lora import eva
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    budget = StepBudget(lambda model, inputs: trunk(inputs), max_steps)
    was_training = peft_model.training
    peft_model.eval()
    # peft hooks every module with a ``base_layer``: new tokens' rows (trainable tokens) and modules
    # saved whole have one too, though they hold no LoRA (and the trunk never calls the head)
    lora_only = eva.UNSUPPORTED_LORA_MODULES
    eva.UNSUPPORTED_LORA_MODULES = (*lora_only, AuxiliaryTrainingWrapper, TrainableTokensLayer)  # type: ignore[assignment]
    try:
        with torch.no_grad():
            state = eva.get_eva_state_dict(peft_model, batches, forward_fn=budget, show_progress_bar=False)
    finally:
        eva.UNSUPPORTED_LORA_MODULES = lora_only
        peft_model.train(was_training)
    return state, budget


def eva_data_pass(
    peft_model: Any,
    loader: Iterable[dict[str, Any]],
    trunk: Callable[[dict], Any],
    max_batches: int = EVA_BATCHES,
) -> EvaResult:
    """Set ``peft_model``'s adapters (built with ``init_lora_weights="eva"``) from at most
    ``max_batches`` batches of ``loader`` run through ``trunk`` (the decoder without the head), in at
    most as many SVD steps (fewer batches are cycled, as peft does); its config then records the ranks."""
    from peft.tuners.lora.eva import initialize_lora_eva_weights

    batches = take_batches(loader, max_batches)
    state, budget = eva_state_dict(peft_model, batches, trunk, max_batches)
    adapted = {name for name, _ in _lora_layers(peft_model)}
    ranks = {name: int(a.shape[0]) for name, a in state.items() if name in adapted}
    initialize_lora_eva_weights(peft_model, eva_state_dict=state)
    result = EvaResult(ranks, len(batches), budget.steps, budget.converged)
    if not result.converged:
        logger.info("EVA: not converged after %s SVD steps: components taken as they stand", result.steps)
    log_ranks(f"set from {result.batches} training batches", ranks, peft_model.peft_config["default"].r)
    return result


def apply_eva_ranks(peft_model: Any, ranks: dict[str, int]) -> None:
    """Rebuild the adapters of ``peft_model`` (built with ``init_lora_weights="eva"``) with the
    ``ranks`` of an earlier data pass, as peft sets them from its components (rank and scaling
    patterns, adapters of rank 0 removed), without one: the A matrices are zeros, for a checkpoint's
    weights to replace."""
    from peft.tuners.lora.eva import initialize_lora_eva_weights

    layers = dict(_lora_layers(peft_model))
    if not set(ranks) <= set(layers):
        unknown = sorted(set(ranks) - set(layers))
        raise ValueError(f"the checkpoint has EVA ranks for layers this model does not adapt: {unknown[:4]}")
    state = {}
    for name, rank in ranks.items():
        weight = layers[name].lora_A["default"].weight
        state[name] = weight.new_zeros(rank, weight.shape[1])
    initialize_lora_eva_weights(peft_model, eva_state_dict=state)
    log_ranks("rebuilt with the checkpoint's ranks", ranks, peft_model.peft_config["default"].r)


def _lora_layers(peft_model: Any) -> list[tuple[str, Any]]:
    """The LoRA layers EVA sets (peft's: those with a base layer, less the kinds it cannot set)."""
    from peft.tuners.lora.eva import UNSUPPORTED_LORA_MODULES
    from peft.tuners.lora.layer import LoraLayer

    return [
        (name, module)
        for name, module in peft_model.named_modules()
        if isinstance(module, LoraLayer) and not isinstance(module, UNSUPPORTED_LORA_MODULES)
    ]


def log_ranks(how: str, ranks: dict[str, int], r: int) -> None:
    """One log line on the ranks EVA gave."""
    values = list(ranks.values())
    logger.info(
        "EVA: adapters %s; ranks %s..%s (%s in all, r=%s each before)",
        how,
        min(values),
        max(values),
        sum(values),
        r,
    )
