"""Build ``examples/data/preference_sample.jsonl``: preference pairs from the chatterbot corpus.

Each pair is a corpus conversation's first exchange: its question the prompt, its own answer the
chosen one, and the answer of a conversation of another category the rejected one (off topic). The
rejected answers come from conversations whose answers no pair chooses, so that held-out pairs do
not reject what training pairs teach. Deterministic: the same corpus gives the same file.

    python examples/build_preference_sample.py [--pairs 40] [--out examples/data/preference_sample.jsonl]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lit_instruct.data.chatterbot import read_chatterbot

CATEGORIES = ["greetings", "ai", "computers", "food", "science", "sports", "history", "literature"]


def first_exchanges(per_category: int) -> dict[str, list[tuple[str, str]]]:
    """Per category, the (question, answer) of its first conversations with a one-line answer."""
    found: dict[str, list[tuple[str, str]]] = {}
    for category in CATEGORIES:
        rows = []
        for record in read_chatterbot([category]):
            question, answer = record.messages[0].content, record.messages[1].content
            if len(answer) <= 200 and (question, answer) not in rows:
                rows.append((question, answer))
        found[category] = rows[:per_category]
    return found


def pairs(count: int) -> list[dict[str, str]]:
    """``count`` explicit-prompt pairs, the categories taken in turn; the rejected answer is the
    next category's answer at the same place."""
    per_category = -(-count // len(CATEGORIES))
    exchanges = first_exchanges(2 * per_category)  # the first half chosen, the second half rejected
    rows = []
    for index in range(per_category):
        for k, category in enumerate(CATEGORIES):
            other = exchanges[CATEGORIES[(k + 1) % len(CATEGORIES)]][per_category:]
            if index < min(per_category, len(exchanges[category])) and other:
                question, answer = exchanges[category][index]
                rows.append({"prompt": question, "chosen": answer, "rejected": other[index % len(other)][1]})
    return rows[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--out", default=str(Path(__file__).parent / "data" / "preference_sample.jsonl"))
    args = parser.parse_args()
    rows = pairs(args.pairs)
    Path(args.out).write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    print(f"{len(rows)} pairs written to {args.out}")


if __name__ == "__main__":
    main()
