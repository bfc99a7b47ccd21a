"""Write examples/data/shapes/: small PNGs of coloured shapes and shapes.jsonl, a question about each
with its description as the answer (``configs/vlm.yaml``, the images demo). Seeded and drawn pixel by
pixel: the files are the same on every machine.

    python examples/build_shapes.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data" / "shapes"
SIZE = 56
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 60, 220),
    "yellow": (235, 210, 30),
    "purple": (140, 40, 170),
    "orange": (245, 140, 20),
}
SHAPES = ("circle", "square", "triangle", "cross")
QUESTIONS = (
    "What is in this picture?",
    "Describe the image.",
    "What shape and colour do you see?",
    "What does this show?",
)
BACKGROUNDS = ((255, 255, 255), (235, 235, 235))


def article(word: str) -> str:
    return "An" if word[0] in "aeiou" else "A"


def inside(shape: str, x: float, y: float) -> bool:
    """Whether the point ``(x, y)`` (the shape's centre at 0, its half-size 1) is in ``shape``."""
    if shape == "circle":
        return x * x + y * y <= 1.0
    if shape == "square":
        return abs(x) <= 0.8 and abs(y) <= 0.8
    if shape == "triangle":
        return -0.9 <= y <= 0.9 and abs(x) <= (y + 0.9) / 1.8
    return (abs(x) <= 0.3 and abs(y) <= 1.0) or (abs(y) <= 0.3 and abs(x) <= 1.0)


def draw(shape: str, colour: tuple[int, int, int], background: tuple[int, int, int], rng: random.Random):
    from PIL import Image

    image = Image.new("RGB", (SIZE, SIZE), background)
    half = rng.randint(13, 20)
    cx, cy = rng.randint(half + 2, SIZE - half - 3), rng.randint(half + 2, SIZE - half - 3)
    for py in range(SIZE):
        for px in range(SIZE):
            if inside(shape, (px - cx) / half, (py - cy) / half):
                image.putpixel((px, py), colour)
    return image


def main() -> None:
    rng = random.Random(0)
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    for colour, rgb in COLOURS.items():
        for shape in SHAPES:
            for variant, background in enumerate(BACKGROUNDS):
                name = f"{colour}-{shape}-{variant}.png"
                draw(shape, rgb, background, rng).save(OUT / name, optimize=True)
                question = rng.choice(QUESTIONS)
                rows.append(
                    {
                        "messages": [
                            {
                                "role": "user",
                                "content": [
                                    {"type": "image", "image": name},
                                    {"type": "text", "text": question},
                                ],
                            },
                            {"role": "assistant", "content": f"{article(colour)} {colour} {shape}."},
                        ]
                    }
                )
    rng.shuffle(rows)
    (OUT / "shapes.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{len(rows)} images and {OUT / 'shapes.jsonl'}")


if __name__ == "__main__":
    main()
