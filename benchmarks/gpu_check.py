"""One-shot check of the CUDA path, ready for the day a GPU is lent; its CPU parts run anywhere.

    python benchmarks/gpu_check.py            # on a GPU: every part; elsewhere: the CPU parts

Part 1 (CPU and GPU): the fused loss (torch and Triton backends) and the Triton kernel against float64
at the vocabulary sizes of SmolLM2 / Llama 3 / Qwen2 / Gemma (49152, 128256, 151936, 256000), in fp32,
bf16 and fp16, with the label V-1 and a chunk whose rows are all ignored. On CPU the kernel runs
under ``TRITON_INTERPRET=1`` (few rows). Part 2 (GPU): timings against naive / Liger / Cut
Cross-Entropy, a chunk over 2^31 logits, packed varlen attention, a tiny MoE with LoRA on its expert
weights under bf16 (loss equal to the model's own), and the shipped configs trained a few steps on the
GPU (``precision: auto`` must pick bf16 from compute capability 8.0; packed one_device with and without
NF4; DoRA + LoRA+; base-to-chat growing the vocabulary; GRPO sampling on the GPU), the bf16-trained
adapter then exported as one GGUF file and as a GGUF LoRA. Parts that need CUDA print why they were skipped.
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


def _timed(fn, *args) -> tuple[float, float]:
    """(ms per forward + backward, peak MB above the inputs) on CUDA, best of 3 after a warmup."""
    fn(*args)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return min(times), (torch.cuda.max_memory_allocated() - base) / 2**20


def loss_timings() -> list[str]:
    """naive / ours / Liger / Cut Cross-Entropy at N=16384, H=4096, V=128256 in bf16 (frozen head),
    each with its loss compared to ours."""
    n, h, v = 16384, 4096, 128256
    hidden, weight, labels = _case(n, h, v, torch.bfloat16, "cuda")
    hidden.requires_grad_()

    def run(loss_fn):
        def step():
            hidden.grad = None
            loss = loss_fn()
            loss.backward()
            return float(loss)

        return step

    peers = {
        "naive": lambda: F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=IGNORE_INDEX),
        "ours": lambda: fused_linear_cross_entropy(hidden, weight, labels, backend="triton"),
    }
    if importlib.util.find_spec("liger_kernel"):
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
        peers["liger"] = lambda: liger(weight, hidden, labels)
    if importlib.util.find_spec("cut_cross_entropy"):
        from cut_cross_entropy import linear_cross_entropy

        peers["cce"] = lambda: linear_cross_entropy(hidden, weight, labels, ignore_index=IGNORE_INDEX)
    lines, reference = [], None
    for name, fn in peers.items():
        loss = run(fn)()
        reference = loss if name == "ours" else reference
        ms, mb = _timed(run(fn))
        lines.append(f"loss  {name:<6} {ms:8.1f} ms {mb:9.0f} MB peak  loss {loss:.5f}")
    missing = {"liger", "cce"} - peers.keys()
    if missing:
        lines.append(f"loss  not installed: {', '.join(sorted(missing))}")
    return lines


def big_chunk() -> tuple[str, bool]:
    """One Triton chunk of more than 2^31 logits (int64 offsets) against the torch backend in fp32."""
    n, h, v = 17000, 64, 128256  # 17000 * 128256 = 2.18e9 > 2^31
    hidden, weight, labels = _case(n, h, v, torch.bfloat16, "cuda")
    ours = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=n, backend="triton")
    reference = fused_linear_cross_entropy(
        hidden.float(), weight.float(), labels, chunk_size=1024, backend="torch"
    )
    error = abs(float(ours) - float(reference)) / abs(float(reference))
    return f"chunk of {n * v / 2**31:.2f} x 2^31 logits: relative loss error {error:.2e}", error < 1e-2


def attention_timings() -> tuple[list[str], bool]:
    """64 packed samples of 512 tokens (32 query / 8 kv heads, head dim 128, bf16): the per-sample loop,
    one varlen call, one SDPA call with a block-diagonal mask; forward + backward."""
    from lit_instruct import packing

    segments = tuple(range(0, 64 * 512 + 1, 512))
    total = segments[-1]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(1, heads, total, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        for heads in (32, 8, 8)
    )

    class Layer(torch.nn.Module):
        is_causal, num_key_value_groups = True, 4

    attend, layer = packing.packed_attention("sdpa"), Layer()

    def loop():
        saved = set(packing.VARLEN_DEVICES)
        packing.VARLEN_DEVICES.clear()
        try:
            out = attend(layer, q, k, v, None, packed_segments=segments, scaling=128**-0.5)[0]
        finally:
            packing.VARLEN_DEVICES.update(saved)
        out.float().sum().backward()
        return out

    def varlen():
        out = attend(layer, q, k, v, None, packed_segments=segments, scaling=128**-0.5)[0]
        out.float().sum().backward()
        return out

    document = torch.repeat_interleave(torch.arange(64, device="cuda"), 512)
    position = torch.arange(total, device="cuda")
    mask = (document[:, None] == document[None, :]) & (position[:, None] >= position[None, :])

    def masked():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=128**-0.5, enable_gqa=True)
        out.transpose(1, 2).float().sum().backward()
        return out.transpose(1, 2)

    lines, outputs = [], {}
    for name, fn in {"loop": loop, "varlen": varlen, "masked": masked}.items():
        outputs[name] = fn().detach()
        ms, mb = _timed(fn)
        lines.append(f"attention {name:<7} {ms:8.1f} ms {mb:9.0f} MB peak")
    error = float((outputs["varlen"].float() - outputs["loop"].float()).abs().max())
    lines.append(f"attention varlen vs loop: max |diff| {error:.2e}")
    return lines, error < 2e-2


def _fit(name: str, config: str, root: str, steps: int, *extra: str) -> tuple[str, bool, str]:
    """``lit-instruct fit`` of ``config`` on the GPU for ``steps`` steps into ``root``; (line, ok, stderr)."""
    import subprocess
    import time

    command = [
        sys.executable,
        "-m",
        "lit_instruct",
        "fit",
        "--config",
        config,
        "--trainer.accelerator",
        "gpu",
    ]
    command += ["--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(steps)]
    command += [
        "--trainer.logger",
        "false",
        "--trainer.default_root_dir",
        root,
        "--validate_before_fit",
        "false",
    ]
    command += ["--trainer.callbacks", "null", "--model.adapter_dir", f"{root}/adapter", *extra]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    ok = done.returncode == 0 and "fit done" in done.stderr
    last = (done.stderr.strip().splitlines() or [""])[-1][:200]
    return f"{name}: rc={done.returncode} {seconds:.0f} s" + ("" if ok else f" | {last}"), ok, done.stderr


def training(root: str) -> list[tuple[str, bool]]:
    """The shipped configs on the GPU, a few steps each: ``precision: auto`` must choose bf16 on
    compute capability >= 8 (and say so), packed one_device with and without NF4, DoRA + LoRA+, the
    base-to-chat run that grows the vocabulary, GRPO's config; then GGUF exports of the bf16-trained
    adapter."""
    import subprocess

    checks = []
    line, ok, err = _fit(
        "quickstart, precision auto, packed",
        "configs/quickstart.yaml",
        f"{root}/q",
        15,
        "--data.packing",
        "true",
    )
    native = torch.cuda.get_device_capability() >= (8, 0)
    chose = ("precision: bf16-mixed" if native else "precision: 32-true") in err
    checks.append((f"{line}; auto chose {'bf16' if native else 'fp32'}", ok and chose))
    line, ok, _ = _fit(
        "NF4 packed one_device",
        "configs/quickstart.yaml",
        f"{root}/nf4",
        10,
        "--data.packing",
        "true",
        "--model.quantization.method",
        "nf4",
    )
    checks.append((line, ok))
    dora = ("--data.train_files", "[examples/data/alpaca_sample.jsonl]")
    checks.append(_fit("DoRA + LoRA+", "configs/dora.yaml", f"{root}/dora", 6, *dora)[:2])
    checks.append(_fit("base-to-chat (new tokens)", "configs/base-to-chat.yaml", f"{root}/b2c", 6)[:2])
    checks.append(
        _fit("GRPO (configs/grpo.yaml: sampled on the GPU)", "configs/grpo.yaml", f"{root}/grpo", 4)[:2]
    )
    for flag, out in (("--gguf", f"{root}/q.gguf"), ("--gguf-adapter", f"{root}/q-lora.gguf")):
        command = [
            sys.executable,
            "-m",
            "lit_instruct",
            "export",
            "--adapter",
            f"{root}/q/adapter",
            "--out",
            out,
            flag,
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        checks.append(
            (f"export {flag} of the GPU-trained adapter: rc={done.returncode}", done.returncode == 0)
        )
    return checks


def moe_by_weight() -> tuple[str, bool]:
    """A tiny Qwen3-MoE on the GPU under bf16 autocast, LoRA on its expert weights (by weight): the
    step's loss equals the model's own ``forward(labels=...)`` under the same autocast (2e-2)."""
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from lit_instruct.data.collate import PadCollator
    from lit_instruct.models.lora import LoRAConfig
    from lit_instruct.train.module import InstructLoRAModule
    from tests.families import build_family
    from tests.test_families import VOCAB, our_loss, own_loss, samples

    with tempfile.TemporaryDirectory() as folder:
        path = build_family("qwen3_moe", VOCAB, Path(folder) / "moe")
        module = InstructLoRAModule(model=str(path), lora=LoRAConfig(r=4, alpha=8), dtype="bfloat16").cuda()
    experts = module.model.lora_coverage.line()
    batch = {k: v.cuda() for k, v in PadCollator(0)(samples()).items()}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours, theirs = float(our_loss(module, batch)), float(own_loss(module, batch))
    ok = abs(ours - theirs) <= 2e-2 * abs(theirs) and "expert weights" in experts
    return f"MoE by weight on CUDA bf16: loss {ours:.4f} vs own {theirs:.4f}; {experts}", ok


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = accuracy(device)
    print(f"{'part':<12} {'backend':<7} {'V':>7} {'dtype':<9} {'error':>9}  ok")
    for part, backend, vocab, dtype, error, ok in results:
        print(f"{part:<12} {backend:<7} {vocab:>7} {dtype:<9} {error:>9.2e}  {'yes' if ok else 'NO'}")
    passed = all(r[-1] for r in results)
    if device != "cuda":
        print("skipped (no CUDA device): timings against naive / Liger / Cut Cross-Entropy, a chunk over")
        print(
            "2^31 logits, packed attention timings, the shipped configs trained and exported, MoE by weight"
        )
        return 0 if passed else 1
    print("\n".join(loss_timings()))
    checks = [big_chunk()]
    lines, ok = attention_timings()
    print("\n".join(lines))
    checks += [("packed attention: varlen equals the per-sample loop", ok), moe_by_weight()]
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        checks += training(root)
    for line, ok in checks:
        print(f"{line}  {'yes' if ok else 'NO'}")
    return 0 if passed and all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
