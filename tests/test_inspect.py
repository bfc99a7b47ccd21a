"""``lit-instruct inspect``: the data as ``fit`` would train on it, the trained tokens marked, on the
terminal and in an HTML page checked in a real headless browser (Debian's chromium)."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from lit_instruct.cli import main
from lit_instruct.data.datamodule import InstructDataModule
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


def trained_texts(tiny_model_dir: Path, data: Path) -> dict[str, str]:
    """Each training sample's labelled tokens, decoded: what must be marked."""
    module = InstructDataModule(
        tokenizer=str(tiny_model_dir), train_files=[str(data)], val_fraction=0.15, cache=False
    )
    module.setup("fit")
    tokenizer = module.tokenizer
    return {
        s.source: tokenizer.decode(
            [t for t, label in zip(s.input_ids, s.labels, strict=True) if label != IGNORE_INDEX]
        )
        for s in module.train_samples
    }


def test_inspect_marks_exactly_the_trained_tokens(tiny_model_dir, chat_file, tmp_path, capsys) -> None:
    main(args_for(tiny_model_dir, chat_file, "--samples", "50"))
    out = capsys.readouterr().out
    assert re.search(r"== train / chat: \d+ samples, tokens min \d+ / median \d+ / p95 \d+ / max \d+", out)
    expected = trained_texts(tiny_model_dir, chat_file)
    shown = re.findall(r"-- sample \d+ \((.+?), \d+ tokens\)\n(.*?)(?=\n-- sample|\n== |\Z)", out, re.DOTALL)
    train_shown = dict(shown[: len(expected)])
    assert train_shown.keys() == expected.keys()
    for origin, text in train_shown.items():  # piped: trained runs in [[ ]]
        assert "".join(re.findall(r"\[\[(.*?)\]\]", text, re.DOTALL)) == expected[origin]


class Spans(HTMLParser):
    """The trained spans' text per sample of a browser's DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.samples: dict[str, str] = {}
        self.origin: str | None = None
        self.depth = 0  # inside a trained span: count nested spans

    def handle_starttag(self, tag, attrs) -> None:
        attributes = dict(attrs)
        if tag == "pre" and attributes.get("class") == "sample":
            self.origin = attributes["data-origin"]
            self.samples.setdefault(self.origin, "")
        elif tag == "span" and (self.depth or attributes.get("class") == "trained"):
            self.depth += 1

    def handle_endtag(self, tag) -> None:
        if tag == "span" and self.depth:
            self.depth -= 1
        elif tag == "pre":
            self.origin = None

    def handle_data(self, data) -> None:
        if self.origin is not None and self.depth:
            self.samples[self.origin] += data


def test_the_html_report_marks_the_labels_in_a_real_browser(tiny_model_dir, chat_file, tmp_path) -> None:
    if shutil.which("chromium") is None:
        require_or_skip("needs Debian's chromium (apt-get install chromium)")
    page = tmp_path / "report.html"
    main(args_for(tiny_model_dir, chat_file, "--samples", "50", "--html", str(page)))
    browser = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    dom = subprocess.run([*browser, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    spans = Spans()
    spans.feed(dom.stdout)
    expected = trained_texts(tiny_model_dir, chat_file)
    assert {k: v for k, v in spans.samples.items() if k in expected} == expected
    assert dom.stdout.count('class="source"') == 2  # train and val
    shot = tmp_path / "report.png"
    subprocess.run(
        [*browser, "--window-size=1000,800", f"--screenshot={shot}", page.as_uri()],
        capture_output=True,
        timeout=120,
    )
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


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
def test_inspect_works_on_every_bundled_config(config, tiny_model_dir, capsys) -> None:
    """Each config parses and its data section renders (the tiny model shares SmolLM2's tokenizer)."""
    args = ["inspect", "--config", str(ROOT / "configs" / config), "--model.model", str(tiny_model_dir)]
    main([*args, "--samples", "1"])
    assert re.search(r"== train / \S+: \d+ samples", capsys.readouterr().out)
