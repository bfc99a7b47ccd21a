"""InstructDataModule: read, split, render and batch instruction data, counting what is dropped."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from lit_instruct.data.chatterbot import read_chatterbot
from lit_instruct.data.collate import PackCollator, PadCollator
from lit_instruct.data.records import Message, Record, RecordFormat, read_records
from lit_instruct.data.render import ChatRenderer, MultiTurn, Sample
from lit_instruct.data.sampler import InstructSampler
from lit_instruct.data.validation import BadRecordPolicy, LongSamplePolicy, Rejects, build_samples


def drop_duplicates(records: list[Record], counts: Counter[str]) -> list[Record]:
    """Keep the first of identical conversations (so no validation sample is also a training one)."""
    seen: set[tuple[Message, ...]] = set()
    unique = []
    for record in records:
        if record.messages in seen:
            counts["dropped_duplicate"] += 1
            continue
        seen.add(record.messages)
        unique.append(record)
    return unique


class InstructDataModule(L.LightningDataModule):
    """Instruction data for causal-LM fine-tuning: JSON/JSONL files and the chatterbot corpus.

    Args:
        tokenizer: model name or folder whose tokenizer and chat template render the data (the CLI
            links it to ``model.model``).
        train_files: JSON/JSONL, parquet, arrow or csv files, or ``save_to_disk`` folders (alpaca,
            prompt/completion, chat or ShareGPT records).
        val_files: held-out files; when empty, ``val_fraction`` of the training records is held out.
        chatterbot_categories: add the chatterbot-corpus English conversations of these categories
            (file stems such as ``greetings``; ``["all"]`` for every category).
        format: record format of every file, or ``auto`` to detect it per file.
        max_seq_len: tokens per sample; what happens to longer ones is ``on_long_sample``.
        val_fraction: share of training records held out when no ``val_files`` are given.
        split_seed: seed of that split, independent of the training seed.
        batch_size: samples per training micro-batch.
        eval_batch_size: samples per validation batch (defaults to ``batch_size``).
        chat_template: Jinja chat template overriding the tokenizer's (required when it has none),
            or ``alpaca`` for the built-in alpaca prompt template.
        pad_to_multiple_of: round padded batch lengths up to a multiple of this.
        num_workers: validation DataLoader worker processes (training batches are built in the main
            process: the samples are tokenized already).
        group_by_length: batch samples of similar length together (less padding, faster steps).
        seed: seed of the training order (shuffled anew each epoch from ``seed + epoch``).
        deduplicate: drop repeated identical conversations (counted) before the split, so that
            held-out samples are really held out.
        on_bad_record: ``raise`` (the default) at the first bad record, naming its file, line and
            field; or ``skip`` bad records, counting them per reason and writing them to
            ``rejects_file``.
        on_long_sample: ``truncate`` samples to ``max_seq_len`` (answers cut away entirely are
            dropped), ``drop`` them, or ``raise``; counts are reported at setup either way.
        rejects_file: where skipped records go, one JSON line each with its location and reason
            (default: ``rejects.jsonl`` in the log directory).
        packing: put each batch's samples in one row without padding (position ids restart per
            sample, attention stays inside each sample): no FLOP is spent on padding.
        multi_turn: ``auto`` (one sample per conversation where the chat template is prefix-stable,
            else one per assistant turn, counted ``split_per_turn``), ``joint`` (one per conversation;
            a template that rewrites earlier turns is an error) or ``per_turn`` (one per assistant
            turn, each rendered as the model sees it at that turn).
    """

    def __init__(
        self,
        tokenizer: str = "smollm2-135m-instruct",
        train_files: list[str] | None = None,
        val_files: list[str] | None = None,
        chatterbot_categories: list[str] | None = None,
        format: RecordFormat = "auto",
        max_seq_len: int = 512,
        val_fraction: float = 0.05,
        split_seed: int = 1234,
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        chat_template: str | None = None,
        pad_to_multiple_of: int | None = None,
        num_workers: int = 0,
        group_by_length: bool = False,
        seed: int = 0,
        deduplicate: bool = True,
        on_bad_record: BadRecordPolicy = "raise",
        on_long_sample: LongSamplePolicy = "truncate",
        rejects_file: str | None = None,
        packing: bool = False,
        multi_turn: MultiTurn = "auto",
    ) -> None:
        super().__init__()
        if not (train_files or chatterbot_categories):
            raise ValueError("InstructDataModule needs data: set train_files and/or chatterbot_categories")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.save_hyperparameters()
        self.tokenizer_name = tokenizer
        self.train_files = list(train_files or [])
        self.val_files = list(val_files or [])
        self.chatterbot_categories = chatterbot_categories
        self.format = format
        self.max_seq_len = max_seq_len
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.chat_template = chat_template
        self.pad_to_multiple_of = pad_to_multiple_of
        self.num_workers = num_workers
        self.group_by_length = group_by_length
        self.seed = seed
        self.deduplicate = deduplicate
        self.on_long_sample = on_long_sample
        self.rejects_file = rejects_file
        self.rejects = Rejects(on_bad_record)
        self.packing = packing
        self.multi_turn = multi_turn
        self.tokenizer: Any = None
        self.train_samples: list[Sample] = []
        self.val_samples: list[Sample] = []
        self.counts: dict[str, Counter[str]] = {"train": Counter(), "val": Counter()}
        self.sampler: InstructSampler | None = None
        self._resume: tuple[int, int] | None = None

    def prepare_data(self) -> None:
        """Prepare a bundled model's tokenizer once (rank 0 only)."""
        from lit_instruct.model import resolve_model_path

        resolve_model_path(self.tokenizer_name)

    def load_tokenizer(self) -> Any:
        """Load (once) the tokenizer named by ``tokenizer``."""
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            from lit_instruct.model import resolve_model_path

            self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(self.tokenizer_name))
        return self.tokenizer

    def read_train_records(self) -> list[Record]:
        """All training records: files first, then chatterbot conversations."""
        on_bad = self.rejects.on_bad_raw(self.counts["train"])
        records = [r for path in self.train_files for r in read_records(path, self.format, on_bad)]
        if self.chatterbot_categories:
            categories = None if self.chatterbot_categories == ["all"] else self.chatterbot_categories
            records += read_chatterbot(categories, counts=self.counts["train"])
        return drop_duplicates(records, self.counts["train"]) if self.deduplicate else records

    def split(self, records: list[Record]) -> tuple[list[Record], list[Record]]:
        """Hold out ``val_fraction`` of ``records`` (seeded) unless ``val_files`` are given."""
        if self.val_files:
            on_bad = self.rejects.on_bad_raw(self.counts["val"])
            return records, [r for path in self.val_files for r in read_records(path, self.format, on_bad)]
        order = list(range(len(records)))
        random.Random(self.split_seed).shuffle(order)
        n_val = round(len(records) * self.val_fraction)
        held_out = set(order[:n_val])
        train = [r for i, r in enumerate(records) if i not in held_out]
        return train, [records[i] for i in sorted(held_out)]

    def setup(self, stage: str | None = None) -> None:
        """Read, split and render the data (once)."""
        if self.train_samples or self.val_samples:
            return
        renderer = ChatRenderer(self.load_tokenizer(), self.max_seq_len, self.chat_template, self.multi_turn)
        train_records, val_records = self.split(self.read_train_records())
        vocab_size = self.model_vocab_size()
        for split, records in (("train", train_records), ("val", val_records)):
            samples = build_samples(
                records, renderer, self.counts[split], self.rejects, self.on_long_sample, vocab_size
            )
            setattr(self, f"{split}_samples", samples)
            counts = self.counts[split]
            rank_zero_info(
                f"lit-instruct data [{split}]: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))
            )
        rejects = self.rejects_path()  # on every rank: the log directory is a collective
        if self.rejects.rows and (self.trainer is None or self.trainer.is_global_zero):
            self.rejects.write(rejects)
            rank_zero_info(
                f"lit-instruct data: {len(self.rejects.rows)} bad records skipped, listed in {rejects}"
            )
        if not self.train_samples:
            raise ValueError(f"no training sample has a response token left: {dict(self.counts['train'])}")

    def model_vocab_size(self) -> int | None:
        """Embedding rows of the model whose folder holds the tokenizer (``None`` without a config)."""
        from transformers import AutoConfig

        from lit_instruct.model import resolve_model_path

        try:
            config = AutoConfig.from_pretrained(resolve_model_path(self.tokenizer_name))
        except (OSError, ValueError):
            return None
        return getattr(config.get_text_config(), "vocab_size", None)

    def rejects_path(self) -> Path:
        """``rejects_file``, else ``rejects.jsonl`` in the log directory (or the working directory)."""
        if self.rejects_file:
            return Path(self.rejects_file)
        trainer = self.trainer
        return Path((trainer.log_dir or trainer.default_root_dir) if trainer else ".") / "rejects.jsonl"

    def _collator(self) -> PadCollator | PackCollator:
        if self.packing:
            return PackCollator()
        tokenizer = self.load_tokenizer()
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return PadCollator(pad_id, self.pad_to_multiple_of)

    def train_dataloader(self) -> DataLoader:
        """Batches of :class:`InstructSampler`'s order, built in the main process.

        The samples are tokenized already, so worker processes would only add overhead; and the
        order stays exactly resumable mid-epoch (see :meth:`state_dict`).
        """
        trainer = self.trainer
        self.sampler = InstructSampler(
            [len(s.input_ids) for s in self.train_samples],
            self.batch_size,
            num_replicas=trainer.world_size if trainer else 1,
            rank=trainer.global_rank if trainer else 0,
            group_by_length=self.group_by_length,
            seed=self.seed,
        )
        if self._resume is not None:
            self.sampler.resume_at(*self._resume)
        return DataLoader(
            self.train_samples,  # type: ignore[arg-type]  # a list is a map-style dataset
            batch_size=self.batch_size,
            sampler=self.sampler,
            collate_fn=self._collator(),
        )

    def state_dict(self) -> dict[str, Any]:
        """Where training stands in the data: the epoch and how many of its batches are done.

        Read from the Trainer's own progress, which counts what the loop consumed (a DataLoader's
        count would include what was fetched ahead).
        """
        trainer = self.trainer
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return {}
        done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        return {"epoch": trainer.current_epoch, "batches_done": done}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the training order where the checkpoint left it."""
        if state_dict:
            self._resume = (state_dict["epoch"], state_dict["batches_done"])

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_samples,  # type: ignore[arg-type]  # a list is a map-style dataset
            batch_size=self.eval_batch_size,
            shuffle=False,
            collate_fn=self._collator(),
            num_workers=self.num_workers,
        )
