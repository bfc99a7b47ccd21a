"""What a run would train on, shown: per source the counts and token lengths, and samples with the
trained tokens marked, on a terminal (colours, or ``[[ ]]`` brackets when piped) or as one HTML page.

``lit-instruct inspect`` builds it from the same prepared data ``fit`` uses (the same cache), without
loading the model's weights.
"""

from __future__ import annotations

import html
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from lit_instruct.data.render import Sample
from lit_instruct.data.store import SampleStore
from lit_instruct.labels import IGNORE_INDEX

GREEN, BOLD, RESET = "\033[32m", "\033[1m", "\033[0m"


def segments(tokenizer: Any, sample: Sample) -> list[tuple[str, bool]]:
    """The sample's text in runs of trained (``True``) and context tokens, each run decoded whole."""
    runs: list[tuple[list[int], bool]] = []
    for token, label in zip(sample.input_ids, sample.labels, strict=True):
        trained = label != IGNORE_INDEX
        if runs and runs[-1][1] == trained:
            runs[-1][0].append(token)
        else:
            runs.append(([token], trained))
    return [(tokenizer.decode(ids), trained) for ids, trained in runs]


@dataclass
class SourceReport:
    """One source of one split: its counts, sample lengths and the samples to show."""

    split: str
    name: str
    counts: Counter[str]
    lengths: np.ndarray
    trained_tokens: int
    samples: list[Sample]

    def length_line(self) -> str:
        if not len(self.lengths):
            return "no samples"
        q = np.percentile(self.lengths, [0, 50, 95, 100]).astype(int)
        return (
            f"{len(self.lengths)} samples, tokens min {q[0]} / median {q[1]} / p95 {q[2]} / max {q[3]}, "
            f"{self.trained_tokens} trained"
        )


def source_reports(
    split: str, store: SampleStore, counts: dict[str, Counter[str]], shown: int
) -> list[SourceReport]:
    """A report per source of ``store`` (the first ``shown`` samples of each)."""
    reports = []
    lengths = store.lengths
    token_sources = np.repeat(np.asarray(store.source_ids), lengths)  # from the flat arrays, not samples
    trained = np.bincount(
        token_sources[np.asarray(store.arrays["labels"]) != IGNORE_INDEX], minlength=len(store.names)
    )
    for index, name in enumerate(store.names):
        positions = store.indices_of(index)
        samples = [store[i] for i in positions[:shown]]
        reports.append(
            SourceReport(
                split, name, counts.get(name, Counter()), lengths[positions], int(trained[index]), samples
            )
        )
    return reports


def terminal_text(reports: list[SourceReport], tokenizer: Any, colour: bool) -> str:
    """The report as terminal text: trained runs green (``colour``) or in ``[[ ]]``."""
    lines = []
    for report in reports:
        counts = ", ".join(f"{k}={v}" for k, v in sorted(report.counts.items()))
        lines += [f"== {report.split} / {report.name}: {report.length_line()}", f"   {counts}"]
        for n, sample in enumerate(report.samples, start=1):
            text = "".join(
                (f"{GREEN}{BOLD}{t}{RESET}" if colour else f"[[{t}]]") if trained else t
                for t, trained in segments(tokenizer, sample)
            )
            lines += [f"-- sample {n} ({sample.source}, {len(sample.input_ids)} tokens)", text]
    return "\n".join(lines) + "\n"


STYLE = """
body { font: 14px/1.5 system-ui, sans-serif; margin: 2em; color: #1d1d1f; }
h2 { margin-top: 2em; } table { border-collapse: collapse; } td { padding: 0 1em 0 0; }
pre.sample { white-space: pre-wrap; background: #f6f6f6; padding: 1em; border-radius: 6px; }
.trained { background: #c8f0c8; outline: 1px solid #6c6; }
.special { color: #a0a; font-weight: bold; }
.legend span { padding: 0 .4em; }
"""


def _marked(text: str, special: list[str]) -> str:
    """``text`` escaped, with the template's special tokens made visible."""
    out = html.escape(text)
    for token in sorted(special, key=len, reverse=True):
        escaped = html.escape(token)
        out = out.replace(escaped, f'<span class="special">{escaped}</span>')
    return out


def _histogram(lengths: np.ndarray, width: int = 480, height: int = 80, bins: int = 24) -> str:
    """An inline SVG histogram of sample lengths."""
    if not len(lengths):
        return ""
    counts, edges = np.histogram(lengths, bins=bins)
    bar = width / bins
    top = max(int(counts.max()), 1)
    rects = []
    for i, count in enumerate(counts):
        tall = count / top * height
        tip = f"{int(edges[i])}-{int(edges[i + 1])} tokens: {count}"
        rects.append(
            f'<rect x="{i * bar:.1f}" y="{height - tall:.1f}" width="{bar - 1:.1f}" height="{tall:.1f}" '
            f'fill="#6a6"><title>{tip}</title></rect>'
        )
    label = f'<text y="{height + 14}" font-size="11">{int(edges[0])} to {int(edges[-1])} tokens</text>'
    return f'<svg class="histogram" width="{width}" height="{height + 16}">{"".join(rects)}{label}</svg>'


def html_page(reports: list[SourceReport], tokenizer: Any, title: str) -> str:
    """The report as one self-contained HTML page."""
    special = [str(t) for t in tokenizer.all_special_tokens]
    special += [str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special]
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
        '<p class="legend"><span class="trained">trained tokens</span> '
        '<span class="special">special tokens</span> context</p>',
    ]
    for report in reports:
        rows = "".join(
            f"<tr><td>{html.escape(k)}</td><td>{v}</td></tr>" for k, v in sorted(report.counts.items())
        )
        parts += [
            f'<section class="source" data-split="{report.split}" data-name="{html.escape(report.name)}">',
            f"<h2>{report.split} / {html.escape(report.name)}</h2><p>{report.length_line()}</p>",
            f"<table>{rows}</table>{_histogram(report.lengths)}",
        ]
        for sample in report.samples:
            body = "".join(
                f'<span class="trained">{_marked(text, special)}</span>'
                if trained
                else _marked(text, special)
                for text, trained in segments(tokenizer, sample)
            )
            parts.append(f'<pre class="sample" data-origin="{html.escape(sample.source)}">{body}</pre>')
        parts.append("</section>")
    parts.append("</body></html>")
    return "".join(parts)
