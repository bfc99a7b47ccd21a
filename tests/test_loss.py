"""The reference loss against plain cross-entropy and against transformers' own loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lit_instruct.data.collate import PadCollator
from lit_instruct.data.records import Message, Record
from lit_instruct.data.render import ChatRenderer
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.loss.reference import reference_linear_cross_entropy
from lit_instruct.models.lora import LoRAConfig
from lit_instruct.train.module import InstructLoRAModule


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reference_equals_cross_entropy_on_materialized_logits(reduction: str) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(101, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 101, (37,))
    labels[torch.rand(37) < 0.5] = IGNORE_INDEX

    ours = reference_linear_cross_entropy(hidden, weight, labels, reduction=reduction)
    ours_grads = torch.autograd.grad(ours, (hidden, weight))
    plain = F.cross_entropy(hidden @ weight.T, labels, ignore_index=IGNORE_INDEX, reduction=reduction)
    plain_grads = torch.autograd.grad(plain, (hidden, weight))

    torch.testing.assert_close(ours, plain)
    for a, b in zip(ours_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b)


def test_all_ignored_rows_give_a_graph_connected_zero() -> None:
    hidden = torch.randn(5, 8, requires_grad=True)
    weight = torch.randn(11, 8)
    loss = reference_linear_cross_entropy(hidden, weight, torch.full((5,), IGNORE_INDEX))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))


def test_module_loss_equals_transformers_loss_on_the_same_masked_batch(tiny_model_dir, tokenizer) -> None:
    module = InstructLoRAModule(model=str(tiny_model_dir), lora=LoRAConfig(r=4, alpha=8))
    renderer = ChatRenderer(tokenizer, 512)
    samples = [
        renderer(Record((Message("user", "Hi"), Message("assistant", "Hello!")), "a")),
        renderer(
            Record(
                (
                    Message("user", "Name three colours."),
                    Message("assistant", "Red, green and blue."),
                    Message("user", "And one more?"),
                    Message("assistant", "Yellow."),
                ),
                "b",
            )
        ),
    ]
    batch = PadCollator(tokenizer.pad_token_id)(samples)
    loss_sum, count = module.loss_sum_and_count(batch)
    expected = module.model(**batch).loss  # transformers shifts and averages over labels != -100
    assert count == sum(s.num_targets for s in samples)
    torch.testing.assert_close(loss_sum / count, expected)


def test_the_loss_package_imports_torch_only() -> None:
    """Layers point one way: a loss kernel pulls in neither the data pipeline nor transformers or
    Lightning (their global registrations included)."""
    import subprocess
    import sys

    heavy = ("transformers", "lightning", "lit_instruct.data", "peft")
    code = (
        "import sys, lit_instruct.loss, lit_instruct.loss.triton_ce; "
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout
