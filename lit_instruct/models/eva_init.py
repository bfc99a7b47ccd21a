"""EVA: each adapter's A from the top right-singular vectors of its layer's inputs on the training data,
ranks redistributed across layers by explained variance (peft's ``initialize_lora_eva_weights``).

The data pass runs when the fit starts (the model is built before the data exists): the training
batches go through the decoder trunk, peft's hooks collect each adapted layer's inputs at the response
tokens, and its incremental SVD stops once the components converge, or after one pass over the
training data (the components then taken as they stand, with a log line). The fused LoRA layers (which
bypass peft's layer forwards, and so its hooks) are put in afterwards. A resumed fit repeats the pass
on the same first batches under the same seed, so the checkpoint's adapter fits the same ranks (a
mismatch is a strict-load error, never a silent one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("lit_instruct")


def within_budget(forward: Callable[[Any, dict], Any], budget: int) -> Callable[[Any, dict], Any]:
    """``forward`` for peft's EVA loop, which cycles through the data until every layer's components
    converge: after ``budget`` batches the components are taken as they stand (the loop then ends).

    Raises:
        ValueError: when after twice that no batch has had enough tokens for some layer's SVD.
    """
    from peft.tuners.lora.eva import SVDHook

    seen = 0

    def bounded(model: Any, inputs: dict[str, Any]) -> Any:
        nonlocal seen
        result = forward(model, inputs)
        seen += 1
        hooks = [h for m in model.modules() for h in m._forward_hooks.values() if isinstance(h, SVDHook)]
        started = all(hasattr(h.svd, "components_") for h in hooks)  # each had a batch with enough tokens
        if seen >= budget and started:  # peft's loop ends at its next convergence check
            if any(not bool(h.converged.all()) for h in hooks):
                logger.info("EVA: not converged after %s batches: components taken as they stand", seen)
            for hook in hooks:
                hook.converged[:] = True
        elif seen >= 2 * budget:
            raise ValueError(
                "model.lora.init: eva needs batches with at least r * rho (peft's EvaConfig.rho, 2) trained "
                "tokens for its SVD; these have fewer: use larger batches"
            )
        return result

    return bounded


def initialise_eva(peft_model: Any, batches: list[dict[str, Any]], trunk: Callable[[dict], Any]) -> None:
    """Set ``peft_model``'s adapters (built with ``init_lora_weights="eva"``) from ``batches`` (one
    pass at most), run through ``trunk`` (the decoder without the head); its config then records the
    ranks."""
    from peft.tuners.lora.eva import initialize_lora_eva_weights

    forward = within_budget(lambda model, inputs: trunk(inputs), len(batches))
    was_training = peft_model.training
    peft_model.eval()
    with torch.no_grad():
        initialize_lora_eva_weights(peft_model, batches, forward_fn=forward, show_progress_bar=False)
    peft_model.train(was_training)
    config = peft_model.peft_config["default"]
    ranks = [module.r["default"] for module in peft_model.modules() if hasattr(module, "lora_A") and module.r]
    logger.info(
        "EVA: adapters set from the training data's layer inputs; ranks %s..%s (%s in all, r=%s each before)",
        min(ranks),
        max(ranks),
        sum(ranks),
        config.r,
    )
