"""The fused linear cross-entropy (torch and Triton backends) against the reference and plain CE."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.loss.fused import fused_linear_cross_entropy
from lit_instruct.loss.logits import LogitTransform
from lit_instruct.loss.reference import reference_linear_cross_entropy

# bf16: logits are rounded to bf16 before the fp32 softmax in both implementations, and grad_hidden
# is produced in bf16, so agreement is to bf16 resolution (~3 significant digits).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton: CUDA, else the interpreter
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_case(n: int, h: int, v: int, ignored: float, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).to(dtype)
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < ignored] = IGNORE_INDEX
    return hidden, weight, labels


def loss_and_grads(fn, hidden, weight, labels, **kwargs):
    hidden = hidden.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    loss = fn(hidden, weight, labels, **kwargs)
    loss.backward()
    return loss, hidden.grad, weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(
    ("n", "h", "v", "ignored", "chunk"),
    [(64, 32, 1000, 0.0, 16), (97, 48, 777, 0.5, 13), (33, 16, 501, 0.9, None), (8, 16, 300, 1.0, 3)],
)
def test_fused_equals_reference_and_plain_cross_entropy(n, h, v, ignored, chunk, reduction, dtype) -> None:
    hidden, weight, labels = make_case(n, h, v, ignored, dtype, seed=n + v)
    ours = loss_and_grads(
        fused_linear_cross_entropy,
        hidden,
        weight,
        labels,
        reduction=reduction,
        chunk_size=chunk,
        backend="torch",
    )
    ref = loss_and_grads(reference_linear_cross_entropy, hidden, weight, labels, reduction=reduction)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.float(), b.float(), **TOLERANCES[dtype])
    if (labels != IGNORE_INDEX).any() and dtype == torch.float32:
        plain = loss_and_grads(
            lambda hd, w, y, **_: F.cross_entropy(
                hd @ w.T, y, ignore_index=IGNORE_INDEX, reduction=reduction
            ),
            hidden,
            weight,
            labels,
        )
        for a, b in zip(ours, plain, strict=True):
            torch.testing.assert_close(a, b, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_frozen_weight_gets_no_gradient_and_no_grad_mode_works(dtype) -> None:
    hidden, weight, labels = make_case(70, 8, 50, 0.3, dtype, seed=1)
    hidden[:10] *= 8  # confident, correct predictions: softmax - one_hot is tiny there
    labels[:10] = (hidden[:10].float() @ weight.float().T).argmax(dim=1)
    hidden.requires_grad_()
    loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=7)
    loss.backward()
    assert weight.grad is None
    expected = hidden.detach().clone().requires_grad_()
    reference_linear_cross_entropy(expected, weight, labels).backward()
    torch.testing.assert_close(hidden.grad.float(), expected.grad.float(), **TOLERANCES[dtype])
    with torch.no_grad():
        torch.testing.assert_close(
            fused_linear_cross_entropy(hidden, weight, labels),
            reference_linear_cross_entropy(hidden, weight, labels),
        )


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="expected hidden"):
        fused_linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(5, dtype=torch.long))


@pytest.fixture
def interpreted_triton():
    """The Triton module; on a machine without CUDA, conftest set ``TRITON_INTERPRET=1``."""
    pytest.importorskip("triton")
    from lit_instruct.loss import triton_ce

    return triton_ce


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_kernel_writes_loss_and_gradient_in_place(interpreted_triton, dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(7, 1100, generator=gen)).to(dtype)  # vocab not a multiple of the block
    targets = torch.randint(0, 1100, (7,), generator=gen)
    targets[[2, 5]] = IGNORE_INDEX
    expected = logits.float().requires_grad_()
    expected_loss = F.cross_entropy(expected, targets, ignore_index=IGNORE_INDEX, reduction="none")
    expected_loss.sum().backward()

    buffer = logits.to(DEVICE)
    loss = interpreted_triton.ce_grad_inplace_triton(buffer, targets.to(DEVICE), block=256).cpu()
    buffer = buffer.cpu()
    torch.testing.assert_close(loss, expected_loss.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(buffer.float(), expected.grad, **TOLERANCES[dtype])
    assert torch.equal(buffer[[2, 5]], torch.zeros_like(buffer[[2, 5]]))


def test_fused_with_triton_backend_equals_reference(interpreted_triton) -> None:
    case = [t.to(DEVICE) for t in make_case(24, 16, 333, 0.4, torch.float32, seed=3)]
    ours = loss_and_grads(fused_linear_cross_entropy, *case, chunk_size=5, backend="triton")
    ref = loss_and_grads(reference_linear_cross_entropy, *case)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    "transform",
    [LogitTransform(scale=0.25), LogitTransform(softcap=1.5), LogitTransform(scale=2.0, softcap=3.0)],
    ids=["scale", "softcap", "scale+softcap"],
)
def test_bias_and_logit_transform_equal_float64_cross_entropy(backend, transform) -> None:
    """Every gradient, the trainable bias's included, against autograd through the materialized,
    transformed float64 logits."""
    if backend == "triton":
        pytest.importorskip("triton")
    hidden, weight, labels = (t.to(DEVICE) for t in make_case(41, 16, 300, 0.3, torch.float32, seed=7))
    bias = torch.randn(300, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    assert_fused_equals_float64(hidden, weight, bias, labels, transform, chunk_size=7, backend=backend)


def assert_fused_equals_float64(hidden, weight, bias, labels, transform, **options) -> None:
    """The fused loss (fp32) and its gradients for hidden, weight and bias against autograd through
    the materialized, transformed float64 logits."""

    def grads(fn, dtype):
        leaves = [t.to(dtype).clone().requires_grad_() for t in (hidden, weight, bias)]
        loss = fn(*leaves)
        return [loss, *torch.autograd.grad(loss, leaves)]

    ours = grads(
        lambda h, w, b: fused_linear_cross_entropy(
            h, w, labels, bias=b, transform=transform, reduction="sum", **options
        ),
        torch.float32,
    )
    plain = grads(
        lambda h, w, b: F.cross_entropy(
            transform(h @ w.T + b), labels, ignore_index=IGNORE_INDEX, reduction="sum"
        ),
        torch.float64,
    )
    for a, b in zip(ours, plain, strict=True):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    "transform", [LogitTransform(), LogitTransform(softcap=1.5)], ids=["plain", "softcap"]
)
@pytest.mark.parametrize("chunk", [None, 128])
def test_chunks_padded_to_a_multiple_of_64_rows_equal_float64_cross_entropy(chunk, transform) -> None:
    """A ragged chunk (here all 211 counted rows, or the last 83 after a chunk of 128) runs padded with
    zero rows to a multiple of 64 when the workspace has room: the padding adds nothing to the loss
    or any gradient (the bias's included)."""
    hidden, weight, labels = make_case(300, 16, 300, 0.3, torch.float32, seed=5)
    assert int((labels != IGNORE_INDEX).sum()) % 64
    bias = torch.randn(300, generator=torch.Generator().manual_seed(6))
    assert_fused_equals_float64(hidden, weight, bias, labels, transform, chunk_size=chunk, backend="torch")


@pytest.mark.parametrize("ignore_index", [-1, 7], ids=["negative", "a-vocabulary-id"])
@pytest.mark.parametrize("implementation", ["reference", "torch", "triton"])
def test_a_non_default_ignore_index_is_honoured(implementation, ignore_index) -> None:
    """Rows labelled ``ignore_index`` (even a real token id) cost nothing; -100 is not special."""
    if implementation == "triton":
        pytest.importorskip("triton")
    hidden, weight, labels = make_case(40, 16, 200, 0.0, torch.float32, seed=11)
    labels[::3] = ignore_index
    labels[1] = 7 if ignore_index == -1 else 8  # a real label next to the ignored ones
    hidden, weight, labels = hidden.to(DEVICE), weight.to(DEVICE), labels.to(DEVICE)
    if implementation == "reference":
        loss = partial(reference_linear_cross_entropy, ignore_index=ignore_index)
    else:
        loss = partial(
            fused_linear_cross_entropy, ignore_index=ignore_index, chunk_size=6, backend=implementation
        )
    ours = loss_and_grads(loss, hidden, weight, labels, reduction="sum")
    plain = loss_and_grads(
        lambda h, w, y, **kw: F.cross_entropy(h @ w.T, y, ignore_index=ignore_index, reduction="sum"),
        hidden,
        weight,
        labels,
    )
    for a, b in zip(ours, plain, strict=True):
        torch.testing.assert_close(a, b, **TOLERANCES[torch.float32])
    assert torch.equal(ours[1][labels == ignore_index], torch.zeros_like(ours[1][labels == ignore_index]))
