"""The training order: seeded per epoch, sharded over ranks by global batch, resumable mid-epoch."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import DistributedSampler

from lit_instruct.data.even_shards import padding_index


class InstructSampler(DistributedSampler):
    """Training sample order for one rank.

    Each epoch's global order depends only on ``seed`` and the epoch: a random permutation, or with
    ``group_by_length`` the same shuffle sorted by length within mega-batches of ``group_size``
    global batches (so each batch has little padding), with the full batches shuffled again (the
    samples of incomplete ones go last, so that the batches stay aligned). Global batch
    ``g`` is ``order[g*B*W : (g+1)*B*W]`` and rank ``r`` takes its ``r``-th slice of ``B`` samples,
    so ``W`` ranks with batch ``B`` see the same global batches as one process with batch ``B*W``. The
    order is padded to a multiple of ``W`` by repeating its start as marked indices, so every rank has
    as many batches; the repeats count no token (:mod:`lit_instruct.data.even_shards`).

    With ``sources`` and ``weights`` (a mixture), each epoch first draws its samples: source ``s``
    of ``n_s`` samples and weight ``w_s`` contributes ``round(w_s * n_s)`` of them, as whole passes
    over the source in a fresh seeded order plus the start of one more (so no sample is drawn more
    than ``ceil(w_s)`` times, and a weight below 1 takes a different subset each epoch); with
    ``replacement`` they are drawn independently. The draw is then ordered as above.

    With ``repeats`` ``R`` > 1 (online RL's ``num_iterations``: each rollout trains ``R`` optimizer
    steps), a rank's order is padded with marked repeats to whole windows of ``window`` batches (an
    optimizer step's accumulation) and each window is given ``R`` times in a row.

    :meth:`resume_at` makes the next iteration over that epoch start after the batches already
    trained on. Being a ``DistributedSampler``, Lightning uses it as it is under DDP.

    Args:
        lengths: token length of each sample.
        batch_size: samples per batch on one rank (``B``).
        num_replicas: number of ranks (``W``).
        rank: this rank.
        group_by_length: group samples of similar length into batches.
        group_size: how many global batches' worth of samples are sorted together.
        seed: base seed of the shuffles.
        sources: the source index of each sample (for ``weights``).
        weights: per source, how many times each of its samples is drawn per epoch on average.
        replacement: draw a mixture's samples with replacement.
        repeats: how many times each window is given in a row (``R``).
        window: batches per window (the accumulation of one optimizer step).
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        group_by_length: bool = False,
        group_size: int = 32,
        seed: int = 0,
        sources: Sequence[int] | None = None,
        weights: Sequence[float] | None = None,
        replacement: bool = False,
        repeats: int = 1,
        window: int = 1,
    ) -> None:
        if batch_size < 1 or group_size < 1:
            raise ValueError(f"batch_size and group_size must be >= 1, got {batch_size}, {group_size}")
        if repeats < 1 or window < 1:
            raise ValueError(f"repeats and window must be >= 1, got {repeats}, {window}")
        self.repeats, self.window = repeats, window
        self.repeat_skip = 0
        """Batches of the repeated stream skipped at the start (a resume inside a window's repeats)."""
        lengths = list(lengths)
        # DistributedSampler only takes len() of its dataset: the lengths list stands in for it.
        super().__init__(lengths, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)  # type: ignore[arg-type]
        self.lengths = lengths
        self.batch_size = batch_size
        self.group_by_length = group_by_length
        self.group_size = group_size
        self._resume: tuple[int, int, int, int] | None = None
        self._resume_skip = 0
        self.position: tuple[int, int, int, int] = (-1, 0, batch_size * num_replicas, 0)
        """The epoch being iterated, its samples skipped at the start, its order's global batch, and
        Lightning's count of batches done before them."""
        self.members: list[list[int]] | None = None
        self.weights = list(weights) if weights is not None else None
        self.replacement = replacement
        if self.weights is not None:
            if sources is None or len(sources) != len(lengths):
                raise ValueError("weights need the source index of every sample")
            self.members = [[] for _ in self.weights]
            for index, source in enumerate(sources):
                self.members[source].append(index)
            self.draws = [round(w * len(m)) for w, m in zip(self.weights, self.members, strict=True)]
            self.num_samples = math.ceil(sum(self.draws) / self.num_replicas)
            self.total_size = self.num_samples * self.num_replicas

    def epoch_pool(self, epoch: int, generator: torch.Generator) -> list[int]:
        """The samples drawn for ``epoch`` (each source's, in source order)."""
        if self.members is None:
            return list(range(len(self.lengths)))
        pool: list[int] = []
        for members, draws in zip(self.members, self.draws, strict=True):
            if not members:
                continue
            if self.replacement:
                picks = torch.randint(len(members), (draws,), generator=generator).tolist()
            else:
                passes = -(-draws // len(members))
                picks = [
                    i
                    for _ in range(passes)
                    for i in torch.randperm(len(members), generator=generator).tolist()
                ]
            pool += [members[i] for i in picks[:draws]]
        return pool

    def resume_at(
        self, epoch: int, samples_done: int, order_batch: int, batches_done: int, repeat_skip: int = 0
    ) -> None:
        """When epoch ``epoch`` is iterated next, start after the first ``samples_done`` samples of its
        global order, grouped by ``order_batch`` (the global batch of the run that began the epoch,
        kept for the whole epoch); ``batches_done``: the batches Lightning counts as done (its restored
        progress), from which the next checkpoint's position is counted on. The rest of the epoch is
        shared out in this sampler's global batches (another number of ranks or batch size too);
        ``repeat_skip``: batches already given of the window that ``samples_done`` starts (``repeats``)."""
        self._resume = (epoch, samples_done, order_batch, batches_done)
        self._resume_skip = repeat_skip

    def samples_done(self, epoch: int, batches_ready: int) -> tuple[int, int]:
        """Where epoch ``epoch`` stands after Lightning's ``batches_ready`` batches: the samples of its
        global order done, and the global batch that order is grouped by."""
        return self.place(epoch, batches_ready)[:2]

    def place(self, epoch: int, batches_ready: int) -> tuple[int, int, int]:
        """:meth:`samples_done`'s two, and the batches given of the window being repeated (0 when
        ``repeats`` is 1 or at a window's start)."""
        here, offset, order_batch, before = self.position
        own_batch = self.batch_size * self.num_replicas
        skip = self.repeat_skip
        if here != epoch:
            offset, order_batch, before, skip = 0, own_batch, 0, 0
        given = skip + batches_ready - before
        span = self.window * self.repeats  # batches of the stream per window
        windows, within = divmod(given, span)
        if self.repeats == 1:
            return offset + given * own_batch, order_batch, 0
        return offset + windows * self.window * own_batch, order_batch, within

    def global_order(self, epoch: int, global_batch: int | None = None) -> list[int]:
        """All ranks' samples of ``epoch``, in global-batch order (before padding); with
        ``group_by_length`` grouped by ``global_batch`` (default: this sampler's)."""
        generator = torch.Generator().manual_seed(self.seed + epoch)
        pool = self.epoch_pool(epoch, generator)
        order = [pool[i] for i in torch.randperm(len(pool), generator=generator).tolist()]
        if not self.group_by_length:
            return order
        global_batch = global_batch or self.batch_size * self.num_replicas
        span = global_batch * self.group_size
        batches: list[list[int]] = []
        for start in range(0, len(order), span):
            group = sorted(order[start : start + span], key=lambda i: -self.lengths[i])
            batches += [group[i : i + global_batch] for i in range(0, len(group), global_batch)]
        full = [b for b in batches if len(b) == global_batch]
        rest = [i for b in batches if len(b) < global_batch for i in b]  # last, to keep batches aligned
        return [i for b in torch.randperm(len(full), generator=generator).tolist() for i in full[b]] + rest

    def rank_order(self, epoch: int) -> list[int]:
        """This rank's samples of ``epoch``: its slice of every global batch, then of the remainder."""
        return self.rank_share(self.global_order(epoch))

    def rank_share(self, order: list[int]) -> list[int]:
        """This rank's samples of ``order`` (a global order), padded to a multiple of the number of
        ranks by repeating its start as marked indices (:func:`padding_index`: run, not counted): its
        slice of every global batch, then of the remainder."""
        world = self.num_replicas
        repeats = -len(order) % world if order else 0  # cycling: a short order may need more than itself
        order = order + [padding_index(order[i % len(order)]) for i in range(repeats)]
        batch, rank = self.batch_size, self.rank
        full = len(order) // (batch * world) * batch * world
        mine = [
            i for g in range(0, full, batch * world) for i in order[g + rank * batch : g + (rank + 1) * batch]
        ]
        return mine + order[full + rank :: world]

    def __iter__(self) -> Iterator[int]:
        # A generator: the epoch and the resume point are read when iteration really starts,
        # after Lightning has set the epoch and restored a checkpoint.
        own_batch = self.batch_size * self.num_replicas
        resume, self._resume = self._resume, None
        skip, self._resume_skip = self._resume_skip, 0
        if resume is not None and resume[0] > self.epoch:
            self._resume, self._resume_skip = resume, skip  # a later epoch's: kept for it
        if resume is None or resume[0] != self.epoch:
            resume, skip = (self.epoch, 0, own_batch, 0), 0
        self.position, self.repeat_skip = resume, skip
        _, offset, order_batch, _ = resume
        order = self.global_order(self.epoch, order_batch)
        if order_batch == own_batch and offset % (own_batch * self.window) == 0:
            # as the epoch was begun: the same batches, its padding repeats too
            skip += offset // own_batch * self.repeats
            offset = 0
        yield from self.repeated(self.rank_share(order[offset:]))[skip * self.batch_size :]

    def repeated(self, order: list[int]) -> list[int]:
        """``order`` padded to whole windows with marked repeats, each window given ``repeats`` times
        (``order`` itself when ``repeats`` is 1)."""
        if self.repeats == 1 or not order:
            return order
        span = self.window * self.batch_size
        starts = [order[i % len(order)] for i in range(-len(order) % span)]
        order = order + [padding_index(i) if i >= 0 else i for i in starts]  # marked once only
        windows = [order[start : start + span] for start in range(0, len(order), span)]
        return [i for window in windows for _ in range(self.repeats) for i in window]

    def __len__(self) -> int:
        """Samples this rank takes in an epoch, at least. Lightning reads it once, as its count of an
        epoch's batches, and takes the batches done from a checkpoint: resuming on another number of
        ranks or batch size, the epoch holds those plus the share of what is left, which may be more
        (the loader ends an epoch where its samples end, never before)."""
        if self._resume is None:
            return len(self.repeated(list(range(self.num_samples))))
        epoch, offset, order_batch, before = self._resume
        left = self.repeated(self.rank_share(self.global_order(epoch, order_batch)[offset:]))
        left = left[self._resume_skip * self.batch_size :]
        return max(len(self.repeated(list(range(self.num_samples)))), before * self.batch_size + len(left))
