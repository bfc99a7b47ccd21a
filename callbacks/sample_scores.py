"""Score greedy answers to held-out conversations at each validation, beside ``val/loss``.

The first ``num_samples`` conversations of the validation data are answered greedily (the prompt is
the conversation before its last trained answer, rendered as training rendered it, with the
generation prompt; the model is the one being trained, adapters and all), and the answers are
scored against the data's own answers with ``torchmetrics``, each a mean over the samples:
``val/gen/rougeL`` (ROUGE-L F1), ``val/gen/chrf`` (chrF) and ``val/gen/exact_match`` (answers equal
to the reference once stripped). They land in the loggers with the validation's other metrics
(``metrics.csv``); the samples go to ``<log dir>/samples.md`` and, with W&B, to the table
``val/samples``. The seconds it costs are a line of the fit report.

Example (on in ``configs/quickstart.yaml`` and ``configs/lora.yaml``)::

    trainer:
      callbacks:
        - class_path: lit_instruct.callbacks.SampleScores
          init_args: {num_samples: 4, max_new_tokens: 48}

Off: delete the entry, or set ``num_samples: 0`` (on the command line
``--trainer.callbacks.num_samples 0`` when it is the config's last callback).
"""

from __future__ import annotations

import itertools
import re
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lit_instruct.clock import duration
from lit_instruct.data.render import Sample
from lit_instruct.distributed import full_tensor, is_sharded
from lit_instruct.io import log_dir
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.rng import gather_objects
from lit_instruct.train.fit_report import logged_step

SCORE_KEYS = ("val/gen/rougeL", "val/gen/chrf", "val/gen/exact_match")
TABLE_KEY = "val/samples"
TABLE_COLUMNS = ["step", "prompt", "reference", "answer"]
MARKDOWN_FILE = "samples.md"


@dataclass(frozen=True)
class HeldOut:
    """A validation conversation to answer: ``prompt_ids`` (the tokens before its last trained answer:
    the conversation so far, rendered with the generation prompt) and ``reference`` (that answer's
    text, special tokens left out); ``origin`` is where its record was read."""

    prompt_ids: list[int]
    reference: str
    origin: str


def last_answer_span(labels: Sequence[int]) -> tuple[int, int] | None:
    """``[start, end)`` of the last run of labelled positions (the last trained answer and its
    end-of-turn token); ``None`` without one, or when it starts at position 0 (nothing before it to
    prompt with: plain text, ``train_on: all``)."""
    end = len(labels)
    while end and labels[end - 1] == IGNORE_INDEX:
        end -= 1
    start = end
    while start and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return (start, end) if start else None


def as_held_out(sample: Sample, tokenizer: Any) -> HeldOut | None:
    """``sample``'s last trained answer as a prompt and a reference; ``None`` when it has no prompt
    before it or the sample was truncated (the answer may be cut)."""
    span = last_answer_span(sample.labels)
    if span is None or sample.truncated:
        return None
    start, end = span
    reference = tokenizer.decode(sample.input_ids[start:end], skip_special_tokens=True)
    return HeldOut(list(sample.input_ids[:start]), reference, sample.source)


def held_out_conversations(samples: Iterable[Sample], tokenizer: Any, count: int) -> list[HeldOut]:
    """The first ``count`` conversations of ``samples`` that can be scored, each by its last trained
    answer. A conversation rendered as one sample per answer turn (``multi_turn: per_turn``, or
    ``auto`` with a template that rewrites earlier turns) is its last sample: consecutive samples
    of one record share its origin. Multi-turn conversations are prompted with every turn before
    their last answer (earlier answers included, as the data has them); a tool call is scored as
    the text the chat template renders for it. Truncated samples, samples without a prompt
    before their answer and samples that show images (answered from token ids, the images would be
    missing) are left out."""
    found: list[HeldOut] = []
    if count < 1:
        return found
    for _, turns in itertools.groupby(samples, key=lambda sample: sample.source):
        *_, last = turns
        item = None if last.images else as_held_out(last, tokenizer)
        if item is not None:
            found.append(item)
            if len(found) == count:
                break
    return found


@contextmanager
def whole_output_head(model: Any) -> Iterator[None]:
    """Under FSDP a head tied to the input embeddings holds the embedding's shard, which its own
    forward cannot multiply with (the loss gathers it, generation would not): while this lasts the
    head multiplies with the whole weight, gathered once on entry (a collective). Else nothing."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or not is_sharded(head.weight):
        yield
        return
    weight, bias = full_tensor(head.weight), full_tensor(head.bias)

    def whole(hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, weight, bias)  # type: ignore[arg-type]  # a weight: whole

    head.forward = whole  # type: ignore[method-assign, assignment]  # on the instance, while this lasts
    try:
        yield
    finally:
        del head.forward


@torch.inference_mode()
def greedy_answer(
    model: Any, tokenizer: Any, prompt_ids: list[int], max_new_tokens: int, synced: bool = False
) -> str:
    """The greedy answer to a prompt given as token ids, generated as
    :func:`lit_instruct.infer.generate.generate` generates (stopping at EOS, special tokens left out
    of the text). ``synced``: keep stepping until every rank is done (each forward of a sharded
    model is a collective)."""
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    output = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        use_cache=True,
        do_sample=False,
        synced_gpus=synced,
    )
    return tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)


def sample_scores(answers: list[str], references: list[str], device: torch.device) -> dict[str, float]:
    """Means over the samples of every rank (a collective under torch.distributed: each rank passes
    its own share, possibly none) of ROUGE-L F1, chrF (character 6-grams without spaces, beta 2)
    and exact match (once stripped) of ``answers`` against ``references``.

    chrF is scored per sample: torchmetrics' corpus chrF leaves out of its totals an answer that
    shares no n-gram with its reference, so a few good answers among empty ones would score high.
    """
    from torchmetrics import MeanMetric
    from torchmetrics.functional.text import chrf_score, rouge_score

    means = {key: MeanMetric().to(device) for key in SCORE_KEYS}
    for answer, reference in zip(answers, references, strict=True):
        values = (
            rouge_score(answer, reference, rouge_keys="rougeL")["rougeL_fmeasure"],
            torch.as_tensor(
                chrf_score([answer], [[reference]], n_word_order=0)
            ),  # one tensor: no sentence scores
            torch.tensor(float(answer.strip() == reference.strip())),
        )
        for key, value in zip(SCORE_KEYS, values, strict=True):
            means[key].update(value.to(device))
    with warnings.catch_warnings():  # a rank without a share made no update
        warnings.filterwarnings("ignore", ".*before the ``update`` method", UserWarning)
        return {key: float(mean.compute()) for key, mean in means.items()}  # synced over the ranks


def markdown_section(
    step: int, origins: list[str], rows: list[tuple[str, str, str]], scores: dict[str, float]
) -> str:
    """One validation's samples in Markdown: the step and scores, then each sample's origin (where its
    record was read) and its prompt, reference and answer, each in a fence longer than any backtick
    run in it."""

    def fenced(text: str) -> str:
        fence = "`" * max(3, 1 + max(map(len, re.findall("`+", text)), default=0))
        return f"{fence}text\n{text}\n{fence}\n"

    summary = ", ".join(f"{key.removeprefix('val/gen/')} {value:.4f}" for key, value in scores.items())
    parts = [f"## step {step}\n\n{summary}\n"]
    for number, (origin, (prompt, reference, answer)) in enumerate(zip(origins, rows, strict=True), 1):
        parts.append(f"\n### sample {number}: {origin}\n\nprompt:\n{fenced(prompt)}")
        parts.append(f"\nreference:\n{fenced(reference)}")
        parts.append(f"\nanswer:\n{fenced(answer)}")
    return "".join(parts) + "\n"


class SampleScores(L.Callback):
    """Greedy answers to the first ``num_samples`` validation conversations after each validation
    (not the sanity check; before fit too, with ``validate_before_fit``), scored against the data's
    answers: ``val/gen/rougeL``, ``val/gen/chrf``, ``val/gen/exact_match``.

    Under DDP or FSDP each rank answers its share (``i::world``) and the scores are reduced over
    the ranks; rank 0 appends the samples to ``<log dir>/samples.md`` and, when W&B logs, updates
    the table ``val/samples`` (step, prompt, reference, answer; kept in checkpoints).

    Turn it off by deleting its entry from ``trainer.callbacks``, or with ``num_samples: 0``.

    Args:
        num_samples: conversations answered at each validation (0: off).
        max_new_tokens: length bound of each answer.

    Raises:
        ValueError: with a negative ``num_samples`` or a non-positive ``max_new_tokens``.
    """

    def __init__(self, num_samples: int = 4, max_new_tokens: int = 48) -> None:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0 (0: off), got {num_samples}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.num_samples = num_samples
        self.max_new_tokens = max_new_tokens
        self.held_out: list[HeldOut] = []
        self.history: list[tuple[int, str, str, str]] = []  # (step, prompt, reference, answer)
        self.fit_seconds = 0.0  # spent during the current fit
        self._said_none = False

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage in (TrainerFn.FITTING, TrainerFn.VALIDATING) and self.num_samples:
            self.held_out = self._find_held_out(trainer)

    def _find_held_out(self, trainer: L.Trainer) -> list[HeldOut]:
        datamodule = getattr(trainer, "datamodule", None)
        kind = getattr(datamodule, "batch_kind", "conversations")
        if kind != "conversations":  # pairs, labelled answers: no conversation to answer
            self._said_none = True
            rank_zero_warn(
                f"SampleScores answers held-out conversations; this data holds {kind}: it scores nothing"
            )
            return []
        samples = getattr(datamodule, "val_samples", None) if datamodule is not None else None
        found = []
        if samples is not None:
            found = held_out_conversations(samples, datamodule.load_tokenizer(), self.num_samples)  # type: ignore[union-attr]
        if not found and not self._said_none:
            self._said_none = True
            rank_zero_warn(
                "SampleScores: no validation conversation to answer (no validation data, or none with a "
                "prompt before its answer, not truncated and without images): it scores nothing"
            )
        return found

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.fit_seconds = 0.0

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not self.held_out:
            return
        started = time.perf_counter()
        rank_zero_info(  # a progress bar stands still meanwhile: say why
            f"lit-instruct samples @ step {logged_step(trainer)}: generating {len(self.held_out)} greedy "
            f"answers of up to {self.max_new_tokens} tokens to score"
        )
        share = list(range(trainer.global_rank, len(self.held_out), trainer.world_size))
        answers = self._answer(trainer, pl_module, share)
        scores = sample_scores(answers, [self.held_out[i].reference for i in share], pl_module.device)
        pl_module.log_dict(scores, sync_dist=True)  # equal on every rank already (torchmetrics syncs)
        gathered = gather_objects(list(zip(share, answers, strict=True)))  # collective
        folder = log_dir(trainer)  # collective
        if trainer.is_global_zero:
            answered = dict(item for part in gathered for item in part)
            self._write(
                trainer,
                [answered[i] for i in range(len(self.held_out))],
                scores,
                folder,
                time.perf_counter() - started,
            )
        seconds = time.perf_counter() - started
        if trainer.state.fn == TrainerFn.FITTING:
            self.fit_seconds += seconds

    def _answer(self, trainer: L.Trainer, pl_module: L.LightningModule, share: list[int]) -> list[str]:
        """Greedy answers to this rank's share. A sharded model's forward is a collective: every
        rank then generates as often (a rank short of prompts answers one again, unused) and
        steps until all are done."""
        model: Any = pl_module.model  # the PEFT model (InstructLoRAModule's)
        tokenizer = trainer.datamodule.load_tokenizer()  # type: ignore[attr-defined]  # set by Lightning
        synced = trainer.world_size > 1 and any(is_sharded(p) for p in model.parameters())
        turns = -(-len(self.held_out) // trainer.world_size) if synced else len(share)
        answers = []
        with trainer.precision_plugin.val_step_context(), whole_output_head(model):  # autocast as validation
            for turn in range(turns):
                item = self.held_out[share[turn] if turn < len(share) else 0]
                answer = greedy_answer(model, tokenizer, item.prompt_ids, self.max_new_tokens, synced)
                if turn < len(share):
                    answers.append(answer)
        return answers

    def _write(
        self, trainer: L.Trainer, answers: list[str], scores: dict[str, float], folder: Path, seconds: float
    ) -> None:
        step = logged_step(trainer)
        tokenizer = trainer.datamodule.load_tokenizer()  # type: ignore[attr-defined]  # set by Lightning
        rows = [
            (tokenizer.decode(item.prompt_ids), item.reference, answer)
            for item, answer in zip(self.held_out, answers, strict=True)
        ]
        self.history += [(step, *row) for row in rows]
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                table = [[str(value) for value in row] for row in self.history]
                logger.log_text(TABLE_KEY, columns=TABLE_COLUMNS, data=table, step=step)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / MARKDOWN_FILE, "a", encoding="utf-8") as out:
            origins = [item.origin for item in self.held_out]
            out.write(markdown_section(step, origins, rows, scores))  # one write per validation
        summary = ", ".join(f"{key} {value:.4f}" for key, value in scores.items())
        rank_zero_info(
            f"lit-instruct samples @ step {step}: {summary} over {len(rows)} conversations "
            f"({duration(seconds)})"
        )

    def fit_cost(self) -> tuple[str, float]:
        """What the fit report shows of this callback: what it did and its seconds in this fit."""
        return "generating samples to score (SampleScores)", self.fit_seconds

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [(int(s), str(p), str(r), str(a)) for s, p, r, a in state_dict.get("history", [])]
