"""InstructDataModule: read, split, render and batch instruction data, counting what is dropped."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Subset

from lit_instruct.batch import BatchKind
from lit_instruct.data.collate import PackCollator, PadCollator
from lit_instruct.data.even_shards import EvenShards, UncountedPadding
from lit_instruct.data.image_batches import ImageInputs
from lit_instruct.data.loader_workers import ignore_stop_signals
from lit_instruct.data.nothing_to_train import no_training_sample
from lit_instruct.data.pair_batches import PairBatches
from lit_instruct.data.prepare import DataSettings, PreparedData, TemplateRenderers, prepare
from lit_instruct.data.processor import image_processor_of
from lit_instruct.data.prompt_batches import PromptBatches
from lit_instruct.data.records import RecordFormat
from lit_instruct.data.render import MultiTurn, TrainOn
from lit_instruct.data.sources import CHATTERBOT, DataSource
from lit_instruct.data.store import SampleStore
from lit_instruct.data.training_feed import SampledFeed, StreamedFeed, TrainingFeed, key_values
from lit_instruct.data.unpaired_batches import UnpairedBatches
from lit_instruct.data.validation import BadRecordPolicy, LongSamplePolicy, Rejects
from lit_instruct.errors import ConfigError
from lit_instruct.io import log_dir
from lit_instruct.rules import flatten, refuse_conflicts
from lit_instruct.templates import resolve_chat_template, template_text
from lit_instruct.vocabulary import NewTokens, add_tokens, base_tokenizer, resolve_new_tokens


def unique_names(sources: list[DataSource], taken: list[DataSource]) -> list[DataSource]:
    """Shorthand sources named after their files, ``-2``, ``-3``... where stems repeat."""
    names = {s.name for s in taken}
    for source in sources:
        base, n = source.name, 1
        while source.name in names:
            n += 1
            source.name = f"{base}-{n}"
        names.add(source.name)
    return sources


def validation_split(path: str) -> str:
    """The split a ``val_files`` entry reads: a saved ``DatasetDict``'s ``validation`` (or ``val``,
    ``test``) split when it has one, else ``train``."""
    folder = Path(path)
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        return next((name for name in ("validation", "val", "test") if name in splits), "train")
    return "train"


class InstructDataModule(L.LightningDataModule):
    """Instruction data for causal-LM fine-tuning: files, folders, hub datasets, mixtures of them.

    What a batch holds is ``batch_kind``: rendered ``conversations`` (SFT), preference ``pairs``
    (:class:`~lit_instruct.data.pair_batches.PairBatches`), ``unpaired`` answers labelled desirable
    or not (KTO: :class:`~lit_instruct.data.unpaired_batches.UnpairedBatches`) or ``prompts`` whose
    answers the policy samples (GRPO, RLOO: :class:`~lit_instruct.data.prompt_batches.PromptBatches`);
    every kind reads the same sources with the same split, dedupe, tokenizer, sampler and resume. The
    settings that do not apply to a kind are refused with it (:data:`lit_instruct.rules.CONFLICTS`).

    Args:
        batch_kind: what the objective takes (the CLI links it to ``model.objective``).
        tokenizer: model name or folder whose tokenizer and chat template render the data (the CLI
            links it to ``model.model``).
        sources: the datasets to train on (:class:`~lit_instruct.data.sources.DataSource`: path,
            name, split, format, columns, weight, val_fraction, chat_template), mixed by weight.
        train_files: shorthand for sources with default settings: JSON/JSONL, parquet, arrow or csv
            files, folders of them, ``save_to_disk`` folders or hub ids (alpaca, prompt/completion,
            chat or ShareGPT records).
        val_files: held-out files; when empty, each source holds out its ``val_fraction``. A saved
            ``DatasetDict`` gives its ``validation`` (or ``val``, ``test``) split.
        val_sources: held-out sources with the settings of ``sources`` (split, format, columns,
            chat_template); with ``val_files``, both are validated on.
        chatterbot_categories: add the chatterbot-corpus English conversations of these categories
            (file stems such as ``greetings``; ``["all"]`` for every category).
        format: record format of the ``train_files`` / ``val_files``, or ``auto`` to detect it per record.
        max_seq_len: tokens per sample; what happens to longer ones is ``on_long_sample``.
        val_fraction: share of each source's records held out when no ``val_files`` are given.
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
        num_proc: processes that render and tokenize (once: the result is cached).
        cache: keep the tokenized samples in ``cache_dir``, keyed by the data's contents, the
            tokenizer, the templates and these settings; a second run memory-maps them.
        cache_dir: default ``$LIT_INSTRUCT_CACHE/data`` (``~/.cache/lit-instruct/data``).
        mixture_replacement: draw weighted sources' samples with replacement (default: whole
            passes in a fresh order, see :class:`InstructSampler`).
        streaming: read, shuffle (in a buffer) and render the training sources while training
            (:mod:`lit_instruct.data.stream`): nothing is prepared or cached, ranks read disjoint
            records, resume is exact; needs ``trainer.max_steps``. Validation comes from
            ``val_files`` (prepared as usual) or is off.
        shuffle_buffer: records in the streaming shuffle buffer (1: reading order).
        multi_turn: ``auto`` (one sample per conversation where the chat template is prefix-stable,
            else one per assistant turn, counted ``split_per_turn``), ``joint`` (one per conversation;
            a template that rewrites earlier turns is an error), ``per_turn`` (one per assistant
            turn, each rendered as the model sees it at that turn) or ``last`` (only the last
            answer trained: LLaMA-Factory's ``mask_history``).
        train_on: ``answers`` (the assistant turns) or ``all`` (every token of the rendering:
            Axolotl's ``train_on_inputs``).
        new_tokens: tokens to add to the vocabulary: ``auto`` (default: the turn markers the chat
            templates render, e.g. ChatML's ``<|im_start|>``, that the tokenizer does not hold as one
            token: a base model taught a chat format), a list, or ``null`` (markers stay split into
            pieces). The model adds the same (:meth:`new_token_list`; the CLI links them).
    """

    def __init__(
        self,
        tokenizer: str = "smollm2-135m-instruct",
        sources: list[DataSource] | None = None,
        train_files: list[str] | str | None = None,
        val_files: list[str] | str | None = None,
        val_sources: list[DataSource] | None = None,
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
        train_on: TrainOn = "answers",
        num_proc: int = 1,
        cache: bool = True,
        cache_dir: str | None = None,
        mixture_replacement: bool = False,
        streaming: bool = False,
        shuffle_buffer: int = 10_000,
        new_tokens: NewTokens = "auto",
        batch_kind: BatchKind = "conversations",
    ) -> None:
        super().__init__()
        given = {key: value for key, value in locals().items() if key not in ("self", "__class__")}
        refuse_conflicts(flatten({"data": given}))  # the settings this batch kind cannot take
        train_files = [train_files] if isinstance(train_files, str) else train_files  # one path: [path]
        val_files = [val_files] if isinstance(val_files, str) else val_files
        self.sources = [s if isinstance(s, DataSource) else DataSource(**s) for s in sources or []]
        self.sources += unique_names(
            [DataSource(path, format=format) for path in train_files or []], self.sources
        )
        if chatterbot_categories:
            self.sources.append(DataSource(CHATTERBOT + ",".join(chatterbot_categories)))
        if not (self.sources or val_files or val_sources):
            raise ConfigError(
                "data.sources",
                "no data given: set sources, train_files or chatterbot_categories (or only val_files, "
                "to validate)",
            )
        if not 0.0 <= val_fraction < 1.0:
            raise ConfigError("data.val_fraction", f"must be in [0, 1), got {val_fraction}")
        self.save_hyperparameters()
        self.tokenizer_name = tokenizer
        self.val_sources = [s if isinstance(s, DataSource) else DataSource(**s) for s in val_sources or []]
        self.val_sources += unique_names(
            [DataSource(path, format=format, split=validation_split(path)) for path in val_files or []],
            self.val_sources,
        )
        self.settings = DataSettings(
            max_seq_len=max_seq_len,
            multi_turn=multi_turn,
            train_on=train_on,
            chat_template=template_text(chat_template),
            val_fraction=val_fraction,
            split_seed=split_seed,
            deduplicate=deduplicate,
            on_bad_record=on_bad_record,
            on_long_sample=on_long_sample,
        )
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.pad_to_multiple_of = pad_to_multiple_of
        self.num_workers = num_workers
        self.rejects_file = rejects_file
        self.packing = packing
        self.num_proc = num_proc
        self.cache = cache
        self.cache_dir = cache_dir
        self.streaming = streaming
        self.feed: TrainingFeed = (
            StreamedFeed(self.sources, seed, shuffle_buffer)
            if streaming
            else SampledFeed(seed, group_by_length, mixture_replacement)
        )
        self.new_tokens = new_tokens
        self.added_tokens: list[str] = []
        self.tokenizer: Any = None
        self.processor: Any = None
        """A vision-language model's processor (its image processor and template), else ``None``."""
        self.prepared: PreparedData | None = None
        self._set_up = False
        self.batch_kind = batch_kind
        parts = {"pairs": PairBatches, "unpaired": UnpairedBatches, "prompts": PromptBatches}
        self.part: Any = parts.get(batch_kind, lambda data: None)(self)
        """What reads, renders and batches a kind other than conversations (``None`` for those)."""

    def prepare_data(self) -> None:
        """Prepare a bundled model's tokenizer, and the tokenized data into the cache (rank 0 only:
        the other ranks then load it in :meth:`setup`)."""
        from lit_instruct.model_names import resolve_model_path

        resolve_model_path(self.tokenizer_name)
        if self.cache and self.prepared is None:  # not handed over already (``fit`` checks data first)
            self.prepared = self.prepare_samples()  # this rank's setup reports what it did

    def load_tokenizer(self) -> Any:
        """Load (once) the tokenizer named by ``tokenizer``, with the new tokens added."""
        if self.tokenizer is None:
            tokenizer = base_tokenizer(self.tokenizer_name)
            self.added_tokens = resolve_new_tokens(tokenizer, self._templates(tokenizer), self.new_tokens)
            if self.added_tokens:
                ids = add_tokens(tokenizer, self.added_tokens)
                rank_zero_info(f"new tokens {self.added_tokens} (ids {ids}): the chat template renders them")
            self.tokenizer = tokenizer
            self.processor = image_processor_of(self.tokenizer_name, tokenizer)
        return self.tokenizer

    def new_token_list(self) -> list[str]:
        """The tokens this data adds to the vocabulary, in order (what the model must add too)."""
        self.load_tokenizer()
        return list(self.added_tokens)

    def _templates(self, tokenizer: Any) -> list[str]:
        """The chat templates the sources are rendered with (plain-text data has none)."""
        found = []
        for source in self.sources + self.val_sources:
            try:
                found.append(resolve_chat_template(tokenizer, self.settings.template_for(source)))
            except ValueError:
                continue
        return list(dict.fromkeys(found))

    def data_cache_dir(self) -> Path | None:
        """Where tokenized data is cached (``None`` with ``cache: false``)."""
        if not self.cache:
            return None
        from lit_instruct.model_names import cache_dir

        return Path(self.cache_dir) if self.cache_dir else cache_dir() / "data"

    def prepare_samples(self) -> PreparedData:
        """Read, split and tokenize the sources (or memory-map them from the cache); when streaming,
        only the validation sources."""
        if self.part is not None:
            return self.part.prepare()
        return prepare(
            [] if self.streaming else self.sources,
            self.val_sources,
            self.load_tokenizer(),
            self.settings,
            self.model_vocab_size(),
            self.num_proc,
            self.data_cache_dir(),
            self.processor,
        )

    @property
    def train_samples(self) -> SampleStore:
        return self._prepared().train

    @property
    def val_samples(self) -> SampleStore:
        return self._prepared().val

    @property
    def counts(self) -> dict[str, Counter[str]]:
        """Per split, what was read, kept, truncated, dropped or skipped (summed over sources)."""
        prepared = self._prepared()
        return {split: prepared.totals(split) for split in ("train", "val")}

    def _prepared(self) -> PreparedData:
        if self.prepared is None:
            raise RuntimeError("InstructDataModule: call setup() before reading its samples or counts")
        return self.prepared

    def setup(self, stage: str | None = None) -> None:
        """Read, split and tokenize the data once (a cache hit memory-maps it), report the counts."""
        if self._set_up:
            return
        self._set_up = True
        if self.prepared is None:  # not prepared by this process's prepare_data
            self.prepared = self.prepare_samples()
        prepared = self.prepared
        for split, store in (("train", prepared.train), ("val", prepared.val)):
            counts = prepared.totals(split)
            if not counts:  # streamed training data, or no validation: nothing prepared to report
                continue
            rank_zero_info(f"lit-instruct data [{split}]: {key_values(sorted(counts.items()))}")
            if len(store.names) > 1:
                rank_zero_info(f"lit-instruct data [{split}] {key_values(store.counts_by_source().items())}")
        if prepared.folder is not None:
            how = "memory-mapped from" if prepared.cached else "tokenized into"
            rank_zero_info(f"lit-instruct data: samples {how} the cache {prepared.folder}")
        self._write_rejects(prepared.rejects)  # the same on every rank: each prepared the same data
        if self.packing and any(len(store.arrays["images"]) for store in (prepared.train, prepared.val)):
            raise ConfigError(
                "data.packing",
                "true cannot pack samples with images (a vision-language model's attention and image "
                "positions are not split per sample): set data.packing: false",
            )
        if self.packing and self.streaming and self.processor is not None:
            raise ConfigError(
                "data.packing",
                "true with data.streaming: true cannot be checked for images before training a "
                "vision-language model (a stream is read while training; images cannot be packed): set "
                "data.streaming: false, or data.packing: false",
            )
        if self.streaming:
            rank_zero_info("lit-instruct data [train]: streamed (read and rendered while training)")
        elif stage in ("fit", None) and (nothing := self.nothing_to_train()) is not None:
            raise nothing

    def nothing_to_train(self) -> ConfigError | None:
        """Why the prepared training data holds no sample, as the error to raise (``None``: it holds
        some, or it is streamed): a fit that would train nothing is refused, never a success."""
        prepared = self._prepared()
        if self.streaming:
            return None
        if len(prepared.train):
            return self.part.nothing_to_train() if self.part is not None else None
        sources = [source.path for source in self.sources]
        return no_training_sample(prepared.totals("train"), sources, self.settings.max_seq_len)

    def cache_reference(self, *args: Any, **kwargs: Any) -> int:
        """Pairs: their reference log-probabilities computed once
        (:meth:`~lit_instruct.data.pair_batches.PairBatches.cache_reference`)."""
        if not hasattr(self.part, "cache_reference"):
            raise ValueError(
                f"reference values are precomputed for pairs, not batch_kind={self.batch_kind!r}"
            )
        return self.part.cache_reference(*args, **kwargs)

    def pairs(self, split: str) -> Any:
        """The ``train`` or ``val`` pairs (``batch_kind: pairs``, after :meth:`setup`)."""
        if not hasattr(self.part, "pairs"):
            raise ValueError(f"the data holds {self.batch_kind}, not pairs")
        return self.part.pairs(split)

    def training_chat_template(self) -> str | None:
        """The chat template the training sources are rendered with, when they share one (``None``
        when sources set different ones, or when there is none: no override and a tokenizer without
        one, plain-text data)."""
        tokenizer = self.load_tokenizer()
        chosen = {self.settings.template_for(source) for source in self.sources}
        if self.processor is not None:  # a vision-language model's template is its processor's
            chosen = {override or getattr(self.processor, "chat_template", None) for override in chosen}
        try:
            templates = {resolve_chat_template(tokenizer, override) for override in chosen}
        except ValueError:  # no template anywhere (plain-text data): nothing to remember
            return None
        return templates.pop() if len(templates) == 1 else None

    def model_vocab_size(self) -> int | None:
        """Embedding rows of the model whose folder holds the tokenizer (``None`` without a config)."""
        from transformers import AutoConfig

        from lit_instruct.model_names import resolve_model_path

        try:
            config = AutoConfig.from_pretrained(resolve_model_path(self.tokenizer_name))
        except (OSError, ValueError):
            return None
        rows = getattr(config.get_text_config(), "vocab_size", None)
        if rows is not None and self.new_token_list():  # the model grows its rows to hold them
            rows = max(rows, len(self.load_tokenizer()))
        return rows

    def rejects_path(self) -> Path:
        """``rejects_file``, else ``rejects.jsonl`` in the log directory (or the working directory)."""
        if self.rejects_file:
            return Path(self.rejects_file)
        trainer = self.trainer
        return (log_dir(trainer) if trainer else Path(".")) / "rejects.jsonl"

    def _collator(self, source: str | None = None) -> Any:
        if self.part is not None:
            return self.part.collator()
        if self.packing:
            return PackCollator(source)
        tokenizer = self.load_tokenizer()
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        images = ImageInputs(self.processor) if self.processor is not None else None
        return PadCollator(pad_id, self.pad_to_multiple_of, source, images)

    def train_dataloader(self) -> DataLoader:
        feed, collate, size = self.feed, self._collator(), self.batch_size
        if isinstance(feed, StreamedFeed):
            renderers = TemplateRenderers(self.load_tokenizer(), self.settings, self.processor)
            settings = renderers.settings(self.sources, self.model_vocab_size())
            return feed.loader(settings, size, collate, self.trainer)
        loader = feed.loader(
            self.train_samples, [s.weight for s in self.sources], size, collate, self.trainer
        )
        return loader if self.part is None else self.part.train_dataloader(loader.sampler)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return self.feed.on_batch(batch)

    def teardown(self, stage: str) -> None:
        """After fit (once: not again after validate), report what a stream read and write the
        records it rejected (the same rows on every rank, so the log-folder collective stays in step)."""
        if stage == TrainerFn.FITTING and (rows := self.feed.rejects_after_fit()):
            self._write_rejects(rows)

    def _write_rejects(self, rows: list[dict[str, Any]]) -> None:
        """Write skipped records to the rejects file on rank 0 (every rank calls it: finding the
        log directory is a collective)."""
        path = self.rejects_path()
        if rows and (self.trainer is None or self.trainer.is_global_zero):
            Rejects(rows=rows).write(path)
            rank_zero_info(f"lit-instruct data: {len(rows)} bad records skipped, listed in {path}")

    def repeat_windows(self, repeats: int) -> None:
        """Give each optimizer step's batches (its accumulation window) ``repeats`` times in a row:
        online RL's ``num_iterations``, set by the module from its objective."""
        if not isinstance(self.feed, SampledFeed):
            if repeats == 1:
                return
            raise ConfigError(
                "data.streaming",
                f"true cannot be combined with num_iterations={repeats} (each window of prompts is "
                "given again for each iteration; a stream gives each once): set data.streaming: false",
            )
        self.feed.repeats = repeats

    def state_dict(self) -> dict[str, Any]:
        """Where training stands in the data (the feed's place), while fitting."""
        trainer = self.trainer
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return {}
        return self.feed.state_dict(trainer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the training order where the checkpoint left it."""
        if state_dict:
            self.feed.load_state_dict(state_dict)

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """The validation samples; with several sources, one loader per source whose batches carry
        the source's ``name`` (the module logs ``val/loss/<name>``)."""
        if self.part is not None:
            return self.part.val_dataloader()
        store = self.val_samples
        names = [n for n, count in store.counts_by_source().items() if count]
        if len(names) <= 1:
            return self._val_loader(store, None)
        dataset: Any = store  # a sequence is a map-style dataset
        return [self._val_loader(Subset(dataset, store.indices_of(store.names.index(n))), n) for n in names]

    def _val_loader(self, samples: Any, name: str | None) -> DataLoader:
        """Over several ranks, each sample counted once (:mod:`lit_instruct.data.even_shards`)."""
        trainer = self.trainer
        sampler = None
        if trainer is not None and trainer.world_size > 1:
            sampler = EvenShards(samples, trainer.world_size, trainer.global_rank)
        return DataLoader(
            UncountedPadding(samples) if sampler is not None else samples,
            batch_size=self.eval_batch_size,
            shuffle=False,
            sampler=sampler,
            collate_fn=self._collator(name),
            num_workers=self.num_workers,
            worker_init_fn=ignore_stop_signals,
        )
