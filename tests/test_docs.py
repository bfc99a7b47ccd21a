"""The README and docs/*.md read on their own: every relative link reaches a file, every ``#anchor`` a
heading of its page (GitHub's slugs), and the README stays a front door of at most 400 lines."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_LINES = 400

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
EXTERNAL = re.compile(r"^([a-z][a-z0-9+.-]*:|//)", re.IGNORECASE)


def prose(text: str) -> str:
    """``text`` with fenced code blocks blanked (kept as empty lines, so line counts hold)."""
    lines, fence = [], None
    for line in text.splitlines():
        opened = FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)[0] * len(opened.group(1))
            lines.append("")
        elif fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            lines.append("")
        else:
            lines.append(line)
    return "\n".join(lines)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text as rendered (no markup), lower case, punctuation
    dropped but ``-`` and ``_``, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings; a repeated slug gets ``-1``, ``-2``... as on GitHub."""
    seen: Counter[str] = Counter()
    found = set()
    for line in prose(text).splitlines():
        heading = HEADING.match(line)
        if heading is None:
            continue
        base = slug(heading.group(2))
        found.add(f"{base}-{seen[base]}" if seen[base] else base)
        seen[base] += 1
    return found


def links(text: str) -> list[str]:
    """Every link target in the page's prose: inline links and images, and reference definitions."""
    body = INLINE_CODE.sub(lambda m: " " * len(m.group(0)), prose(text))
    return [m.group(1) for m in LINK.finditer(body)] + REFERENCE.findall(body)


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` that reaches no file, or no heading of the page it names."""
    broken = []
    for target in links(page.read_text()):
        if EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_the_readme_is_a_front_door() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines; move a topic to docs/"


def test_every_docs_page_is_linked_from_the_readme_and_links_back() -> None:
    readme = set(links((ROOT / "README.md").read_text()))
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme, page.name
        assert "../README.md" in links(page.read_text()), page.name


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Past one device's memory: FSDP2 (`fsdp_lora`)", "past-one-devices-memory-fsdp2-fsdp_lora"),
        ("Data setup: 100,000 samples, cached", "data-setup-100000-samples-cached"),
        ("What `make demo` shows", "what-make-demo-shows"),
        ("To llama.cpp, Ollama and LM Studio: GGUF", "to-llamacpp-ollama-and-lm-studio-gguf"),
        ("bf16 vs fp32, ours and TRL's (2-core CPU)", "bf16-vs-fp32-ours-and-trls-2-core-cpu"),
        ("A [linked](x.md) **bold** heading", "a-linked-bold-heading"),
    ],
)
def test_slugs_are_githubs(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_the_checker_finds_broken_links_and_anchors(tmp_path: Path) -> None:
    """A made-up page: the checker must see through code, duplicates and images, and fail the bad."""
    (tmp_path / "other.md").write_text("# Other page\n\n## Setup\n\n## Setup\n")
    (tmp_path / "picture.png").write_bytes(b"")
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n"
        "```bash\n# not a heading\n[not a link](missing-in-code.md)\n```\n\n"
        "Good: [other](other.md), [its setup](other.md#setup), [the second](other.md#setup-1),\n"
        "[this page](#title), ![a picture](picture.png), [web](https://example.com/x.md),\n"
        "`[code](missing-in-inline-code.md)`, and a link whose text\n[spans lines](#title).\n\n"
        "Bad: [no file](missing.md), [no heading](other.md#install), [a heading in code](#not-a-heading),\n"
        "[a third Setup](other.md#setup-2), ![no picture](gone.png).\n\n"
        "[ref]: nowhere.md\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#install: no heading #install in other.md",
        "#not-a-heading: no heading #not-a-heading in page.md",
        "other.md#setup-2: no heading #setup-2 in other.md",
        "gone.png: no such file",
        "nowhere.md: no such file",
    ]
