"""The ``chatterbot-corpus`` package's conversations (BSD licensed) as multi-turn chat records.

Each YAML conversation is a list of utterances that alternate user, assistant, user, ...; a trailing
user utterance has nothing to learn from and is left off (and counted); conversations with an empty
utterance are dropped (and counted).
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import yaml

from lit_instruct.data.records import Message, Record


def corpus_dir(language: str = "english") -> Path:
    """The folder of the installed corpus for ``language``."""
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the chatterbot corpus needs `pip install chatterbot-corpus`")
    folder = Path(spec.origin).parent / "data" / language
    if not folder.is_dir():
        raise FileNotFoundError(f"chatterbot-corpus has no language folder {folder}")
    return folder


def read_chatterbot(
    categories: list[str] | None = None, language: str = "english", counts: Counter[str] | None = None
) -> list[Record]:
    """Read the corpus; ``categories`` are file stems (``greetings``, ``ai``...), ``None`` for all.

    ``counts`` (if given) receives how many conversations were too short and how many trailing user
    turns were left off.
    """
    folder = corpus_dir(language)
    files = sorted(folder.glob("*.yml"))
    known = {f.stem for f in files}
    if categories is not None:
        unknown = sorted(set(categories) - known)
        if unknown:
            raise ValueError(f"unknown chatterbot categories {unknown}; available: {sorted(known)}")
        files = [f for f in files if f.stem in categories]
    counts = counts if counts is not None else Counter()
    records = []
    for path in files:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
        for index, utterances in enumerate(document.get("conversations") or []):
            source = f"{path}[conversation {index}]"
            texts = [str(u).strip() for u in utterances]
            if len(texts) % 2:
                texts = texts[:-1]
                counts["trailing_user_turn_left_off"] += 1
            if not texts:
                counts["too_short"] += 1
                continue
            if not all(texts):
                counts["dropped_empty_utterance"] += 1
                continue
            roles = ("user", "assistant") * (len(texts) // 2)
            records.append(Record(tuple(Message(r, t) for r, t in zip(roles, texts, strict=True)), source))
    return records
