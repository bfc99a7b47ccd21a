"""Embedding rows for new tokens (:mod:`lit_instruct.vocabulary`): grown, initialised, and trained alone.

Each new row starts at the mean of the rows of the existing vocabulary (``transformers``' mean
resizing without its random noise: the same on every rank and run), in the input embedding and in an
untied output head; a vocabulary already padded past the tokenizer (Qwen) holds them in its spare rows.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger("lit_instruct")


def grow_embeddings(model: Any, token_ids: list[int]) -> None:
    """Make ``model``'s embedding (and untied head) hold ``token_ids``, each row at the mean of the
    rows below the first of them."""
    if not token_ids:
        return
    rows = model.get_input_embeddings().weight.shape[0]
    if max(token_ids) >= rows:
        model.resize_token_embeddings(max(token_ids) + 1, mean_resizing=False)
    first = min(token_ids)
    index = torch.tensor(token_ids)
    weights = {id(m.weight): m.weight for m in (model.get_input_embeddings(), model.get_output_embeddings())}
    with torch.no_grad():
        for weight in weights.values():  # one when tied
            weight[index] = weight[:first].mean(dim=0, keepdim=True).to(weight.dtype)
    logger.info("embedding rows %s..%s: new tokens, at the mean of the others", first, max(token_ids))


def embedding_rows_for(model: Any, tokenizer: Any) -> None:
    """Grow ``model``'s embedding to ``tokenizer``'s length when an adapter's saved tokenizer holds
    tokens added at training (their rows then come from the adapter)."""
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)


def trainable_token_indices(model: Any, token_ids: list[int]) -> dict[str, list[int]]:
    """peft's ``trainable_token_indices``: the new rows of the input embedding, and of the output head
    when it is not tied to it (a tied head follows the embedding's rows)."""
    names = {module: name.rsplit(".", 1)[-1] for name, module in model.named_modules()}
    found = {names[model.get_input_embeddings()]: token_ids}
    head = model.get_output_embeddings()
    if head is not None and head.weight is not model.get_input_embeddings().weight:
        found[names[head]] = token_ids
    return found
