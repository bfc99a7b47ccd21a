"""NEFTune (issue 51): noise of scale alpha / sqrt(length * hidden) on the input embeddings in training
steps only; a step's loss equals the model's own forward under the same noise; refused where it has no
meaning (the pair losses) and for values that are none."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lit_instruct.data.collate import PadCollator
from lit_instruct.data.render import Sample
from lit_instruct.errors import ConfigError
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.train.module import InstructLoRAModule
from tests.helpers import make

ALPHA = 5.0


def batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    samples = []
    for length, prompt in ((13, 6), (9, 3)):
        ids = torch.randint(5, 1000, (length,), generator=gen).tolist()
        samples.append(Sample(ids, [IGNORE_INDEX] * prompt + ids[prompt:], "test"))
    return PadCollator(0)(samples)


def step_loss(module, data: dict[str, torch.Tensor], seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    loss_sum, count = module.loss_sum_and_count(data)
    return loss_sum / count


def test_the_noise_has_neftunes_scale_in_training_only(tiny_model_dir: Path, chat_file: Path) -> None:
    module, _ = make(tiny_model_dir, chat_file, neftune_noise_alpha=ALPHA)
    embeddings = module.base_model.get_input_embeddings()
    ids = batch()["input_ids"]
    clean = embeddings.eval()(ids)
    noisy = embeddings.train()(ids) - clean
    bound = ALPHA / math.sqrt(ids.shape[1] * clean.shape[-1])  # the paper's alpha / sqrt(L d)
    assert float(noisy.abs().max()) <= bound and float(noisy.abs().max()) > 0.9 * bound
    assert abs(float(noisy.mean())) < 0.05 * bound  # uniform in [-bound, bound]


def test_a_steps_loss_equals_the_models_own_under_the_same_noise(
    tiny_model_dir: Path, chat_file: Path
) -> None:
    module, _ = make(tiny_model_dir, chat_file, neftune_noise_alpha=ALPHA)
    quiet, _ = make(tiny_model_dir, chat_file)
    quiet.load_state_dict(module.state_dict())
    data = batch()
    module.train()
    ours = step_loss(module, data, seed=7)
    torch.manual_seed(7)
    own = module.model(**data, use_cache=False).loss  # the model's own loss, the same draw
    torch.testing.assert_close(ours, own, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ours, step_loss(module, data, seed=8))  # noise it is
    quiet.train()
    assert not torch.allclose(ours, step_loss(quiet, data, seed=7))
    module.eval()
    quiet.eval()
    with torch.no_grad():  # validation and generation see the embeddings as they are
        torch.testing.assert_close(step_loss(module, data, seed=1), step_loss(quiet, data, seed=2))


def test_values_that_are_none_and_the_pair_losses_are_refused(tiny_model_dir: Path, chat_file: Path) -> None:
    with pytest.raises(ConfigError, match=r"^model.neftune_noise_alpha: must be a positive number"):
        make(tiny_model_dir, chat_file, neftune_noise_alpha=0.0)
    with pytest.raises(ConfigError, match=r"^model.neftune_noise_alpha: applies to SFT"):
        InstructLoRAModule(model=str(tiny_model_dir), neftune_noise_alpha=ALPHA, objective="dpo")
