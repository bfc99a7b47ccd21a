"""GGUF round-trip error of the bundled model per storage type: write, load back with transformers
(dequantized), compare logits on a fixed text with the original model's.

    python benchmarks/gguf_round_trip.py [--dir /tmp/lit-instruct-gguf]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_instruct.export.gguf import write_gguf
from lit_instruct.model_names import resolve_model_path

TEXT = "Hello! How are you today? I would like to hear a short story about a river and a mountain."


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", type=Path, default=Path("/tmp/lit-instruct-gguf"))
    args = parser.parse_args()
    path = resolve_model_path("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = model(ids).logits
    scale = float(expected.abs().max())
    print(f"{ids.shape[1]} tokens; |diff| relative to the largest |logit| ({scale:.2f})")
    print("| SmolLM2-135M-Instruct | MiB | max \\|diff\\| | mean \\|diff\\| | top-1 agreement |")
    print("|---|---:|---:|---:|---:|")
    for quant in ("f16", "bf16", "q8_0", "q4_0"):
        folder = args.dir / quant
        written = write_gguf(model, tokenizer, folder / "model.gguf", quant)
        back = AutoModelForCausalLM.from_pretrained(folder, gguf_file=written.name).eval()
        with torch.no_grad():
            got = back(ids).logits
        diff = (got - expected).abs() / scale
        agree = float((got.argmax(-1) == expected.argmax(-1)).float().mean())
        mib = written.stat().st_size / 2**20
        print(f"| {quant} | {mib:.0f} | {float(diff.max()):.1e} | {float(diff.mean()):.1e} | {agree:.3f} |")


if __name__ == "__main__":
    main()
