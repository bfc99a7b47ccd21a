"""The router's auxiliary (load-balancing) loss of MoE models, added as their own forward adds it."""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lit_instruct.models.output_head import UnsupportedModelError

_CALL = re.compile(
    r"aux_loss = load_balancing_loss_func\(\s*outputs\.router_logits,\s*self\.num_experts,\s*"
    r"self\.num_experts_per_tok,\s*attention_mask,?\s*\)"
)
_ADD = re.compile(r"loss \+= self\.router_aux_loss_coef \* aux_loss")


@dataclass(frozen=True)
class RouterAuxLoss:
    """``coefficient * load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)``,
    the term a Mixtral-style ``forward(labels=...)`` adds to its loss when
    ``config.output_router_logits`` is set."""

    function: Callable[..., torch.Tensor]
    num_experts: int
    top_k: int
    coefficient: float

    @classmethod
    def of(cls, model: Any) -> RouterAuxLoss | None:
        """The model's auxiliary loss, or ``None`` when its forward adds none.

        Raises:
            UnsupportedModelError: when the model asks for router logits but computes the auxiliary
                loss in a way this does not reproduce.
        """
        if not getattr(model.config, "output_router_logits", False):
            return None
        name = type(model).__name__
        source = inspect.getsource(type(model).forward)
        function = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
        if function is None or not _CALL.search(source) or not _ADD.search(source):
            raise UnsupportedModelError(
                f"{name} has output_router_logits set but its forward adds the router loss in a way "
                "lit-instruct does not reproduce; set config.output_router_logits = False to train "
                "without it"
            )
        return cls(function, model.num_experts, model.num_experts_per_tok, float(model.router_aux_loss_coef))

    def __call__(self, router_logits: Any, attention_mask: torch.Tensor | None) -> torch.Tensor:
        return self.function(router_logits, self.num_experts, self.top_k, attention_mask)
