"""Where training batches come from: the prepared samples in the sampler's order, or a stream read
and rendered while training. Each keeps its own place in the data for checkpoints and resumes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from lit_instruct.data.even_shards import UncountedPadding
from lit_instruct.data.sampler import InstructSampler
from lit_instruct.data.sources import DataSource
from lit_instruct.data.store import SampleStore
from lit_instruct.data.stream import START, Position, SampleStream, StreamCollator
from lit_instruct.data.tokenize import TokenizeSettings
from lit_instruct.errors import ConfigError
from lit_instruct.rng import gather_objects

Collate = Callable[[list[Any]], dict[str, Any]]


def key_values(items: Any) -> str:
    """``a=1, b=2``: how counts are reported."""
    return ", ".join(f"{key}={value}" for key, value in items)


def _rank(trainer: L.Trainer | None) -> tuple[int, int]:
    return (trainer.global_rank, trainer.world_size) if trainer else (0, 1)


class PositionKeptLoader(DataLoader):
    """A training ``DataLoader`` whose place in the epoch the data module's feed keeps (saved and
    restored with the data module's state): it tells Lightning so, as a resumable loader, and
    Lightning's warning that a mid-epoch resume is unreliable, false for it, is not given."""

    def state_dict(self) -> dict[str, Any]:
        return {}  # the position is the feed's (TrainingFeed.state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore here: the feed restores the position."""


class SampledFeed:
    """Batches of :class:`InstructSampler`'s order over the prepared samples, built in the main
    process (they are tokenized already: workers would only add overhead), resumable mid-epoch."""

    def __init__(self, seed: int, group_by_length: bool, replacement: bool) -> None:
        self.seed = seed
        self.group_by_length, self.replacement = group_by_length, replacement
        self.repeats = 1
        """How many optimizer steps each window of batches is given for (online RL's
        ``num_iterations``: the module sets it from its objective)."""
        self.sampler: InstructSampler | None = None
        self._resume: dict[str, Any] | None = None

    def loader(
        self,
        samples: SampleStore,
        weights: list[float],
        batch_size: int,
        collate: Collate,
        trainer: L.Trainer | None,
    ) -> DataLoader:
        """The training loader; sources are mixed by ``weights`` when any differs from 1."""
        rank, world = _rank(trainer)
        mixture = any(w != 1.0 for w in weights)
        window = trainer.accumulate_grad_batches if trainer is not None else 1
        self.sampler = InstructSampler(
            samples.lengths.tolist(),
            batch_size,
            num_replicas=world,
            rank=rank,
            group_by_length=self.group_by_length,
            seed=self.seed,
            sources=samples.source_ids.tolist() if mixture else None,
            weights=weights if mixture else None,
            replacement=self.replacement,
            repeats=self.repeats,
            window=window,
        )
        if self._resume is not None:  # checkpoints before positions in samples give batches of their own size
            state, ours = self._resume, batch_size * world
            written = (state.get("batch_size") or batch_size) * (state.get("num_replicas") or world)
            done = state.get("samples_done", state["batches_done"] * written)
            order_batch = state.get("order_batch") or (written if "batch_size" in state else ours)
            skip = _repeat_skip(state, batch_size, world, window, self.repeats)
            self.sampler.resume_at(state["epoch"], done, order_batch, state["batches_done"], skip)
        dataset: Any = UncountedPadding(samples)  # the sampler's repeats run but count no token
        return PositionKeptLoader(dataset, batch_size=batch_size, sampler=self.sampler, collate_fn=collate)

    def state_dict(self, trainer: L.Trainer) -> dict[str, Any]:
        """The epoch and where it stands, from the Trainer's own progress (which counts what the loop
        consumed; a DataLoader's count would include what was fetched ahead): in samples of the epoch's
        global order, so that another number of ranks or batch size resumes it (and again after)."""
        done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        assert self.sampler is not None
        samples, order_batch, within = self.sampler.place(trainer.current_epoch, done)
        state: dict[str, Any] = {
            "epoch": trainer.current_epoch,
            "batches_done": done,
            "samples_done": samples,
        }
        if self.sampler.repeats > 1:  # each window N times: resumable with the same N and window
            sampler = self.sampler
            state["repeat"] = {
                "batch_size": sampler.batch_size,
                "num_replicas": sampler.num_replicas,
                "window": sampler.window,
                "repeats": sampler.repeats,
                "within": within,
            }
        return {**state, "order_batch": order_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's place (older checkpoints: batches done, and maybe their batch size and ranks)."""
        self._resume = dict(state)

    def on_batch(self, batch: Any) -> Any:
        return batch

    def rejects_after_fit(self) -> list[dict[str, Any]]:
        return []  # reported at setup, when the samples were prepared


def _repeat_skip(state: dict[str, Any], batch_size: int, world: int, window: int, repeats: int) -> int:
    """The batches to skip of the window a checkpoint stopped inside of (0 at a window's start). A
    run that gives windows several times resumes with the same ``num_iterations`` and accumulation
    (its optimizer steps and the data's windows stay aligned), and inside a window with the same batch
    size and processes too; else a ``ConfigError`` naming what differs."""
    given = state.get("repeat") or {"repeats": 1, "window": window, "within": 0}
    if given["repeats"] == 1 and repeats == 1:
        return 0
    now = {"batch_size": batch_size, "num_replicas": world, "window": window, "repeats": repeats}
    names = {
        "repeats": "model.objective.init_args.num_iterations",
        "window": "trainer.accumulate_grad_batches",
        "batch_size": "data.batch_size",
        "num_replicas": "the number of processes",
    }
    compared = list(names) if given["within"] else ["repeats", "window"]
    for key in compared:
        if given[key] != now[key]:
            name = names[key]
            inside = "inside a rollout's num_iterations steps, " if given["within"] else ""
            raise ConfigError(
                name,
                f"{now[key]}: the checkpoint was written {inside}with {name} = {given[key]}; resume with "
                f"the same (each window of prompts is given num_iterations times in a row)",
            )
    return int(given["within"])


class StreamedFeed:
    """Training sources read, shuffled in a buffer and rendered while training
    (:mod:`lit_instruct.data.stream`); ranks read disjoint records, resume is exact."""

    def __init__(self, sources: list[DataSource], seed: int, shuffle_buffer: int) -> None:
        self.sources = sources
        self.seed, self.shuffle_buffer = seed, shuffle_buffer
        self.stream: SampleStream | None = None
        self._position: Position = START
        self._resume: list[Position] | None = None  # every rank's, from a checkpoint

    def loader(
        self, renderers: TokenizeSettings, batch_size: int, collate: Collate, trainer: L.Trainer | None
    ) -> DataLoader:
        if trainer is not None and trainer.max_steps < 0:
            raise ValueError("data.streaming: the stream has no end; set trainer.max_steps")
        rank, world = _rank(trainer)
        self.stream = SampleStream(
            self.sources,
            renderers,
            rank=rank,
            world_size=world,
            seed=self.seed,
            shuffle_buffer=self.shuffle_buffer,
            resume=self._resume_position(rank, world),
        )
        return PositionKeptLoader(self.stream, batch_size=batch_size, collate_fn=StreamCollator(collate))

    def _resume_position(self, rank: int, world: int) -> Position:
        """This rank's position in the checkpoint's stream (the start without one)."""
        if self._resume is None:
            return START
        if len(self._resume) != world:
            raise ValueError(
                f"the checkpoint's stream was sharded over {len(self._resume)} ranks, this run has "
                f"{world}: a stream resumes exactly only on as many ranks (or restart it without ckpt_path)"
            )
        return self._resume[rank]

    def state_dict(self, trainer: L.Trainer) -> dict[str, Any]:
        """Every rank's stream position (a collective)."""
        return {"stream_positions": gather_objects(list(self._position))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = [(e, r, s) for e, r, s in state["stream_positions"]]

    def on_batch(self, batch: Any) -> Any:
        """Note the stream position of the batch about to be trained on (batches fetched ahead are
        not trained on yet)."""
        if isinstance(batch, dict) and "stream_position" in batch:
            self._position = batch.pop("stream_position")
        return batch

    def rejects_after_fit(self) -> list[dict[str, Any]]:
        """Report what the stream read and skipped (all ranks: collectives), and return the rejected
        records of every rank."""
        if self.stream is None:
            return []
        counts: Counter[str] = sum(gather_objects(self.stream.counts), Counter())  # each rank its own
        rank_zero_info(f"lit-instruct data [train, streamed]: {key_values(sorted(counts.items()))}")
        return [row for rows in gather_objects(self.stream.rejects.rows) for row in rows]


TrainingFeed = SampledFeed | StreamedFeed
