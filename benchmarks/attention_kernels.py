"""CPU attention kernels at a SmolLM2 layer's heads (9 query, 3 KV, dim 64) in bf16: PyTorch's SDPA
against lit-instruct's GEMM path (``lit_instruct.models.gemm_attention``), forward and backward, for
padded training rows and for decoding; the crossover sets ``LONGEST_TRAINING_KEYS``.

    python benchmarks/attention_kernels.py
"""

from __future__ import annotations

import argparse
import time

import torch

from lit_instruct.models.gemm_attention import gemm_attention

HEADS, KV_HEADS, DIM = 9, 3, 64


def timed(function, repeats: int) -> float:
    """The fastest of ``repeats`` calls, in ms."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def case(batch: int, queries: int, keys: int, dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """(SDPA ms, GEMM ms) for forward (and backward where queries > 1) of one left-padded batch."""
    generator = torch.Generator().manual_seed(0)
    train = queries > 1
    q, k, v = (
        torch.randn(batch, h, n, DIM, generator=generator).to(dtype).requires_grad_(train)
        for h, n in ((HEADS, queries), (KV_HEADS, keys), (KV_HEADS, keys))
    )
    starts = torch.randint(0, keys // 3, (batch,), generator=generator)
    allowed = (torch.arange(keys)[None, :] >= starts[:, None])[:, None, None, :]
    allowed = allowed & torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)

    def sdpa() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
        if train:
            out.backward(torch.ones_like(out))

    def gemm() -> None:
        out = gemm_attention(q, k, v, ~allowed, DIM**-0.5)
        if train:
            out.backward(torch.ones_like(out))

    return timed(sdpa, repeats), timed(gemm, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    shapes = [(32, 90, 90), (16, 160, 160), (8, 256, 256), (4, 320, 320), (4, 384, 384), (4, 512, 512)]
    shapes += [(32, 1, 64), (32, 1, 128), (4, 1, 512)]
    print("| batch | queries | keys | dtype | SDPA ms | GEMM ms | GEMM speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for dtype in (torch.bfloat16, torch.float16):
        for batch, queries, keys in shapes:
            sdpa, gemm = case(batch, queries, keys, dtype, args.repeats)
            name = str(dtype).removeprefix("torch.")
            print(f"| {batch} | {queries} | {keys} | {name} | {sdpa:.2f} | {gemm:.2f} | {sdpa / gemm:.2f}x |")


if __name__ == "__main__":
    main()
