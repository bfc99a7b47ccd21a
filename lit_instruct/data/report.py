"""What a run would train on, shown: per source the counts and token lengths, and samples with the
trained tokens marked, on a terminal (colours, or ``[[ ]]`` brackets when piped) or as one HTML page.

``lit-instruct inspect`` builds it from the same prepared data ``fit`` uses (the same cache), without
loading the model's weights.
"""

from __future__ import annotations

import html
import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from lit_instruct.data.images import describe
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


REPEATS_SHOWN = 4
"""A special token repeated this many times in a row or more (an image's tokens) is shown once,
with its count: ``<image>×16``."""


def collapse_repeats(text: str, special: list[str]) -> str:
    """``text`` with each run of :data:`REPEATS_SHOWN` or more copies of one special token as the
    token and its count."""
    if not special:
        return text
    names = "|".join(map(re.escape, sorted(set(special), key=len, reverse=True)))
    pattern = re.compile(rf"({names})\1{{{REPEATS_SHOWN - 1},}}")
    return pattern.sub(lambda m: f"{m.group(1)}×{len(m.group(0)) // len(m.group(1))}", text)


def special_texts(tokenizer: Any) -> list[str]:
    """The text of every special token of ``tokenizer`` (added ones included)."""
    special = [str(t) for t in tokenizer.all_special_tokens]
    return special + [str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special]


def thumbnail(reference: str, size: int = 96) -> str:
    """An image as a small PNG data URL, for the HTML report."""
    import base64
    import io

    from lit_instruct.data.images import open_image

    image = open_image(reference)
    image.thumbnail((size, size))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}"


def trained_count(sample: Sample) -> int:
    """Tokens of ``sample`` that carry a label (count in the loss)."""
    return sum(label != IGNORE_INDEX for label in sample.labels)


def sample_heading(sample: Sample) -> str:
    """Where ``sample`` came from (``file:line``) and its token counts, as both reports head it."""
    truncated = f", truncated from {sample.length_before_truncation}" if sample.truncated else ""
    return f"{sample.source}, {len(sample.input_ids)} tokens, {trained_count(sample)} trained{truncated}"


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
    """A report per source of ``store`` (the first ``shown`` samples of each); a validation source
    with nothing in it (no samples, all counts zero: no validation data) has none."""
    reports = []
    lengths = store.lengths
    token_sources = np.repeat(np.asarray(store.source_ids), lengths)  # from the flat arrays, not samples
    trained = np.bincount(
        token_sources[np.asarray(store.arrays["labels"]) != IGNORE_INDEX], minlength=len(store.names)
    )
    for index, name in enumerate(store.names):
        positions = store.indices_of(index)
        source_counts = counts.get(name, Counter())
        if split == "val" and not positions and not any(source_counts.values()):
            continue
        samples = [store[i] for i in positions[:shown]]
        reports.append(
            SourceReport(split, name, source_counts, lengths[positions], int(trained[index]), samples)
        )
    return reports


def terminal_text(reports: list[SourceReport], tokenizer: Any, colour: bool) -> str:
    """The report as terminal text: trained runs green (``colour``) or in ``[[ ]]``."""
    lines = []
    special = special_texts(tokenizer)
    for report in reports:
        counts = ", ".join(f"{k}={v}" for k, v in sorted(report.counts.items()))
        lines += [f"== {report.split} / {report.name}: {report.length_line()}", f"   {counts}"]
        for n, sample in enumerate(report.samples, start=1):
            text = "".join(
                (f"{GREEN}{BOLD}{t}{RESET}" if colour else f"[[{t}]]")
                if trained
                else collapse_repeats(t, special)
                for t, trained in segments(tokenizer, sample)
            )
            shown = f", images: {', '.join(describe(i) for i in sample.images)}" if sample.images else ""
            lines += [f"-- sample {n} ({sample_heading(sample)}{shown})", text]
    return "\n".join(lines) + "\n"


STYLE = """
body { font: 14px/1.5 system-ui, sans-serif; margin: 2em; color: #1d1d1f; }
h2 { margin-top: 2em; } table { border-collapse: collapse; } td { padding: 0 1em 0 0; }
.card { margin: 1em 0; border: 1px solid #ddd; border-radius: 6px; overflow: hidden; }
.card header { padding: .3em 1em; background: #ececec; font-size: 13px; overflow-wrap: anywhere; }
.card header .origin { font-family: monospace; }
pre.sample { white-space: pre-wrap; background: #f6f6f6; padding: 1em; margin: 0; line-height: 1.8; }
/* a tint, and an outline clear of the glyphs: at the text's edge (or as an underline) it would cover
   the underscores, which sit on the bottom pixel row of the text at 1x */
.trained { background: #d6f5d6; outline: 1px solid #5b5; padding: 1px 0 3px; }
.special { color: #a0a; font-weight: bold; }
.legend span { padding: 0 .4em; }
.images { padding: .5em 1em 0; background: #f6f6f6; } .thumb { max-height: 64px; margin-right: .5em; }
.histogram text { font-size: 11px; fill: #444; } .histogram line { stroke: #888; }
"""


def _marked(text: str, special: list[str]) -> str:
    """``text`` escaped, with the template's special tokens made visible."""
    out = html.escape(text)
    for token in sorted(special, key=len, reverse=True):
        escaped = html.escape(token)
        out = out.replace(escaped, f'<span class="special">{escaped}</span>')
    return out


def _ticks(low: float, high: float, most: int) -> list[int]:
    """At most ``most`` round whole numbers from ``low`` to ``high`` (steps of 1, 2 or 5 x 10^k)."""
    rough = max(high - low, 1) / max(most - 1, 1)
    power = 10 ** math.floor(math.log10(rough))
    step = max(1, next(m * power for m in (1, 2, 5, 10) if m * power >= rough))
    first = math.ceil(low / step) * step
    return [int(first + k * step) for k in range(int((high - first) // step) + 1)]


def _histogram(lengths: np.ndarray, width: int = 480, height: int = 100, bins: int = 24) -> str:
    """An inline SVG histogram of sample lengths: tokens on the x axis, samples on the y axis."""
    if not len(lengths):
        return ""
    counts, edges = np.histogram(lengths, bins=bins)
    left, top, bottom = 40, 8, 34  # margins for the y ticks, the top tick label, the x ticks and title
    low, high = float(edges[0]), float(edges[-1])
    y_ticks = _ticks(0, int(counts.max()), 4)
    y_top = max(int(counts.max()), y_ticks[-1], 1)

    def x_at(tokens: float) -> float:
        return left + (tokens - low) / (high - low) * width

    def y_at(count: float) -> float:
        return top + height - count / y_top * height

    parts = []
    for i, count in enumerate(counts):
        x0, x1 = x_at(edges[i]), x_at(edges[i + 1])
        tip = f"{edges[i]:.0f}-{edges[i + 1]:.0f} tokens: {count} samples"
        parts.append(
            f'<rect x="{x0:.1f}" y="{y_at(count):.1f}" width="{max(x1 - x0 - 1, 0.5):.1f}" '
            f'height="{top + height - y_at(count):.1f}" fill="#6a6"><title>{tip}</title></rect>'
        )
    base = top + height
    x_axis = [f'<line x1="{left}" y1="{base}" x2="{left + width}" y2="{base}"/>']
    for tick in _ticks(low, high, 7):
        x = x_at(tick)
        x_axis.append(
            f'<line x1="{x:.1f}" y1="{base}" x2="{x:.1f}" y2="{base + 4}"/>'
            f'<text class="tick" x="{x:.1f}" y="{base + 15}" text-anchor="middle">{tick}</text>'
        )
    x_axis.append(
        f'<text class="axis-title" x="{left + width / 2}" y="{base + 30}" text-anchor="middle">'
        "tokens per sample</text>"
    )
    y_axis = [f'<line x1="{left}" y1="{top}" x2="{left}" y2="{base}"/>']
    for tick in y_ticks:
        y = y_at(tick)
        y_axis.append(
            f'<line x1="{left - 4}" y1="{y:.1f}" x2="{left}" y2="{y:.1f}"/>'
            f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{tick}</text>'
        )
    y_axis.append(
        f'<text class="axis-title" transform="translate(10 {top + height / 2}) rotate(-90)" '
        'text-anchor="middle">samples</text>'
    )
    return (
        f'<svg class="histogram" width="{left + width + 12}" height="{top + height + bottom}">'
        f'{"".join(parts)}<g class="x-axis">{"".join(x_axis)}</g>'
        f'<g class="y-axis">{"".join(y_axis)}</g></svg>'
    )


def _card_header(number: int, sample: Sample) -> str:
    """A sample card's header: its number, where it came from (``file:line``) and its token counts."""
    truncated = (
        f' <span class="truncated">(truncated from {sample.length_before_truncation})</span>'
        if sample.truncated
        else ""
    )
    return (
        f'<header>sample {number} · <span class="origin">{html.escape(sample.source)}</span> · '
        f'<span class="tokens">{len(sample.input_ids)}</span> tokens, '
        f'<span class="trained-count">{trained_count(sample)}</span> trained{truncated}</header>'
    )


def html_page(reports: list[SourceReport], tokenizer: Any, title: str) -> str:
    """The report as one self-contained HTML page."""
    special = special_texts(tokenizer)
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
        for n, sample in enumerate(report.samples, start=1):
            body = "".join(
                f'<span class="trained">{_marked(text, special)}</span>'
                if trained
                else _marked(collapse_repeats(text, special), special)
                for text, trained in segments(tokenizer, sample)
            )
            parts.append(f'<article class="card">{_card_header(n, sample)}')
            if sample.images:  # each image the sample shows, in order
                thumbs = "".join(
                    f'<img class="thumb" src="{thumbnail(i)}" title="{html.escape(describe(i))}" '
                    f'alt="image {k + 1}">'
                    for k, i in enumerate(sample.images)
                )
                parts.append(f'<div class="images">{thumbs}</div>')
            parts.append(
                f'<pre class="sample" data-origin="{html.escape(sample.source)}">{body}</pre></article>'
            )
        parts.append("</section>")
    parts.append("</body></html>")
    return "".join(parts)
