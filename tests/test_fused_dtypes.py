"""The CUDA path's dtype and bounds rules, exercised on CPU: bf16 autocast, mixed dtypes, label
bounds and all -inf vocabulary blocks (Triton under the interpreter)."""

from __future__ import annotations

import importlib.util
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.loss.fused import fused_linear_cross_entropy
from lit_instruct.loss.reference import reference_linear_cross_entropy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton: CUDA, else the interpreter
NO_TRITON = importlib.util.find_spec("triton") is None
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(NO_TRITON, reason="triton not installed")),
]
# Errors against float64, relative to each tensor's largest entry (Liger-style per-dtype table):
# fp32 GEMMs round at 1e-7; bf16 GEMMs round logits and gradients to 8 mantissa bits.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def confident_case(n: int = 48, h: int = 32, v: int = 700, seed: int = 0):
    """Hidden states that predict their labels with probability near 1 (where a bf16
    ``exp @ W / total - W[y]`` shortcut cancels catastrophically)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(v, h, generator=gen) / h**0.5
    labels = torch.randint(0, v, (n,), generator=gen)
    hidden = 6.0 * weight[labels] + 0.3 * torch.randn(n, h, generator=gen)
    labels[::5] = IGNORE_INDEX
    return hidden.to(DEVICE), weight.to(DEVICE), labels.to(DEVICE)


def float64_reference(hidden, weight, labels):
    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    loss = F.cross_entropy(h @ w.T, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return [loss.detach(), *torch.autograd.grad(loss, (h, w))]


def loss_and_grads(fn, hidden, weight, labels, autocast: bool):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        loss = fn(h, w, labels)
    return [loss.detach(), *torch.autograd.grad(loss, (h, w))]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("backend", BACKENDS)
def test_under_bf16_autocast_the_gemms_run_in_bf16_within_bf16_tolerance(backend) -> None:
    """Autocast's dtype for the GEMMs (as the reference gets), fp32 statistics and gradient dtypes
    as the inputs', and at most twice the error of the reference loss under the same autocast."""
    hidden, weight, labels = confident_case()
    fused = partial(fused_linear_cross_entropy, reduction="sum", chunk_size=16, backend=backend)
    reference = partial(reference_linear_cross_entropy, reduction="sum")
    exact = float64_reference(hidden, weight, labels)
    ours = loss_and_grads(fused, hidden, weight, labels, autocast=True)
    theirs = loss_and_grads(reference, hidden, weight, labels, autocast=True)
    fp32 = loss_and_grads(fused, hidden, weight, labels, autocast=False)
    assert [t.dtype for t in ours] == [torch.float32] * 3  # gradients in the inputs' dtype
    for name, a, b, e, f in zip(
        ("loss", "grad_hidden", "grad_weight"), ours, theirs, exact, fp32, strict=True
    ):
        error = relative_error(a, e)
        assert error <= TOLERANCE[torch.bfloat16], (name, error)
        assert error <= 2 * relative_error(b, e) + 1e-6, (name, error, relative_error(b, e))
        assert relative_error(f, e) <= TOLERANCE[torch.float32], name
    assert not torch.equal(ours[1], fp32[1])  # the GEMMs really ran in bf16


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_hidden_with_an_fp32_weight_computes_in_fp32(backend) -> None:
    hidden, weight, labels = confident_case(seed=1)
    hidden = hidden.to(torch.bfloat16)
    exact = float64_reference(hidden, weight, labels)
    fused = partial(fused_linear_cross_entropy, reduction="sum", chunk_size=16, backend=backend)
    ours = loss_and_grads(fused, hidden, weight, labels, autocast=False)
    assert ours[1].dtype == torch.bfloat16 and ours[2].dtype == torch.float32
    assert relative_error(ours[0], exact[0]) <= TOLERANCE[torch.float32]
    assert relative_error(ours[2], exact[2]) <= TOLERANCE[torch.float32]
    assert relative_error(ours[1], exact[1]) <= TOLERANCE[torch.bfloat16]  # rounded to bf16 on return


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("label", [700, 7000, -5])
def test_a_label_outside_the_vocabulary_is_a_clear_error(backend, label) -> None:
    hidden, weight, labels = confident_case(seed=2)
    labels[3] = label
    with pytest.raises(ValueError, match=rf"label {label} is outside the vocabulary \[0, 700\)"):
        fused_linear_cross_entropy(hidden, weight, labels, backend=backend)


def test_the_kernel_checks_labels_and_survives_an_all_minus_inf_block() -> None:
    pytest.importorskip("triton")
    from lit_instruct.loss.triton_ce import ce_grad_inplace_triton

    gen = torch.Generator().manual_seed(3)
    logits = 2 * torch.randn(4, 600, generator=gen, dtype=torch.float64)
    logits[1, :256] = float("-inf")  # row 1's whole first block (BLOCK=256) is -inf
    logits[2, 256:512] = float("-inf")
    targets = torch.tensor([5, 300, 10, IGNORE_INDEX])
    expected = logits.clone().requires_grad_()
    expected_loss = F.cross_entropy(expected, targets, ignore_index=IGNORE_INDEX, reduction="none")
    expected_loss.sum().backward()
    buffer = logits.float().to(DEVICE)
    loss = ce_grad_inplace_triton(buffer, targets.to(DEVICE), block=256).cpu()
    assert loss.isfinite().all()
    torch.testing.assert_close(loss.double(), expected_loss.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(buffer.cpu().double(), expected.grad, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match=r"label 600 is outside the vocabulary \[0, 600\)"):
        ce_grad_inplace_triton(logits.float().to(DEVICE), torch.tensor([0, 600, 1, 2]).to(DEVICE))


@pytest.mark.slow
def test_the_gpu_check_passes_its_cpu_parts() -> None:
    """``benchmarks/gpu_check.py`` (what a lent GPU runs) in its CPU mode: float64 checks at the
    vocabulary sizes of four families in three dtypes, both backends."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.endswith((" yes", " NO"))]
    backends = 1 if NO_TRITON else 2
    assert len(rows) == 4 * 3 * (backends + 1) and all(row.endswith(" yes") for row in rows)
