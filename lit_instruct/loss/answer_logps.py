"""Each answer's log-probability through a chunked lm_head path: the ``[tokens, vocab]`` logits are
never materialized, one chunk's at a time (forward, and again in backward, where each chunk is
recomputed); :class:`PairLogps` holds a ``[chosen rows; rejected rows]`` batch's sums per pair."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lit_instruct.distributed import refuse_sharded
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.loss.contract import check_labels
from lit_instruct.loss.fused import default_chunk_size
from lit_instruct.loss.logits import IDENTITY, LogitTransform

CHUNK_BUFFERS = 8
"""Logits-sized buffers a chunk's workspace is divided by: 320 rows for SmolLM2's 49,152-token vocab
(its DPO step's peak RSS fell by ~600 MB, 5.1 to 4.5 GB, from 1,344 rows at the same speed)."""


def _chunk_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    transform: LogitTransform,
) -> torch.Tensor:
    """``log_softmax(transform(hidden @ weight.T + bias))[row, label]`` for one chunk, softmax in fp32."""
    raw = F.linear(hidden, weight, bias)  # (c, V), the compute dtype
    logits = transform(raw.float())
    return logits.gather(1, labels[:, None]).squeeze(1) - torch.logsumexp(logits, dim=1)


def answer_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = None,
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = IDENTITY,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Each sequence's summed log-probability of its labelled tokens, ``(B,)`` fp32: the sums of
    :func:`answer_token_logps` (arguments as there)."""
    per_token = answer_token_logps(
        hidden, weight, labels, chunk_size, bias=bias, transform=transform, ignore_index=ignore_index
    )
    return sequence_sums(per_token, labels, ignore_index=ignore_index)


def answer_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = None,
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = IDENTITY,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Each labelled token's log-probability, ``(n,)`` fp32, ``n`` the labelled tokens in row-major
    order (:func:`sequence_sums` sums them per sequence).

    Args:
        hidden: ``(B, T, H)`` final hidden states, already aligned: position ``t`` predicts
            ``labels[:, t]`` (shift before calling).
        weight: ``(V, H)`` lm_head weight.
        labels: ``(B, T)`` target ids, ``ignore_index`` where nothing is scored (prompt, padding).
        chunk_size: scored rows per chunk (default: an eighth of the fused loss's fp32 workspace:
            a chunk's forward and its recomputation in backward hold ~6 logits-sized buffers).
        bias: ``(V,)`` lm_head bias, if any.
        transform: the model's logit scaling / soft-capping.

    Only the scored rows are projected, a chunk at a time; with gradients on, each chunk runs under
    activation checkpointing, so backward recomputes its logits instead of keeping them. The GEMM
    runs in autocast's dtype when autocast is on, the softmax in fp32.
    """
    refuse_sharded("lm_head weight", weight)
    refuse_sharded("lm_head bias", bias)
    if hidden.dim() != 3 or weight.dim() != 2 or labels.shape != hidden.shape[:2]:
        raise ValueError(
            f"expected hidden (B, T, H), weight (V, H), labels (B, T); got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(labels.shape)}"
        )
    check_labels(labels, weight.shape[0], ignore_index)
    flat_labels = labels.reshape(-1)
    kept = (flat_labels != ignore_index).nonzero().squeeze(1)  # (n,)
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, kept)  # (n, H)
    targets = flat_labels.index_select(0, kept)
    chunk = chunk_size or default_chunk_size(weight.shape[0], buffers=CHUNK_BUFFERS)
    compute = functools.partial(_chunk_logps, transform=transform)
    recompute = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    pieces = []
    for start in range(0, len(kept), chunk):
        args = (rows[start : start + chunk], weight, bias, targets[start : start + chunk])
        pieces.append(checkpoint(compute, *args, use_reentrant=False) if recompute else compute(*args))
    return torch.cat(pieces) if pieces else rows.new_zeros(0, dtype=torch.float32)


def _chunk_log_sum_squares(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    transform: LogitTransform,
) -> torch.Tensor:
    """``log Σ_v softmax(transform(hidden @ weight.T + bias))[row, v]²`` for one chunk, in fp32."""
    logits = transform(F.linear(hidden, weight, bias).float())
    return torch.logsumexp(2 * logits, dim=1) - 2 * torch.logsumexp(logits, dim=1)


@torch.no_grad()
def answer_token_log_sum_squares(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = None,
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = IDENTITY,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Each labelled position's ``log Σ_v p(v)²`` (the log of its predicted distribution's squared
    norm), ``(n,)`` fp32 in :func:`answer_token_logps`' order, chunked as it is, without gradient:
    what WPO's weights divide the token probabilities by (TRL's ``log_sum_sq_probs``)."""
    return _per_labelled_row(
        _chunk_log_sum_squares, hidden, weight, labels, chunk_size, bias, transform, ignore_index
    )


def _chunk_entropies(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    transform: LogitTransform,
) -> torch.Tensor:
    """The entropy of ``softmax(transform(hidden @ weight.T + bias))`` per row of one chunk, fp32."""
    logps = torch.log_softmax(transform(F.linear(hidden, weight, bias).float()), dim=1)
    return -(logps.exp() * logps).sum(dim=1)


@torch.no_grad()
def answer_token_entropies(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = None,
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = IDENTITY,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Each labelled position's predicted distribution's entropy (nats), ``(n,)`` fp32 in
    :func:`answer_token_logps`' order, chunked as it is, without gradient (GRPO's ``entropy``)."""
    return _per_labelled_row(
        _chunk_entropies, hidden, weight, labels, chunk_size, bias, transform, ignore_index
    )


def _per_labelled_row(
    of_chunk: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, LogitTransform], torch.Tensor],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None,
    bias: torch.Tensor | None,
    transform: LogitTransform,
    ignore_index: int,
) -> torch.Tensor:
    """``of_chunk(rows, weight, bias, transform)`` over the labelled positions' hidden rows, a chunk
    of rows at a time (as :func:`answer_token_logps` chunks them), ``(n,)`` fp32 in its order."""
    flat = labels.reshape(-1) != ignore_index
    rows = hidden.reshape(-1, hidden.shape[-1])[flat]
    chunk = chunk_size or default_chunk_size(weight.shape[0], buffers=CHUNK_BUFFERS)
    pieces = [
        of_chunk(rows[start : start + chunk], weight, bias, transform) for start in range(0, len(rows), chunk)
    ]
    return torch.cat(pieces) if pieces else rows.new_zeros(0, dtype=torch.float32)


def wpo_weights(
    per_token: torch.Tensor,
    log_sum_squares: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """WPO's weight of each sequence, ``(B,)``: ``exp`` of the mean over its labelled tokens of
    ``log p(token) - log Σ_v p(v)²`` (Eq. 2 of the WPO paper, as TRL's ``use_weighting``), detached."""
    aligned = sequence_sums(per_token.detach() - log_sum_squares, labels, ignore_index=ignore_index)
    return torch.exp(aligned / answer_token_counts(labels, ignore_index).clamp(min=1))


def sequence_sums(
    per_token: torch.Tensor,
    labels: torch.Tensor,
    token_weights: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """``(B,)`` sums of :func:`answer_token_logps`' values per sequence of ``labels``, each token
    times ``token_weights[b, t]`` (``(B, T)``) if given."""
    flat = labels.reshape(-1) != ignore_index
    kept = flat.nonzero().squeeze(1)
    if token_weights is not None:
        per_token = per_token * token_weights.reshape(-1)[kept].to(per_token.dtype)
    sequence = torch.div(kept, labels.shape[1], rounding_mode="floor")
    return per_token.new_zeros(labels.shape[0]).index_add(0, sequence, per_token)


def length_weights(labels: torch.Tensor, ld_alpha: float, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """LD-DPO's token weights of a ``[chosen rows; rejected rows]`` batch's labels, ``(2P, T)``: 1 on
    an answer's first ``min(chosen tokens, rejected tokens)`` tokens of its pair (the shared length),
    ``ld_alpha`` past them, 0 where nothing is scored (TRL's ``ld_alpha``)."""
    scored = labels != ignore_index
    position = scored.cumsum(dim=1)
    chosen, rejected = scored.sum(dim=1).chunk(2)
    shared = torch.minimum(chosen, rejected).repeat(2)[:, None]
    tail = (position > shared).float()
    return (1.0 - (1.0 - ld_alpha) * tail) * scored


def answer_token_counts(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """How many tokens each sequence's :func:`answer_logps` sums over, ``(B,)``."""
    return (labels != ignore_index).sum(dim=-1)


@dataclass(frozen=True)
class PairLogps:
    """Summed log-probabilities of the chosen and rejected answers of ``P`` pairs, and their token
    counts, all ``(P,)``. With LD-DPO's ``ld_alpha`` the sums weigh the tokens past the pair's
    shared length; ``chosen_plain`` then holds the chosen answers' unweighted sums (the NLL terms')."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    chosen_plain: torch.Tensor | None = None
    pair_weights: torch.Tensor | None = None
    """WPO's weight of each pair (the product of its answers' weights), when asked for."""

    @classmethod
    def from_batch(
        cls, logps: torch.Tensor, tokens: torch.Tensor, plain: torch.Tensor | None = None
    ) -> PairLogps:
        """Split a ``[chosen rows; rejected rows]`` batch's ``(2P,)`` sums and counts (and ``plain``:
        the unweighted sums, when ``logps`` are weighted)."""
        if len(logps) % 2 or logps.shape != tokens.shape:
            raise ValueError(
                f"expected (2P,) sums and counts, got {tuple(logps.shape)}, {tuple(tokens.shape)}"
            )
        chosen, rejected = logps.chunk(2)
        chosen_tokens, rejected_tokens = tokens.chunk(2)
        chosen_plain = None if plain is None else plain.chunk(2)[0]
        return cls(chosen, rejected, chosen_tokens, rejected_tokens, chosen_plain)

    @classmethod
    def from_tokens(
        cls,
        per_token: torch.Tensor,
        labels: torch.Tensor,
        ld_alpha: float | None = None,
        ignore_index: int = IGNORE_INDEX,
    ) -> PairLogps:
        """A ``[chosen rows; rejected rows]`` batch's pairs from :func:`answer_token_logps`' values
        on its ``(2P, T)`` labels: plain sums, or LD-DPO's (:func:`length_weights`) with
        ``ld_alpha``."""
        tokens = answer_token_counts(labels, ignore_index)
        plain = sequence_sums(per_token, labels, ignore_index=ignore_index)
        if ld_alpha is None:
            return cls.from_batch(plain, tokens)
        weights = length_weights(labels, ld_alpha, ignore_index)
        return cls.from_batch(sequence_sums(per_token, labels, weights, ignore_index), tokens, plain)

    def select(self, keep: torch.Tensor) -> PairLogps:
        """The pairs where ``keep`` (a ``(P,)`` mask) is true."""
        plain = None if self.chosen_plain is None else self.chosen_plain[keep]
        weights = None if self.pair_weights is None else self.pair_weights[keep]
        return PairLogps(
            self.chosen[keep],
            self.rejected[keep],
            self.chosen_tokens[keep],
            self.rejected_tokens[keep],
            plain,
            weights,
        )

    def zeros(self) -> PairLogps:
        """Zero log-probabilities with these token counts: the reference of ``reference_free``."""
        return PairLogps(
            torch.zeros_like(self.chosen),
            torch.zeros_like(self.rejected),
            self.chosen_tokens,
            self.rejected_tokens,
        )

    def mean_chosen(self) -> torch.Tensor:
        """Per-token mean log-probability of each chosen answer."""
        return self.chosen / self.chosen_tokens.clamp(min=1)

    def mean_rejected(self) -> torch.Tensor:
        """Per-token mean log-probability of each rejected answer."""
        return self.rejected / self.rejected_tokens.clamp(min=1)

    def chosen_nll(self) -> torch.Tensor:
        """Mean NLL over all chosen answers' tokens of the batch (TRL's ``sft`` term), every token
        counted once (unweighted by ``ld_alpha``)."""
        chosen = self.chosen if self.chosen_plain is None else self.chosen_plain
        return -chosen.sum() / self.chosen_tokens.sum().clamp(min=1)
