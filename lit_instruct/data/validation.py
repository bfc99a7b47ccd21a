"""What happens to bad records and long samples: raise, or skip/drop them with a count and a trace."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from lit_instruct.data.records import DataError, Record
from lit_instruct.data.render import ChatRenderer, Sample

BadRecordPolicy = Literal["raise", "skip"]
LongSamplePolicy = Literal["truncate", "drop", "raise"]


@dataclass
class Rejects:
    """Bad records: with ``policy="raise"`` the first one raises; with ``"skip"`` each is counted
    (``skipped_<reason>``) and kept, with its location and text, for the rejects file."""

    policy: BadRecordPolicy = "raise"
    rows: list[dict[str, Any]] = field(default_factory=list)

    def handle(self, error: DataError, record: str | dict[str, Any] | None, counts: Counter[str]) -> None:
        if self.policy == "raise":
            raise error
        counts[f"skipped_{error.reason}"] += 1
        self.rows.append(
            {"source": error.source, "reason": error.reason, "error": str(error), "record": record}
        )

    def on_bad_raw(self, counts: Counter[str]) -> Any:
        """A callback for :func:`read_records`."""
        return lambda raw, error: self.handle(error, raw.text, counts)

    def write(self, path: Path) -> Path:
        """One JSON line per skipped record, in reading order."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in self.rows), encoding="utf-8"
        )
        return path


def _record_json(record: Record) -> dict[str, Any]:
    return {"messages": [asdict(m) for m in record.messages]}


def check_vocabulary(sample: Sample, vocab_size: int, tokenizer: Any) -> None:
    """Every token id must have an embedding row (``vocab_size`` rows, which may exceed the
    tokenizer's base vocabulary) or the forward pass would fail or read garbage."""
    bad = next((i for i in sample.input_ids if i >= vocab_size), None)
    if bad is not None:
        raise DataError(
            sample.source,
            f"token id {bad} ({tokenizer.convert_ids_to_tokens(bad)!r}) is >= the model's {vocab_size} "
            "embedding rows: the tokenizer does not match the model (resize the embeddings or fix the "
            "tokenizer)",
            reason="token_out_of_vocabulary",
        )


def build_samples(
    records: list[Record],
    renderer: ChatRenderer,
    counts: Counter[str],
    rejects: Rejects,
    on_long_sample: LongSamplePolicy = "truncate",
    vocab_size: int | None = None,
) -> list[Sample]:
    """Render ``records`` into samples (several per record where the renderer splits a conversation
    per assistant turn, counted ``split_per_turn``). Long samples are truncated (counted
    ``truncated``), dropped (``dropped_too_long``) or raise; samples left with no response token are
    dropped and counted."""
    samples = []
    for record in records:
        try:
            rendered, split = renderer.samples(record)
            for sample in rendered:
                if vocab_size is not None:
                    check_vocabulary(sample, vocab_size, renderer.tokenizer)
                if sample.truncated and on_long_sample == "raise":
                    raise DataError(
                        record.source,
                        f"the sample has {sample.length_before_truncation} tokens, more than "
                        f"max_seq_len={renderer.max_seq_len}",
                        reason="too_long",
                    )
        except DataError as error:
            rejects.handle(error, _record_json(record), counts)
            continue
        counts["split_per_turn"] += split
        for sample in rendered:
            if sample.truncated and on_long_sample == "drop":
                counts["dropped_too_long"] += 1
                continue
            counts["truncated"] += sample.truncated
            if sample.num_targets == 0:
                reason = "no_response_after_truncation" if sample.truncated else "no_response_tokens"
                counts[f"dropped_{reason}"] += 1
                continue
            samples.append(sample)
    counts["samples"] = len(samples)
    counts["response_tokens"] = sum(s.num_targets for s in samples)
    return samples
