"""The model's own path from final hidden states to logits, found, checked, and handed to the loss.

The losses never ask the model for its ``[tokens, vocab]`` logits; they take the lm_head's weight and
bias and a :class:`~lit_instruct.loss.logits.LogitTransform`. That is only right if it is exactly what
the model's ``forward`` does, so :func:`output_head` reads the statements of ``forward`` between the
lm_head call and the loss, maps each one it knows (scaling, division, soft-capping), refuses any
other, and then checks the result numerically against the model's own logits on a few tokens.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lit_instruct.loss.logits import IDENTITY, LogitTransform
from lit_instruct.models.decoder import decoder_of


class UnsupportedModelError(ValueError):
    """The model computes its logits or loss in a way lit-instruct cannot reproduce exactly."""


@dataclass(frozen=True)
class OutputHead:
    """``logits = transform(hidden @ linear.weight.T + linear.bias)``."""

    linear: nn.Linear
    transform: LogitTransform

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.linear.bias


Effect = Callable[[Any, LogitTransform], LogitTransform]
"""What a statement does to the transform, given the model (a ``transformers`` model: its
attributes vary by family, hence ``Any``)."""


def _scale(factor: Callable[[Any], float]) -> Effect:
    def effect(model: Any, t: LogitTransform) -> LogitTransform:
        if t.softcap is not None:  # z = cap * tanh(scale * raw / cap) has the scale inside
            raise UnsupportedModelError("a logit scaling after the soft-capping")
        return replace(t, scale=t.scale * float(factor(model)))

    return effect


def _softcap(cap: Callable[[Any], float | None]) -> Effect:
    return lambda model, t: replace(t, softcap=cap(model))


def _same(model: Any, t: LogitTransform) -> LogitTransform:
    return t


_HEAD_CALL = r"(lm_)?logits = self\.lm_head\(hidden_states(\[:, slice_indices, :\])?(\.to\([\w.=]*\))?\)"
_DTYPE = r"(\.float\(\)|\.contiguous\(\))?"
# Each statement found between the lm_head call and the loss, and what it does to the transform.
KNOWN_STATEMENTS: list[tuple[str, Effect]] = [
    (_HEAD_CALL + _DTYPE, _same),
    (_HEAD_CALL + r" \* self\.model\.lm_head_multiplier", _scale(lambda m: m.model.lm_head_multiplier)),
    (_HEAD_CALL + r" \* self\.config\.logits_scaling", _scale(lambda m: m.config.logits_scaling)),
    (r"logits = logits \* self\.logit_scale", _scale(lambda m: m.logit_scale)),
    (r"logits = logits / self\.config\.logits_scaling", _scale(lambda m: 1.0 / m.config.logits_scaling)),
    (
        r"if self\.config\.final_logit_softcapping is not None:",
        _softcap(lambda m: m.config.final_logit_softcapping),
    ),
    (r"logits = logits(\.float\(\))? / self\.config\.final_logit_softcapping", _same),
    (r"logits = torch\.tanh\(logits\)", _same),
    (r"logits = logits \* self\.config\.final_logit_softcapping", _same),
    (r"cap = self\.config\.logits_soft_cap", _softcap(lambda m: m.config.logits_soft_cap)),
    (r"logits = nn\.functional\.tanh\(logits / cap\) \* cap", _same),
]
_END = ("loss = ", "loss: ", "if labels", "return ", "aux_loss")


def post_head_statements(model_class: type[nn.Module]) -> list[str]:
    """The statements of ``model_class.forward`` from the lm_head call to the loss (comments and
    blank lines left out).

    Raises:
        UnsupportedModelError: when ``forward`` has no ``self.lm_head(`` call or no source.
    """
    try:
        source = inspect.getsource(model_class.forward)
    except (OSError, TypeError) as error:
        raise UnsupportedModelError(f"{model_class.__name__}.forward has no readable source") from error
    lines = [line.split("#")[0].strip() for line in source.splitlines()]
    start = next(
        (i for i, line in enumerate(lines) if "self.lm_head(" in line and not line.startswith(">>>")), None
    )
    if start is None:
        raise UnsupportedModelError(
            f"{model_class.__name__}.forward does not call self.lm_head: its logits cannot be reproduced"
        )
    statements = []
    for line in lines[start:]:
        if line.startswith(_END):
            break
        if line:
            statements.append(line)
    return statements


def logit_transform(model: Any) -> LogitTransform:
    """The scaling and soft-capping ``type(model).forward`` applies to the lm_head's output.

    Raises:
        UnsupportedModelError: naming the statement it does not know.
    """
    transform = IDENTITY
    name = type(model).__name__
    for statement in post_head_statements(type(model)):
        effect = next((e for pattern, e in KNOWN_STATEMENTS if re.fullmatch(pattern, statement)), None)
        if effect is None:
            raise UnsupportedModelError(
                f"{name}.forward does `{statement}` between the lm_head and the loss, which lit-instruct "
                "does not reproduce: refusing to train it on a loss that could differ from the model's own"
            )
        try:
            transform = effect(model, transform)
        except UnsupportedModelError as error:
            raise UnsupportedModelError(f"{name}: {error} is not supported") from error
    return transform


def output_head(model: Any, verify: bool = True) -> OutputHead:
    """The lm_head and logit transform of a ``transformers`` causal LM, checked against its forward.

    Raises:
        UnsupportedModelError: for an lm_head that is not an ``nn.Linear``, a post-head step it does
            not know, or logits that differ from the model's own.
    """
    linear = model.get_output_embeddings()
    if type(linear) is not nn.Linear:
        raise UnsupportedModelError(
            f"{type(model).__name__}'s lm_head is a {type(linear).__name__}, not a torch.nn.Linear "
            "(lit-instruct computes the loss from its weight and bias; do not put 'lm_head' in "
            "lora.target_modules)"
        )
    head = OutputHead(linear, logit_transform(model))
    if verify:
        check_against_model_logits(model, head)
    return head


@torch.no_grad()
def check_against_model_logits(model: Any, head: OutputHead, tokens: int = 8) -> None:
    """Compare ``head`` applied to the decoder's hidden states with ``model(...).logits`` on a few
    tokens (eval mode, no dropout).

    Raises:
        UnsupportedModelError: when they differ beyond the dtype's rounding.
    """
    weight = head.weight
    ids = torch.arange(1, tokens + 1, device=weight.device)[None] % weight.shape[0]
    was_training = model.training
    model.eval()
    try:
        expected = model(input_ids=ids, use_cache=False).logits.float()
        hidden = decoder_of(model)(input_ids=ids, use_cache=False).last_hidden_state
        ours = head.transform(nn.functional.linear(hidden, weight, head.bias).float())
    finally:
        model.train(was_training)
    tolerance = 1e-4 if weight.dtype == torch.float32 else 3e-2
    error = float((ours - expected).abs().max())
    bound = tolerance * max(1.0, float(expected.abs().max()))
    if not error <= bound:
        raise UnsupportedModelError(
            f"{type(model).__name__}: the loss's logits (lm_head, {head.transform}) differ from the "
            f"model's own by {error:.3g} (allowed {bound:.3g}): refusing to train on a different loss"
        )
