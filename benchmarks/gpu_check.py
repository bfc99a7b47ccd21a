"""One-shot check of the CUDA path, ready for the day a GPU is lent; its CPU parts run anywhere.

    python benchmarks/gpu_check.py            # on a GPU: every part; elsewhere: the CPU parts

Part 1 (CPU and GPU): the fused loss (torch and Triton backends) and the Triton kernel against float64
at the vocabulary sizes of SmolLM2 / Llama 3 / Qwen2 / Gemma (49152, 128256, 151936, 256000), in fp32,
bf16 and fp16, with the label V-1 and a chunk whose rows are all ignored. On CPU the kernel runs
under ``TRITON_INTERPRET=1`` (few rows). Parts that need CUDA print why they were skipped.
Prints one table; exits 1 if any check fails. ``benchmarks/gpu_check.sh`` installs, runs the
CUDA-relevant tests, then this.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch
import torch.nn.functional as F

from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.loss.fused import fused_linear_cross_entropy  # imports triton lazily, at the first call

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel on CPU tensors

VOCABS = (49152, 128256, 151936, 256000)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}  # of the largest entry


def _case(rows: int, hidden: int, vocab: int, dtype: torch.dtype, device: str):
    gen = torch.Generator().manual_seed(vocab)
    h = torch.randn(rows, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) / hidden**0.5
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[0] = vocab - 1  # the last id: the kernel's last, partial block
    labels[rows // 2 :: 3] = IGNORE_INDEX
    return h.to(device, dtype), w.to(device, dtype), labels.to(device)


def _error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def accuracy(device: str) -> list[tuple[str, str, int, str, float, bool]]:
    """(part, backend, V, dtype, worst relative error of loss / grads, ok) for every case."""
    rows_out = []
    backends = ["torch"] + (["triton"] if importlib.util.find_spec("triton") else [])
    rows, hidden = (64, 256) if device == "cuda" else (6, 16)
    for vocab in VOCABS:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            h, w, labels = _case(rows, hidden, vocab, dtype, device)
            hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
            loss = F.cross_entropy(hd @ wd.T, labels, ignore_index=IGNORE_INDEX, reduction="sum")
            expected = [loss.detach(), *torch.autograd.grad(loss, (hd, wd))]
            for backend in backends:
                hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
                ours = fused_linear_cross_entropy(
                    hh, ww, labels, reduction="sum", chunk_size=4, backend=backend
                )
                got = [ours.detach(), *torch.autograd.grad(ours, (hh, ww))]
                error = max(_error(a, b) for a, b in zip(got, expected, strict=True))
                name = str(dtype).removeprefix("torch.")
                rows_out.append(("fused", backend, vocab, name, error, error <= TOLERANCE[dtype]))
            ignored = torch.full_like(labels, IGNORE_INDEX)  # every row ignored: loss 0, zero gradients
            zero = fused_linear_cross_entropy(h, w, ignored, reduction="sum", backend=backends[-1])
            rows_out.append(("all-ignored", backends[-1], vocab, name, float(zero), float(zero) == 0.0))
    return rows_out


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = accuracy(device)
    print(f"{'part':<12} {'backend':<7} {'V':>7} {'dtype':<9} {'error':>9}  ok")
    for part, backend, vocab, dtype, error, ok in results:
        print(f"{part:<12} {backend:<7} {vocab:>7} {dtype:<9} {error:>9.2e}  {'yes' if ok else 'NO'}")
    if device != "cuda":
        print("skipped (no CUDA device): timings against naive / Liger / Cut Cross-Entropy, a chunk over")
        print(
            "2^31 elements, packed attention timing, 15 training steps with fused_ce + bf16-mixed + packing"
        )
    return 0 if all(r[-1] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
