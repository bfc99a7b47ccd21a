"""Write examples/data/arithmetic.jsonl: two-digit additions and subtractions as prompts with their
answers (the ``answer`` column ``exact_answer`` checks), a small verifiable task for online RL
(``configs/grpo.yaml``). Seeded: the file is the same on every machine.

    python examples/build_arithmetic.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data" / "arithmetic.jsonl"
COUNT = 400
INSTRUCTION = "Give only the final answer, as \\boxed{N}."


def main() -> None:
    rng = random.Random(0)
    rows, seen = [], set()
    while len(rows) < COUNT:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        plus = rng.random() < 0.5
        if not plus and a < b:
            a, b = b, a
        question = f"What is {a} {'+' if plus else '-'} {b}? {INSTRUCTION}"
        if question in seen:
            continue
        seen.add(question)
        rows.append({"prompt": question, "answer": str(a + b if plus else a - b)})
    OUT.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    print(f"wrote {len(rows)} prompts to {OUT}")


if __name__ == "__main__":
    main()
