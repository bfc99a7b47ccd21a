"""The output head's input made contiguous while a model generates.

``generate`` gives the head the last position's slice of the prompt's hidden states, a view that is not
contiguous; PyTorch's linear layer on such a 3-D input cannot fold it into one matrix product, and on
the CPU multiplies it through a batch of copies of the weight: ``(batch, hidden, vocab)`` materialized
at every prefill, with a bf16 weight two orders of magnitude slower than the product itself (the
outputs are the same). A copy of the slice, a few kilobytes, avoids it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def contiguous_head_input(model: Any) -> Iterator[None]:
    """For the while, ``model``'s output head (``get_output_embeddings()``) takes a contiguous input."""
    head = model.get_output_embeddings()
    if head is None:
        yield
        return
    handle = head.register_forward_pre_hook(lambda _module, args: (args[0].contiguous(), *args[1:]))
    try:
        yield
    finally:
        handle.remove()
