"""``lit-instruct inspect``: the data as ``fit`` would train on it, the trained tokens marked, on the
terminal and in an HTML page checked in a real headless browser (Debian's chromium)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterable
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lit_instruct.cli import main
from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.data.render import Sample
from lit_instruct.data.report import STYLE
from lit_instruct.labels import IGNORE_INDEX
from tests.ci import require_or_skip

ROOT = Path(__file__).resolve().parent.parent


def args_for(tiny_model_dir: Path, data: Path, *extra: str) -> list[str]:
    config = str(ROOT / "configs" / "lora.yaml")
    return [
        "inspect",
        "--config",
        config,
        "--model.model",
        str(tiny_model_dir),
        "--data.train_files",
        f"[{data}]",
        *extra,
    ]


BROWSER = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]


def prepared(tiny_model_dir: Path, data: Path) -> InstructDataModule:
    """The data as lora.yaml splits it, set up without inspect's code."""
    module = InstructDataModule(
        tokenizer=str(tiny_model_dir), train_files=[str(data)], val_fraction=0.15, cache=False
    )
    module.setup("fit")
    return module


def trained_texts(module: InstructDataModule) -> dict[str, str]:
    """Each training sample's labelled tokens, decoded: what must be marked."""
    return {
        s.source: module.tokenizer.decode(
            [t for t, label in zip(s.input_ids, s.labels, strict=True) if label != IGNORE_INDEX]
        )
        for s in module.train_samples
    }


def token_counts(samples: Iterable[Sample]) -> dict[str, tuple[int, int]]:
    """Per sample origin, its tokens and its labelled tokens, counted from the sample itself."""
    return {s.source: (len(s.input_ids), sum(label != IGNORE_INDEX for label in s.labels)) for s in samples}


def browser_dom(page: Path) -> str:
    """``page``'s DOM as headless chromium builds it."""
    if shutil.which("chromium") is None:
        require_or_skip("needs Debian's chromium (apt-get install chromium)")
    dom = subprocess.run([*BROWSER, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    return dom.stdout


def test_inspect_marks_exactly_the_trained_tokens(tiny_model_dir, chat_file, tmp_path, capsys) -> None:
    main(args_for(tiny_model_dir, chat_file, "--samples", "50"))
    out = capsys.readouterr().out
    assert re.search(r"== train / chat: \d+ samples, tokens min \d+ / median \d+ / p95 \d+ / max \d+", out)
    module = prepared(tiny_model_dir, chat_file)
    expected = trained_texts(module)
    shown = re.findall(
        r"-- sample \d+ \((.+?), (\d+) tokens, (\d+) trained\)\n(.*?)(?=\n-- sample|\n== |\Z)", out, re.DOTALL
    )
    train_shown = shown[: len(expected)]
    assert {origin for origin, *_ in train_shown} == expected.keys()
    assert {o: (int(n), int(t)) for o, n, t, _ in train_shown} == token_counts(module.train_samples)
    for origin, _, _, text in train_shown:  # piped: trained runs in [[ ]]
        assert "".join(re.findall(r"\[\[(.*?)\]\]", text, re.DOTALL)) == expected[origin]


class Page(HTMLParser):
    """What a browser's DOM of the report shows: the sections, per sample card its header's text and
    its trained spans' text, and per section's histogram its axes' titles and tick labels with
    their positions."""

    def __init__(self) -> None:
        super().__init__()
        self.splits: list[str] = []
        self.headers: list[str] = []
        self.trained: dict[str, str] = {}
        self.ticks: dict[str, dict[str, list[tuple[float, int]]]] = {}  # per split and axis
        self.titles: dict[str, list[str]] = {}  # per split
        self.origin: str | None = None
        self.in_header = False
        self.axis: str | None = None
        self.text: str | None = None  # the text element being read: "tick" or "axis-title"
        self.tick_at = 0.0
        self.depth = 0  # inside a trained span: count nested spans

    def handle_starttag(self, tag, attrs) -> None:
        attributes = dict(attrs)
        if tag == "section" and attributes.get("class") == "source":
            self.splits.append(attributes["data-split"])
            self.ticks[self.splits[-1]] = {"x-axis": [], "y-axis": []}
            self.titles[self.splits[-1]] = []
        elif tag == "header":
            self.in_header = True
            self.headers.append("")
        elif tag == "pre" and attributes.get("class") == "sample":
            self.origin = attributes["data-origin"]
            self.trained.setdefault(self.origin, "")
        elif tag == "span" and (self.depth or attributes.get("class") == "trained"):
            self.depth += 1
        elif tag == "g" and attributes.get("class") in ("x-axis", "y-axis"):
            self.axis = attributes["class"]
        elif tag == "text" and self.axis:
            self.text = attributes.get("class")
            self.tick_at = float(attributes.get("x" if self.axis == "x-axis" else "y") or "nan")

    def handle_endtag(self, tag) -> None:
        if tag == "span" and self.depth:
            self.depth -= 1
        elif tag == "pre":
            self.origin = None
        elif tag == "header":
            self.in_header = False
        elif tag == "g":
            self.axis = None
        elif tag == "text":
            self.text = None

    def handle_data(self, data) -> None:
        if self.in_header:
            self.headers[-1] += data
        if self.origin is not None and self.depth:
            self.trained[self.origin] += data
        if self.text == "tick" and self.axis:
            self.ticks[self.splits[-1]][self.axis].append((self.tick_at, int(data)))
        elif self.text == "axis-title":
            self.titles[self.splits[-1]].append(data)


def assert_linear(ticks: list[tuple[float, int]]) -> None:
    """Tick labels that increase, and positions that follow them on one linear scale."""
    values = [value for _, value in ticks]
    assert values == sorted(set(values))
    if len(ticks) > 2:
        (a0, v0), (a1, v1) = ticks[0], ticks[-1]
        for at, value in ticks:
            assert at == pytest.approx(a0 + (value - v0) / (v1 - v0) * (a1 - a0), abs=0.15)


def assert_cards_show_origins_and_counts(shown: Page, module: InstructDataModule, data: Path) -> None:
    """Each card's header names the record's file:line and the sample's own token counts."""
    headers = [re.fullmatch(r"sample \d+ · (.+) · (\d+) tokens, (\d+) trained", h) for h in shown.headers]
    assert all(headers), shown.headers
    counts = {m[1]: (int(m[2]), int(m[3])) for m in headers if m}
    samples = [*module.train_samples, *module.val_samples]
    assert counts == token_counts(samples) and len(headers) == len(samples)
    lines = data.read_text().splitlines()
    for sample in samples:  # the line named holds the record: its last answer is in the sample's text
        path, line = sample.source.rsplit(":", 1)
        assert path == str(data)
        answer = json.loads(lines[int(line) - 1])["messages"][-1]["content"]
        assert answer in module.tokenizer.decode(sample.input_ids)


def assert_histogram_axes(shown: Page, lengths: list[int]) -> None:
    """The training histogram's token ticks lie within the lengths' range, its count ticks run from
    0 to at most the sample count, each on a linear scale, with the axes' titles."""
    x_ticks, y_ticks = shown.ticks["train"]["x-axis"], shown.ticks["train"]["y-axis"]
    assert len(x_ticks) >= 2 and min(lengths) <= x_ticks[0][1] and x_ticks[-1][1] <= max(lengths)
    assert x_ticks[0][0] < x_ticks[-1][0]  # left to right
    assert y_ticks[0][1] == 0 and 0 < y_ticks[-1][1] <= len(lengths)
    assert y_ticks[0][0] > y_ticks[-1][0]  # bottom to top
    assert_linear(x_ticks)
    assert_linear(y_ticks)
    assert shown.titles["train"] == ["tokens per sample", "samples"]


def test_the_html_report_in_a_real_browser(tiny_model_dir, chat_file, tmp_path) -> None:
    """The trained spans are exactly the labels; the cards' headers and the histogram's axes are
    right (one browser run for all: each costs a second or two)."""
    page = tmp_path / "report.html"
    main(args_for(tiny_model_dir, chat_file, "--samples", "50", "--html", str(page)))
    shown = Page()
    shown.feed(browser_dom(page))
    module = prepared(tiny_model_dir, chat_file)
    expected = trained_texts(module)
    assert {k: v for k, v in shown.trained.items() if k in expected} == expected
    assert shown.splits == ["train", "val"]
    assert_cards_show_origins_and_counts(shown, module, chat_file)
    assert_histogram_axes(shown, [len(s.input_ids) for s in module.train_samples])
    shot = tmp_path / "report.png"
    subprocess.run(
        [*BROWSER, "--window-size=1000,800", f"--screenshot={shot}", page.as_uri()],
        capture_output=True,
        timeout=120,
    )
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


def test_no_validation_section_without_validation_data(tiny_model_dir, chat_file, tmp_path, capsys) -> None:
    page = tmp_path / "report.html"
    main(args_for(tiny_model_dir, chat_file, "--data.val_fraction", "0", "--html", str(page)))
    shown = Page()
    shown.feed(page.read_text())
    assert shown.splits == ["train"]
    assert "== val" not in capsys.readouterr().out


def test_item13_inspect_exits_2_when_no_training_sample_survives(tiny_model_dir, chat_file, capsys) -> None:
    with pytest.raises(SystemExit) as stop:  # every answer truncated away
        main(args_for(tiny_model_dir, chat_file, "--data.max_seq_len", "4", "--data.val_fraction", "0"))
    assert stop.value.code == 2  # as fit and check refuse it
    captured = capsys.readouterr()
    assert "dropped_no_response_after_truncation=" in captured.out  # the counts that tell why, first
    assert (
        captured.err.strip()
        .splitlines()[-1]
        .startswith("lit-instruct: config error: data.max_seq_len: 4: every response truncated away")
    )


def grey(pixels: np.ndarray) -> np.ndarray:
    """Where ``pixels`` (rows x columns x RGB) are text drawn over the tint: darker than it, and not
    the outline's green."""
    red, green = pixels[..., 0], pixels[..., 1]
    return (pixels.max(axis=-1) < 200) & (green - red < 40)


def test_trained_marking_leaves_underscores_visible_at_1x(tmp_path) -> None:
    """Underscores shot at device scale 1 (where a 1-pixel outline and an underscore's 1-pixel row can
    coincide), unmarked and marked side by side: where the unmarked text draws them, the marked
    text still does, in grey, apart from the outline's green, and the marking adds no grey."""
    if shutil.which("chromium") is None:
        require_or_skip("needs Debian's chromium (apt-get install chromium)")
    text = "_" * 12 + "\n" + "_" * 4 + " " + "_" * 4  # two lines: the next line's outline must not cover
    column = 200  # the marked copy lies this many pixels right of the plain one, the same otherwise
    page = tmp_path / "underscores.html"
    page.write_text(
        f"<!doctype html><style>{STYLE} div {{ display: flex; }}"
        f"pre {{ flex: none; box-sizing: border-box; width: {column}px; }}</style><div>"
        + "".join(f'<pre class="sample"><span class="{c}">{text}</span></pre>' for c in ("plain", "trained"))
        + "</div>"
    )
    shot = tmp_path / "underscores.png"
    window = ["--window-size=600,160", "--force-device-scale-factor=1"]
    subprocess.run(
        [*BROWSER, *window, f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120
    )
    image = np.asarray(Image.open(shot).convert("RGB"), dtype=int)
    plain, marked = image[:, :column], image[:, column : 2 * column]
    drawn = plain.sum(axis=-1) < 3 * 200  # the underscores' pixels
    rows = np.flatnonzero(drawn.any(axis=1))
    assert drawn.sum() >= 20 * 6 and (np.diff(rows) > 1).sum() == 1  # two lines of underscores
    assert grey(marked[drawn]).all()  # each still drawn, not covered by the outline
    below = np.roll(drawn, 1, axis=0) & ~drawn  # the pixel under each underscore's lowest one
    assert (marked[below].min(axis=-1) > 200).all()  # is the tint, not the outline: apart from it
    assert not (grey(marked) & ~drawn).any()  # the marking adds no grey of its own (an underline would)


def test_inspect_help_is_its_own_and_short(capsys) -> None:
    for flag in ("--help", "-h"):
        main(["inspect", flag])
        out = capsys.readouterr().out
        assert len(out.splitlines()) < 30
        for name in ("--config", "--samples", "--html", "lit-instruct fit --help"):
            assert name in out


def test_inspect_exits_non_zero_on_bad_records(tiny_model_dir, tmp_path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "Hi", "completion": "Yo"}\n{"prompt": "Hi", "completion": 3}\n')
    with pytest.raises(SystemExit) as exited:
        main(args_for(tiny_model_dir, bad, "--data.val_fraction", "0"))
    assert exited.value.code == 2
    assert (
        f"lit-instruct: data error: {bad}:2: field 'completion' must be a string" in capsys.readouterr().err
    )
    with pytest.raises(SystemExit) as exited:
        main(args_for(tiny_model_dir, bad, "--data.val_fraction", "0", "--data.on_bad_record", "skip"))
    assert exited.value.code == 1
    assert "1 records skipped as bad" in capsys.readouterr().err


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_inspect_works_on_every_bundled_config(
    config, tiny_model_dir, smollm2_path, tmp_path, capsys
) -> None:
    """Each config parses and its data section renders (the tiny models share SmolLM2's tokenizer;
    the images config's is a tiny LLaVA)."""
    model = tiny_model_dir
    if config == "vlm.yaml":
        from tests.vision_families import build_vision_family

        model = build_vision_family("llava", smollm2_path, tmp_path / "llava")
    args = ["inspect", "--config", str(ROOT / "configs" / config), "--model.model", str(model)]
    main([*args, "--samples", "1"])
    assert re.search(r"== train / \S+: \d+ samples", capsys.readouterr().out)
