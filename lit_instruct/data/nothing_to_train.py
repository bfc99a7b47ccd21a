"""The one line that says why the data left no training sample: a run that would train nothing is a
mistake to name (exit 2, before any weights load), never a success."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from lit_instruct.errors import ConfigError

TRUNCATED_AWAY = "dropped_no_response_after_truncation"
MIN_CUT_ANSWER_TOKENS = 16
"""A pair whose truncation left an answer fewer tokens than this is counted as ``answers_cut_short``;
when every training pair is, the fit is refused (a preference between answers' first few tokens)."""
ANSWERS_CUT_SHORT = "answers_cut_short"


def _named(sources: Sequence[str]) -> str:
    return ", ".join(sources) or "the training sources"


def no_training_sample(counts: Counter[str], sources: Sequence[str], max_seq_len: int) -> ConfigError:
    """Why ``sources`` gave no training sample, from their ``counts`` (:class:`~lit_instruct.data.
    prepare.PreparedData` totals), as the error naming the setting to change."""
    named = _named(sources)
    total = sum(counts.values())
    if total == 0:
        return ConfigError("data.train_files", f"no record in {named} (an empty file?)")
    skipped = sum(n for reason, n in counts.items() if reason.startswith("skipped_"))
    dropped = {reason: n for reason, n in counts.items() if reason.startswith("dropped_")}
    if counts[TRUNCATED_AWAY] and counts[TRUNCATED_AWAY] == sum(dropped.values()) and not skipped:
        return ConfigError(
            "data.max_seq_len",
            f"{max_seq_len}: every response truncated away ({counts[TRUNCATED_AWAY]} of "
            f"{counts[TRUNCATED_AWAY]} samples of {named}); raise it",
        )
    if skipped and not dropped:
        reasons = ", ".join(f"{r}={n}" for r, n in sorted(counts.items()) if r.startswith("skipped_"))
        return ConfigError(
            "data.on_bad_record",
            f"skip: every record of {named} was skipped as bad ({reasons}); the rejects file says why",
        )
    shown = ", ".join(f"{reason}={n}" for reason, n in sorted(counts.items()))
    return ConfigError("data", f"no training sample is left of {named} ({shown})")


def pairs_cut_short(counts: Counter[str], sources: Sequence[str], max_seq_len: int) -> ConfigError | None:
    """The error when every training pair of ``sources`` had an answer cut to under
    :data:`MIN_CUT_ANSWER_TOKENS` tokens (``None`` when some pair kept more)."""
    pairs = counts["pairs"]
    if not pairs or counts[ANSWERS_CUT_SHORT] != pairs:
        return None
    return ConfigError(
        "data.max_seq_len",
        f"{max_seq_len}: every pair's answers cut to under {MIN_CUT_ANSWER_TOKENS} tokens ({pairs} of "
        f"{pairs} pairs of {_named(sources)}); raise it",
    )
