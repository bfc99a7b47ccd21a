"""Our GGUF files in real llama.cpp: each family loads, tokenizes as the Hugging Face tokenizer does, and
gives the logits of ``transformers`` (tiny random models of ``tests/test_gguf_reference.py``, f32).

llama.cpp is not a dependency: build ``llama-cpp-python`` once in a separate environment (about 30 min
on 2 cores), then run the two halves:

    python benchmarks/llama_cpp_check.py prepare out/llama-cpp-check          # this venv: files + references
    /path/to/llama-venv/bin/python benchmarks/llama_cpp_check.py check out/llama-cpp-check
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TEXTS = [
    "Hello world",
    "def f(x):\n    return x  +  1  # spaces   and\ttabs",
    "naïve café — “quotes” 123,456.789",
    "日本語のテキストと中文 😀🚀",
    "   leading spaces and trailing   ",
]
"""Tokenizer checks: code, runs of spaces, accents, CJK, emoji (byte fallback in SentencePiece)."""
PROMPT = "def generate(self, inputs):\n    return self.model(inputs)"


def prepare(folder: Path) -> None:
    """Write each family's f32 GGUF, its tokenizations of :data:`TEXTS` and its logits on :data:`PROMPT`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_instruct.export.gguf import write_gguf
    from lit_instruct.model_names import resolve_model_path
    from tests.test_gguf_reference import FAMILIES, tiny_model

    smollm2 = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))
    for name, (_, _, _, style) in FAMILIES.items():
        model_dir = tiny_model(name, smollm2, folder / name)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # llama.cpp sets Phi-3's special-token attributes by general.name, expecting its markers
        label = "phi-4" if name == "phi3" else name  # (the Phi-4 layout here has SmolLM2's vocabulary)
        pre = None if style else "smollm"
        write_gguf(model, tokenizer, folder / f"{name}.gguf", "f32", tokenizer_pre=pre, name=label)
        # a reloaded SmolLM2 tokenizer takes the family's class in transformers 5: the original encodes
        encoder = tokenizer if style else smollm2
        ids = encoder(PROMPT).input_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        spm = None
        if style:  # SentencePiece's own encoding, the BOS the tokenizer adds in front
            import sentencepiece

            spm = sentencepiece.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
        reference = {
            "tokens": {text: encoder(text).input_ids for text in TEXTS},
            "sentencepiece": {t: [tokenizer.bos_token_id, *spm.encode(t)] for t in TEXTS} if spm else {},
            "prompt": ids,
            "logits": logits.tolist(),
        }
        (folder / f"{name}.json").write_text(json.dumps(reference))
        print(f"{name}: written", flush=True)


def check(folder: Path) -> None:
    """Load each GGUF in llama.cpp; compare its tokenizations and logits with the references."""
    import numpy as np
    from llama_cpp import Llama

    print(
        "| family | loads | tokens = HF | = SentencePiece | max \\|logit diff\\| / max \\|logit\\| | top-1 |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for path in sorted(folder.glob("*.gguf")):
        reference = json.loads(path.with_suffix(".json").read_text())
        try:
            llm = Llama(str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2)
        except Exception as error:  # the row says why
            print(f"| {path.stem} | no: {error} | | | | |")
            continue

        def agreeing(expected: dict[str, list[int]], llm: Llama = llm) -> str:
            same = sum(llm.tokenize(t.encode(), add_bos=True) == i for t, i in expected.items())
            return f"{same}/{len(expected)}" if expected else "-"

        llm.reset()
        llm.eval(reference["prompt"])
        ours = np.array(llm.scores[: len(reference["prompt"])], dtype=np.float64)
        theirs = np.array(reference["logits"], dtype=np.float64)
        diff = np.abs(ours - theirs).max() / np.abs(theirs).max()
        top1 = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
        tokens = f"{agreeing(reference['tokens'])} | {agreeing(reference['sentencepiece'])}"
        print(f"| {path.stem} | yes | {tokens} | {diff:.1e} | {top1:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("step", choices=["prepare", "check"])
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    prepare(args.folder) if args.step == "prepare" else check(args.folder)


if __name__ == "__main__":
    main()
